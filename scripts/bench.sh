#!/usr/bin/env bash
# Benchmark a target/draft pair with `specrun bench` and print a markdown table; this is the script
# that reproduces BENCHMARKS.md. A thin wrapper: copy it and edit the variables.
#
#   scripts/bench.sh                                # the demo pair (fetch it: scripts/fetch-demo-models.sh)
#   TARGET=path/to/big.gguf DRAFT=path/to/small.gguf THREADS=8 scripts/bench.sh
#   scripts/bench.sh -n 256                         # extra arguments go to `specrun bench`
#
# Before running, it prints the date, the machine, the llama_cpp version and the exact command, so the
# output can be pasted into BENCHMARKS.md as is. Uses specrun from PATH, else <repo>/.venv/bin/specrun.
set -euo pipefail

TARGET="${TARGET:-qwen-1.5b}"
DRAFT="${DRAFT:-qwen-0.5b}"
THREADS="${THREADS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 4)}"

case "${1:-}" in -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if command -v specrun >/dev/null 2>&1; then specrun=$(command -v specrun)
elif [[ -x "$repo/.venv/bin/specrun" ]]; then specrun="$repo/.venv/bin/specrun"
else echo "error: specrun not found on PATH or in $repo/.venv; run scripts/install.sh first" >&2; exit 1
fi
python="$(dirname "$specrun")/python"
[[ -x "$python" ]] || python="${PYTHON:-python3}"

cpu_name() {
  if [[ -r /proc/cpuinfo ]]; then sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1
  else sysctl -n machdep.cpu.brand_string 2>/dev/null || uname -m
  fi
}
mem_gib() {
  if [[ -r /proc/meminfo ]]; then awk '/^MemTotal:/ {printf "%.1f", $2 / 1048576}' /proc/meminfo
  else sysctl -n hw.memsize 2>/dev/null | awk '{printf "%.1f", $1 / 1073741824}'
  fi
}
cmd=("$specrun" bench -m "$TARGET" -d "$DRAFT" -t "$THREADS" --markdown "$@")

echo "date:      $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "machine:   $(uname -srm); $(cpu_name); $(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu) cores; $(mem_gib) GiB RAM"
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu:       $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 1)"
fi
echo "llama_cpp: $("$python" -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null || echo 'not importable')"
printf 'command:   '; printf '%q ' "${cmd[@]}"; echo
echo
exec "${cmd[@]}"
