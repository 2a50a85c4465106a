#!/usr/bin/env bash
# Benchmark `specrun serve` against `specrun generate` in one run: tok/s streamed through the server and
# timed at the client vs generate's own, second-turn time to first token with a long shared prefix, and
# requests/s with p50/p95 latency at 1, 4 and 8 concurrent clients. Reproduces BENCHMARKS.md's serve section.
#
#   scripts/bench-serve.sh                          # the demo pair (fetch it: scripts/fetch-demo-models.sh)
#   TARGET=path/to/big.gguf DRAFT=path/to/small.gguf THREADS=8 scripts/bench-serve.sh
#   scripts/bench-serve.sh --runs 3 -n 256          # extra arguments go to scripts/tools/bench_serve.py
#   scripts/bench-serve.sh --sections load --clients 1,2,4,8 --parallel 1   # before/after --parallel
#
# The server listens on 127.0.0.1 on a free port and is stopped at the end. Uses <repo>/.venv (scripts/install.sh).
set -euo pipefail

TARGET="${TARGET:-qwen-1.5b}"
DRAFT="${DRAFT:-qwen-0.5b}"
THREADS="${THREADS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 4)}"

case "${1:-}" in -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python="$repo/.venv/bin/python"
if [[ ! -x "$python" ]]; then
  if command -v specrun >/dev/null 2>&1; then python="$(dirname "$(command -v specrun)")/python"
  else echo "error: no $repo/.venv and no specrun on PATH; run scripts/install.sh first" >&2; exit 1
  fi
fi

echo "date:      $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "machine:   $(uname -srm); $(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu) cores"
echo "command:   scripts/tools/bench_serve.py -m $TARGET -d $DRAFT -t $THREADS $*"
echo
exec "$python" "$repo/scripts/tools/bench_serve.py" -m "$TARGET" -d "$DRAFT" -t "$THREADS" "$@"
