#!/usr/bin/env bash
# Install specrun into a virtual environment, with llama-cpp-python built for this machine's backend.
#
#   scripts/install.sh                          # venv in <repo>/.venv, backend detected
#   scripts/install.sh ~/venvs/specrun          # venv elsewhere
#   scripts/install.sh --extras test            # also the test extras (or SPECRUN_EXTRAS=test)
#   scripts/install.sh --force-backend cpu      # cpu, cuda or metal, instead of detecting
#
# Backend: CUDA when an NVIDIA driver is present (nvidia-smi; building needs the CUDA toolkit, nvcc),
# Metal on Apple Silicon, CPU otherwise; always with llama.cpp's RPC backend (specrun worker, --rpc).
# A CMAKE_ARGS of your own is used as is (plus -DGGML_RPC=on unless it sets GGML_RPC).
# llama-cpp-python compiles from source (several minutes; pip caches the wheel). Re-running upgrades
# in place, and rebuilds llama-cpp-python only when the backend changes. Python: ${PYTHON:-python3} >= 3.10.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python="${PYTHON:-python3}"
extras="${SPECRUN_EXTRAS:-}"
force=""
venv=""

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }
die2() { echo "error: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --extras) [[ $# -ge 2 ]] || die2 "--extras needs a value, e.g. --extras test"; extras=$2; shift ;;
    --extras=*) extras=${1#--extras=} ;;
    --force-backend) [[ $# -ge 2 ]] || die2 "--force-backend needs cpu, cuda or metal"; force=$2; shift ;;
    --force-backend=*) force=${1#--force-backend=} ;;
    -*) die2 "unknown option '$1' (see --help)" ;;
    *) [[ -z "$venv" ]] || die2 "only one VENV_DIR, got '$venv' and '$1'"; venv=$1 ;;
  esac
  shift
done
case "$force" in
  ""|cpu|cuda|metal) ;;
  *) die2 "--force-backend must be cpu, cuda or metal, not '$force'" ;;
esac
case "$extras" in
  *[!A-Za-z0-9_,-]*) die2 "--extras takes names like 'test' or 'test,dev', not '$extras'" ;;
esac
venv="${venv:-$repo/.venv}"

# --- Python >= 3.10 ------------------------------------------------------------------------------
check_python() {  # $1 = interpreter; $2 = what to tell the user to do about it
  local ver
  ver=$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || {
    echo "error: cannot run '$1'; install Python 3.10 or newer, or set PYTHON=/path/to/python3.x" >&2; exit 1; }
  if ! "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "error: specrun needs Python >= 3.10, but $1 is Python $ver; $2" >&2
    exit 1
  fi
}
if [[ -x "$venv/bin/python" ]]; then
  check_python "$venv/bin/python" "remove $venv and re-run with PYTHON=python3.10 (or newer)"
else
  check_python "$python" "re-run with PYTHON=python3.10 (or newer)"
fi

# --- backend -------------------------------------------------------------------------------------
os=$(uname -s)
arch=$(uname -m)
nvidia_smi=$(command -v nvidia-smi 2>/dev/null || true)
[[ -z "$nvidia_smi" && -x /usr/lib/wsl/lib/nvidia-smi ]] && nvidia_smi=/usr/lib/wsl/lib/nvidia-smi
nvcc=$(command -v nvcc 2>/dev/null || true)

backend=""
why=""
if [[ -n "$force" ]]; then
  backend=$force
  why="forced with --force-backend"
  [[ -n "${CMAKE_ARGS:-}" ]] && echo "note: --force-backend $force replaces your CMAKE_ARGS ($CMAKE_ARGS)"
elif [[ -n "${CMAKE_ARGS:-}" ]]; then
  backend=custom
  why="your CMAKE_ARGS, used as is: $CMAKE_ARGS"
elif [[ -n "$nvidia_smi" ]]; then
  backend=cuda
  why="nvidia-smi found at $nvidia_smi"
elif [[ "$os" == Darwin && "$arch" == arm64 ]]; then
  backend=metal
  why="Apple Silicon"
else
  backend=cpu
  if [[ -n "$nvcc" ]]; then
    why="nvcc found at $nvcc but no NVIDIA driver (no nvidia-smi); --force-backend cuda to build for CUDA anyway"
  elif [[ "$os" == Darwin && "$(sysctl -n hw.optional.arm64 2>/dev/null || echo 0)" == 1 ]]; then
    why="this shell runs under Rosetta (x86_64); run it natively (arch -arm64 bash $0) for Metal"
  else
    why="no NVIDIA driver, not Apple Silicon"
  fi
fi
# Every build also gets llama.cpp's RPC backend, so one install serves as main host and as worker.
case "$backend" in
  cuda) CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=on" ;;
  metal) CMAKE_ARGS="-DGGML_METAL=on -DGGML_RPC=on" ;;
  cpu) CMAKE_ARGS="-DGGML_RPC=on" ;;
  custom) [[ "$CMAKE_ARGS" == *GGML_RPC* ]] || { CMAKE_ARGS="$CMAKE_ARGS -DGGML_RPC=on"; why="$why, plus -DGGML_RPC=on"; } ;;
esac
label=$backend
case "$backend" in cuda) label=CUDA ;; metal) label=Metal ;; cpu) label=CPU ;; esac
echo "backend: $label ($why)"
if [[ "$backend" == cuda && -z "$nvcc" ]]; then
  echo "note: building for CUDA needs the CUDA toolkit (nvcc), and none is on PATH; the build will fail without it"
fi
if grep -qi microsoft /proc/version 2>/dev/null; then
  echo "WSL2 detected: CUDA on WSL2 uses the Windows NVIDIA driver; do not install a Linux NVIDIA driver inside WSL"
fi
export CMAKE_ARGS
# Intel AMX: off unless SPECRUN_AMX=1. ggml's AMX kernels (used for quantized weights when the compiler
# targets a CPU with AMX, as -march=native does) crash with "Illegal instruction" in some VMs that
# advertise AMX (seen on a Firecracker VM), and consumer CPUs do not have AMX at all.
amx_off=0
if [[ "$arch" == x86_64 && "${SPECRUN_AMX:-0}" != 1 ]]; then
  amx_off=1
  export CFLAGS="${CFLAGS:-} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  export CXXFLAGS="${CXXFLAGS:-} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
if [[ -z "${CMAKE_BUILD_PARALLEL_LEVEL:-}" ]]; then
  CMAKE_BUILD_PARALLEL_LEVEL=$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 2)
fi
export CMAKE_BUILD_PARALLEL_LEVEL

# --- venv ----------------------------------------------------------------------------------------
if [[ -x "$venv/bin/python" ]]; then
  echo "venv: $venv (exists; upgrading in place)"
else
  echo "venv: creating $venv with $python"
  "$python" -m venv "$venv" || {
    echo "error: could not create a venv with $python (on Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }
fi
vpy="$venv/bin/python"
pip_q() {  # pip, without its "Location ... is ignored" and "Requirement already satisfied" noise
  "$vpy" -m pip "$@" 2>&1 |
    { grep --line-buffered -v -e "^WARNING: Location '.*' is ignored" -e "^Requirement already satisfied" || true; }
}
pip_q install --quiet --upgrade pip || echo "note: could not upgrade pip in the venv; carrying on with its pip"

# The backend llama-cpp-python was last built with is kept next to the venv's python.
marker="$venv/.specrun-backend"
installed=$("$vpy" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)
previous=$(cat "$marker" 2>/dev/null || echo "unknown")
gpu_offload() {  # 1 or 0: does the venv's llama_cpp ship a GPU backend (CUDA, Metal)? "broken" if it won't import
  # (llama_supports_gpu_offload() cannot tell: a build with the RPC backend always says yes)
  "$vpy" -c 'import pathlib, llama_cpp; d = pathlib.Path(llama_cpp.__file__).parent / "lib"; print(int(any(d.glob("libggml-cuda*")) or any(d.glob("libggml-metal*"))))' 2>/dev/null || echo "broken"
}
amx_built() {  # 1 if the venv's llama_cpp was compiled with ggml's AMX kernels, else 0
  "$vpy" -c 'import pathlib, llama_cpp; d = pathlib.Path(llama_cpp.__file__).parent / "lib"; print(int(any(b"amx17extra_buffer_type" in p.read_bytes() for p in d.glob("libggml-cpu*") if p.is_file())))' 2>/dev/null || echo 0
}
rpc_support() {  # 1 or 0: was llama-cpp-python built with the RPC backend?
  "$vpy" -c 'import llama_cpp; print(int(llama_cpp.llama_supports_rpc()))' 2>/dev/null || echo "broken"
}
want=""
case "$backend" in cpu) want=0 ;; cuda|metal) want=1 ;; esac
if [[ -n "$installed" && "$previous" == unknown && -n "$want" && "$(gpu_offload)" == "$want" && "$(rpc_support)" == 1 ]]; then
  previous="cmake_args=$CMAKE_ARGS"  # installed before this script ran, and already right for the backend
fi

rebuild() {  # rebuild the installed llama-cpp-python version for CMAKE_ARGS, bypassing pip's wheel cache
  echo "rebuilding llama-cpp-python $1 for ${CMAKE_ARGS:-CPU} (compiles from source: several minutes)"
  pip_q install --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==$1"
}
if [[ -n "$installed" && "$previous" != "cmake_args=$CMAKE_ARGS" ]]; then
  case "$previous" in
    unknown) was="an unknown backend (it was installed without this script)" ;;
    "cmake_args=") was="CPU" ;;
    *) was="CMAKE_ARGS=${previous#cmake_args=}" ;;
  esac
  echo "llama-cpp-python $installed was built for $was; the backend changed"
  rebuild "$installed"
elif [[ -z "$installed" ]]; then
  echo "llama-cpp-python will compile from source: several minutes on a laptop (pip caches the wheel)"
fi

target="$repo"
[[ -n "$extras" ]] && target="${repo}[$extras]"
echo "installing specrun from $target"
pip_q install --upgrade -e "$target"
installed=$("$vpy" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')

# pip's wheel cache is not keyed by CMAKE_ARGS: a wheel built for another backend may have been reused.
gpu=$(gpu_offload)
rpc=$(rpc_support)
amx=$(amx_built)
if [[ -n "$want" && ( "$gpu" != "$want" || ( "$rpc" != 1 && "$backend" != custom ) || ( "$amx" == 1 && "$amx_off" == 1 ) ) ]]; then
  echo "the llama-cpp-python wheel pip used does not match the backend (gpu backend: $gpu, rpc: $rpc, amx: $amx)"
  rebuild "$installed"
  gpu=$(gpu_offload)
  rpc=$(rpc_support)
  [[ "$gpu" == "$want" ]] || echo "warning: llama-cpp-python still reports gpu offload: $gpu" >&2
  [[ "$rpc" == 1 ]] || echo "warning: llama-cpp-python still reports no RPC backend" >&2
fi
echo "cmake_args=$CMAKE_ARGS" >"$marker"
[[ "$amx_off" == 1 && "$(amx_built)" == 1 ]] && echo "warning: llama-cpp-python still has AMX kernels (set SPECRUN_AMX=1 if that is intended)" >&2

echo
echo "specrun is installed (llama-cpp-python $installed, backend $label)."
echo "Activate the venv:   source \"$venv/bin/activate\""
echo "Then check the setup: specrun doctor"
