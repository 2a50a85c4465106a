#!/usr/bin/env bash
# Serve a target model, sped up by a draft model, over an OpenAI-compatible API. A thin wrapper: copy it and edit the variables.
#
#   scripts/serve.sh                                # the demo pair on http://127.0.0.1:8080/v1
#   TARGET=path/to/big.gguf DRAFT=path/to/small.gguf PORT=9000 scripts/serve.sh
#   SPECRUN_API_KEY=... HOST=0.0.0.0 scripts/serve.sh   # reachable from other machines: use a key
#   scripts/serve.sh --quiet                        # extra arguments go to `specrun serve`
#
# TARGET and DRAFT are registry names (`specrun models`) or .gguf paths. Uses specrun from PATH,
# else <repo>/.venv/bin/specrun (made by scripts/install.sh). Stop it with Ctrl-C (exit 130) or SIGTERM (143).
set -euo pipefail

TARGET="${TARGET:-qwen-1.5b}"
DRAFT="${DRAFT:-qwen-0.5b}"
THREADS="${THREADS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 4)}"
CTX="${CTX:-4096}"
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-8080}"

case "${1:-}" in -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if command -v specrun >/dev/null 2>&1; then specrun=$(command -v specrun)
elif [[ -x "$repo/.venv/bin/specrun" ]]; then specrun="$repo/.venv/bin/specrun"
else echo "error: specrun not found on PATH or in $repo/.venv; run scripts/install.sh first" >&2; exit 1
fi

exec "$specrun" serve -m "$TARGET" -d "$DRAFT" -t "$THREADS" -c "$CTX" --host "$HOST" --port "$PORT" "$@"
