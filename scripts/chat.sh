#!/usr/bin/env bash
# Chat with a target model, sped up by a draft model. A thin wrapper: copy it and edit the variables.
#
#   scripts/chat.sh                                 # the demo pair (fetch it: scripts/fetch-demo-models.sh)
#   TARGET=path/to/big.gguf DRAFT=path/to/small.gguf scripts/chat.sh
#   scripts/chat.sh --temp 0.7                      # extra arguments go to `specrun chat`
#
# TARGET and DRAFT are registry names (`specrun models`) or .gguf paths. Uses specrun from PATH,
# else <repo>/.venv/bin/specrun (made by scripts/install.sh).
set -euo pipefail

TARGET="${TARGET:-qwen-1.5b}"
DRAFT="${DRAFT:-qwen-0.5b}"
THREADS="${THREADS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 4)}"
CTX="${CTX:-4096}"

case "${1:-}" in -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if command -v specrun >/dev/null 2>&1; then specrun=$(command -v specrun)
elif [[ -x "$repo/.venv/bin/specrun" ]]; then specrun="$repo/.venv/bin/specrun"
else echo "error: specrun not found on PATH or in $repo/.venv; run scripts/install.sh first" >&2; exit 1
fi

exec "$specrun" chat -m "$TARGET" -d "$DRAFT" -t "$THREADS" -c "$CTX" "$@"
