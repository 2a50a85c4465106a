#!/usr/bin/env bash
# Compare specrun with llama.cpp's own speculative decoding, on the same models, prompt and settings.
#
#   scripts/compare-llama-cpp.sh                # build llama.cpp tools once, then compare (RUNS=2 each)
#   scripts/compare-llama-cpp.sh --runs 3       # three runs of each tool, alternated A B A B ...
#   scripts/compare-llama-cpp.sh --plain        # also measure plain decoding of the target (llama-bench)
#   scripts/compare-llama-cpp.sh --build-only   # only build llama.cpp's tools, run nothing
#   scripts/compare-llama-cpp.sh --ngram        # specrun's default mode against every llama.cpp n-gram type
#                                               # (ngram-simple, -map-k, -map-k4v, -mod, -cache) on the bench's
#                                               # code-edit and summarise prompts, RUNS (default 3) runs each,
#                                               # alternated, medians (scripts/tools/compare_ngram.py)
#   scripts/compare-llama-cpp.sh --draft-model  # the draft model where it pays: the memory-bound F16 target
#                                               # (scripts/fetch-demo-models.sh --f16) against
#                                               # llama-speculative-simple --spec-type draft-simple at its
#                                               # defaults and at n-max 4, 8 and 16; specrun's default and
#                                               # --draft model; code-gen, explain and chat prompts, RUNS (3)
#   scripts/compare-llama-cpp.sh --serve        # specrun serve at its defaults against llama-server (draft-simple,
#                                               # ngram-mod, plain) through the same openai client, 1 and 4
#                                               # concurrent clients, RUNS (3) runs alternated, medians of tok/s
#                                               # per client and total and of TTFT (scripts/tools/compare_serve.py)
#
# llama.cpp is built from the llama-cpp-python sdist of the version installed in specrun's venv
# (vendor/llama.cpp), so both tools run the same kernels. The build (several minutes, once) goes to
# ${SPECRUN_CACHE:-~/.cache/specrun}/llama.cpp-VERSION/ and is skipped when its binaries exist.
# Environment: TARGET_GGUF, DRAFT_GGUF (default: the demo pair from scripts/fetch-demo-models.sh,
# fetched if missing), THREADS (default: all cores), RUNS (2), N_PREDICT (128), DRAFT_MAX (4),
# CTX (4096), NGL (99), LLAMA_CPP_VERSION (skip asking the venv), SPECRUN (the specrun executable),
# TARGET_F16_GGUF and CLASSES (--draft-model: the F16 target, and the bench classes to run).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache="${SPECRUN_CACHE:-$HOME/.cache/specrun}"
models_dir="${SPECRUN_MODELS_DIR:-$HOME/.cache/specrun/models}"
default_target="$models_dir/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
default_draft="$models_dir/qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf"
TARGET_GGUF="${TARGET_GGUF:-$default_target}"
DRAFT_GGUF="${DRAFT_GGUF:-$default_draft}"

cores() {
  getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 4
}
THREADS="${THREADS:-$(cores)}"
RUNS_SET="${RUNS:-}"  # --ngram defaults to 3 runs unless RUNS or --runs says
RUNS="${RUNS:-2}"
N_PREDICT="${N_PREDICT:-128}"
DRAFT_MAX="${DRAFT_MAX:-4}"
CTX="${CTX:-4096}"
NGL="${NGL:-99}"
PROMPT=$'<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWrite a Python function that parses an ISO 8601 date string and returns a datetime, with error handling and a docstring.<|im_end|>\n<|im_start|>assistant\n'

build_only=0
plain=0
ngram=0
serve=0
draft_model=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-only) build_only=1 ;;
    --plain) plain=1 ;;
    --ngram) ngram=1 ;;
    --serve) serve=1 ;;
    --draft-model) draft_model=1 ;;
    --runs) [[ $# -ge 2 ]] || { echo "error: --runs needs a number" >&2; exit 2; }; RUNS=$2; RUNS_SET=$2; shift ;;
    --runs=*) RUNS=${1#--runs=}; RUNS_SET=$RUNS ;;
    -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$RUNS" in ''|*[!0-9]*|0) echo "error: RUNS must be a positive integer, got '$RUNS'" >&2; exit 2 ;; esac

# --- find specrun and the python of its venv ---------------------------------------------------
specrun="${SPECRUN:-}"
if [[ -z "$specrun" ]]; then
  if command -v specrun >/dev/null 2>&1; then specrun=$(command -v specrun)
  elif [[ -x "$repo/.venv/bin/specrun" ]]; then specrun="$repo/.venv/bin/specrun"
  fi
fi
venv_python=""
if [[ -n "$specrun" && -x "$(dirname "$specrun")/python" ]]; then venv_python="$(dirname "$specrun")/python"
elif [[ -x "$repo/.venv/bin/python" ]]; then venv_python="$repo/.venv/bin/python"
else venv_python="${PYTHON:-python3}"
fi

version="${LLAMA_CPP_VERSION:-}"
if [[ -z "$version" ]]; then
  version=$("$venv_python" -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null ||
    "$venv_python" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null) || {
    echo "error: llama_cpp is not importable with $venv_python; run scripts/install.sh first" >&2
    echo "       (or set LLAMA_CPP_VERSION=0.3.x to build that version anyway)" >&2
    exit 1
  }
fi

# --- build llama.cpp's tools once ----------------------------------------------------------------
dest="$cache/llama.cpp-$version"
bin="$dest/build/bin"
pip_quiet() {  # pip, without its "Location ... is ignored" noise
  "$@" 2>&1 | { grep --line-buffered -v "^WARNING: Location '.*' is ignored" || true; }
}

build_llama_cpp() {
  local start=$SECONDS
  local jobs
  jobs=$(cores)
  mkdir -p "$dest/sdist"
  local tarball
  tarball=$(find "$dest/sdist" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n 1)
  if [[ -z "$tarball" ]]; then
    echo "downloading the llama-cpp-python $version sdist"
    pip_quiet "$venv_python" -m pip download --quiet --no-deps --no-binary :all: \
      -d "$dest/sdist" "llama-cpp-python==$version"
    tarball=$(find "$dest/sdist" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n 1)
    [[ -n "$tarball" ]] || { echo "error: pip saved no llama_cpp_python sdist in $dest/sdist" >&2; exit 1; }
  fi
  rm -rf "$dest/src"
  mkdir -p "$dest/src"
  tar -xzf "$tarball" -C "$dest/src" --strip-components 1
  local src="$dest/src/vendor/llama.cpp"
  [[ -f "$src/CMakeLists.txt" ]] || { echo "error: $tarball has no vendor/llama.cpp" >&2; exit 1; }

  # App and tests are off; the server is on (llama-server is the serving anchor, and llama-cli needs it).
  local args=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF)
  # Without AMX kernels, as scripts/install.sh builds specrun's llama.cpp (they fault in some VMs),
  # so both tools run the same kernels.
  if [[ "$(uname -m)" == x86_64 && "${SPECRUN_AMX:-0}" != 1 ]]; then
    args+=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
  fi
  # CUDA needs both the toolkit (nvcc) to build and a GPU (nvidia-smi) to run; nvcc alone is a build box.
  if command -v nvcc >/dev/null 2>&1 && command -v nvidia-smi >/dev/null 2>&1; then
    args+=(-DGGML_CUDA=on); echo "nvcc and nvidia-smi found: building with CUDA"
  else
    args+=(-DGGML_CUDA=OFF)  # explicit, so a build dir configured earlier with CUDA is reconfigured
    if command -v nvcc >/dev/null 2>&1; then echo "nvcc found but no nvidia-smi (no NVIDIA GPU): building for CPU"; fi
  fi
  echo "configuring llama.cpp $version in $dest/build (cmake ${args[*]})"
  cmake -S "$src" -B "$dest/build" "${args[@]}" >"$dest/cmake-configure.log" 2>&1 || {
    tail -n 20 "$dest/cmake-configure.log" >&2; echo "error: cmake configure failed; see $dest/cmake-configure.log" >&2; exit 1; }

  local available targets=() t
  available=$(cmake --build "$dest/build" --target help 2>/dev/null || true)
  for t in llama-speculative-simple llama-bench llama-quantize llama-server llama-cli; do
    if grep -Eq "(^|[ .])$t(:|\$| )" <<<"$available"; then targets+=("$t")
    elif [[ $t == llama-cli ]]; then echo "note: no llama-cli target in this configuration (optional, skipped)"
    else echo "error: llama.cpp $version has no target $t" >&2; exit 1
    fi
  done
  echo "building ${targets[*]} with $jobs jobs (several minutes on a laptop; done once)"
  cmake --build "$dest/build" --config Release -j "$jobs" --target "${targets[@]}" >"$dest/cmake-build.log" 2>&1 || {
    tail -n 30 "$dest/cmake-build.log" >&2; echo "error: build failed; see $dest/cmake-build.log" >&2; exit 1; }
  # Multi-config generators (Visual Studio, Xcode) put binaries in bin/Release.
  if [[ ! -x "$bin/llama-speculative-simple" && -x "$bin/Release/llama-speculative-simple" ]]; then
    ln -sf Release/* "$bin/" 2>/dev/null || true
  fi
  echo "built llama.cpp $version in $((SECONDS - start)) s: $bin"
}

if [[ -x "$bin/llama-speculative-simple" && -x "$bin/llama-bench" && -x "$bin/llama-quantize" && -x "$bin/llama-server" ]]; then
  echo "llama.cpp $version already built: $bin"
else
  build_llama_cpp
fi
[[ $build_only == 1 ]] && exit 0

if [[ $draft_model == 1 ]]; then
  [[ -x "$venv_python" ]] || { echo "error: no python with specrun installed; run scripts/install.sh first" >&2; exit 1; }
  f16="${TARGET_F16_GGUF:-$models_dir/qwen2.5-coder-1.5b-instruct-f16.gguf}"
  [[ -f "$f16" ]] || { echo "error: no F16 target at $f16; make it with scripts/fetch-demo-models.sh --f16" >&2; exit 1; }
  exec "$venv_python" "$repo/scripts/tools/compare_ngram.py" --bin "$bin" --target "$f16" --draft "$DRAFT_GGUF" \
    --classes "${CLASSES:-code-gen,explain,chat}" --types draft-simple,draft-simple@4,draft-simple@8,draft-simple@16 \
    --specrun-modes model --runs "${RUNS_SET:-3}" -t "$THREADS"
fi

if [[ $ngram == 1 ]]; then
  [[ -x "$venv_python" ]] || { echo "error: no python with specrun installed; run scripts/install.sh first" >&2; exit 1; }
  exec "$venv_python" "$repo/scripts/tools/compare_ngram.py" --bin "$bin" --target "$TARGET_GGUF" --draft "$DRAFT_GGUF" \
    --runs "${RUNS_SET:-3}" -t "$THREADS"
fi

if [[ $serve == 1 ]]; then
  [[ -x "$venv_python" ]] || { echo "error: no python with specrun installed; run scripts/install.sh first" >&2; exit 1; }
  [[ -x "$bin/llama-server" ]] || { echo "error: the build has no $bin/llama-server" >&2; exit 1; }
  serve_args=(--bin "$bin" --target "$TARGET_GGUF" --draft "$DRAFT_GGUF" --runs "${RUNS_SET:-3}" -t "$THREADS" -c "$CTX" --ngl "$NGL")
  [[ -n "$specrun" ]] && serve_args+=(--specrun "$specrun")
  exec "$venv_python" "$repo/scripts/tools/compare_serve.py" "${serve_args[@]}"
fi

# --- models --------------------------------------------------------------------------------------
for f in "$TARGET_GGUF" "$DRAFT_GGUF"; do
  if [[ ! -f "$f" ]]; then
    if [[ "$f" == "$default_target" || "$f" == "$default_draft" ]]; then
      echo "demo model $f is missing; fetching it"
      SPECRUN_MODELS_DIR="$models_dir" bash "$repo/scripts/fetch-demo-models.sh" qwen-1.5b qwen-0.5b
    else
      echo "error: model file $f does not exist" >&2; exit 1
    fi
  fi
done

# --- llama-speculative-simple flags (renamed across llama.cpp versions) -----------------------
spec_help=$("$bin/llama-speculative-simple" --help 2>&1 || true)
has_flag() { grep -q -- "$1" <<<"$spec_help"; }
spec_args=(-m "$TARGET_GGUF" -md "$DRAFT_GGUF")
if has_flag "--spec-draft-n-max"; then
  has_flag "--spec-type" && spec_args+=(--spec-type draft-simple)
  spec_args+=(--spec-draft-n-max "$DRAFT_MAX" --spec-draft-n-min 0)
  # p-min 0 (the default in 0.3.x) drafts all K tokens every round, like specrun --fixed.
  has_flag "--spec-draft-p-min" && spec_args+=(--spec-draft-p-min 0)
elif has_flag "--draft-max"; then
  spec_args+=(--draft-max "$DRAFT_MAX" --draft-min 0)
else
  echo "error: llama-speculative-simple knows neither --spec-draft-n-max nor --draft-max" >&2; exit 1
fi
spec_args+=(-n "$N_PREDICT" --temp 0 -t "$THREADS" -td "$THREADS" -c "$CTX" -ngl "$NGL" -ngld "$NGL")

logs="$dest/logs"
mkdir -p "$logs"

run_llama() {  # $1 = run number; prints "TPS ACCEPT%" or "failed"
  local log="$logs/llama-spec-$1.log" tps acc
  if "$bin/llama-speculative-simple" "${spec_args[@]}" -p "$PROMPT" >"$log" 2>&1; then
    tps=$(sed -nE 's/.*decoded +[0-9]+ tokens in +[0-9.]+ seconds, speed: +([0-9.]+) t\/s.*/\1/p' "$log" | tail -n 1)
    acc=$(sed -nE 's/.*accept += *([0-9.]+)%.*/\1/p' "$log" | tail -n 1)
    if [[ -n "$tps" ]]; then echo "$tps ${acc:-?}"; return 0; fi
  fi
  echo "failed"
}

run_specrun() {  # $1 = run number; prints "TPS ACCEPT%" or "failed"
  local out="$logs/specrun-$1.json" err="$logs/specrun-$1.err"
  [[ -n "$specrun" ]] || { echo "specrun not found (not on PATH, no $repo/.venv/bin/specrun)" >"$err"; echo "failed"; return 0; }
  local rc=0
  "$specrun" generate -m "$TARGET_GGUF" -d "$DRAFT_GGUF" --draft model --fixed --draft-max "$DRAFT_MAX" \
    --draft-min 0 --draft-p-min 0 --tie-margin 0 -p "$PROMPT" -n "$N_PREDICT" --temp 0 -t "$THREADS" -c "$CTX" --json >"$out" 2>"$err" || rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "specrun generate exited with status $rc" >>"$err"
    echo "failed"
    return 0
  fi
  python3 - "$out" <<'PY' 2>>"$err" && return 0
import json, sys
text = open(sys.argv[1]).read()
try:
    doc = json.loads(text)
except ValueError:  # tolerate log lines before the JSON document
    doc = json.loads(text[text.index("{"):])
s = doc["stats"]
acc = s.get("acceptance_rate")
acc = "?" if acc is None else "%.1f" % (acc * 100 if acc <= 1 else acc)
print("%.2f %s" % (float(s["generation_tps"]), acc))
PY
  echo "could not read stats.generation_tps and stats.acceptance_rate from $out" >>"$err"
  echo "failed"
}

echo "target: $TARGET_GGUF"
echo "draft:  $DRAFT_GGUF"
echo "settings: K=$DRAFT_MAX, -n $N_PREDICT, temp 0, $THREADS threads, ctx $CTX, ngl $NGL; $RUNS run(s) each, alternated"
echo "llama.cpp: $bin/llama-speculative-simple ${spec_args[*]} -p <prompt>"
echo "specrun:   ${specrun:-specrun} generate -m ... -d ... --draft model --fixed --draft-max $DRAFT_MAX --draft-min 0 --draft-p-min 0 --tie-margin 0 -p <prompt> -n $N_PREDICT --temp 0 -t $THREADS -c $CTX --json"

llama_tps=() llama_acc="" spec_tps=() spec_acc="" spec_failed=0 llama_failed=0
for ((i = 1; i <= RUNS; i++)); do
  r=$(run_llama "$i")
  if [[ $r == failed ]]; then
    llama_failed=1
    echo "run $i llama.cpp: FAILED; last lines of $logs/llama-spec-$i.log:" >&2
    tail -n 5 "$logs/llama-spec-$i.log" >&2
  else
    llama_tps+=("${r% *}"); llama_acc=${r#* }
    echo "run $i llama.cpp: ${r% *} tok/s, acceptance ${r#* }%"
  fi
  r=$(run_specrun "$i")
  if [[ $r == failed ]]; then
    spec_failed=1
    echo "run $i specrun:   FAILED; last lines of $logs/specrun-$i.err:" >&2
    tail -n 5 "$logs/specrun-$i.err" >&2
  else
    spec_tps+=("${r% *}"); spec_acc=${r#* }
    echo "run $i specrun:   ${r% *} tok/s, acceptance ${r#* }%"
  fi
done

mean() { if [[ $# -eq 0 ]]; then echo "n/a"; else printf '%s\n' "$@" | awk '{s += $1} END {printf "%.2f", s / NR}'; fi; }
llama_mean=$(mean ${llama_tps[@]+"${llama_tps[@]}"})
spec_mean=$(mean ${spec_tps[@]+"${spec_tps[@]}"})
joined() { if [[ $# -eq 0 ]]; then echo "-"; else local IFS=' '; echo "$*"; fi; }

plain_tps="n/a"
if [[ $plain == 1 ]]; then
  echo "plain decoding of the target (llama-bench -p 0 -n 64 -r 3 -t $THREADS)"
  if "$bin/llama-bench" -m "$TARGET_GGUF" -p 0 -n 64 -r 3 -t "$THREADS" -ngl "$NGL" -o jsonl >"$logs/llama-bench.jsonl" 2>"$logs/llama-bench.err"; then
    plain_tps=$(python3 -c 'import json,sys; print("%.2f" % json.loads(open(sys.argv[1]).read().splitlines()[-1])["avg_ts"])' "$logs/llama-bench.jsonl" 2>/dev/null || echo "n/a")
  else
    echo "llama-bench failed; see $logs/llama-bench.err" >&2
  fi
fi

echo
printf '%-22s %-24s %8s %11s\n' "tool" "tok/s per run" "mean" "acceptance"
printf '%-22s %-24s %8s %11s\n' "llama.cpp $version" "$(joined ${llama_tps[@]+"${llama_tps[@]}"})" "$llama_mean" "${llama_acc:-n/a}%"
if [[ ${#spec_tps[@]} -gt 0 ]]; then
  printf '%-22s %-24s %8s %11s\n' "specrun" "$(joined "${spec_tps[@]}")" "$spec_mean" "${spec_acc}%"
else
  printf '%-22s %-24s %8s %11s\n' "specrun" "failed" "n/a" "n/a"
fi
[[ $plain == 1 ]] && printf '%-22s %-24s %8s %11s\n' "plain (llama-bench)" "-" "$plain_tps" "-"
if [[ $llama_mean != n/a && $spec_mean != n/a ]]; then
  echo "specrun / llama.cpp: $(awk -v a="$spec_mean" -v b="$llama_mean" 'BEGIN {printf "%.2f", a / b}')"
else
  echo "specrun / llama.cpp: n/a"
fi
[[ $spec_failed == 1 ]] && echo "note: specrun failed in at least one run; see $logs/specrun-*.err" >&2
[[ $llama_failed == 1 ]] && echo "note: llama.cpp failed in at least one run; see $logs/llama-spec-*.log" >&2
exit 0
