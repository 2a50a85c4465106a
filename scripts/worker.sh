#!/usr/bin/env bash
# Serve this machine's GPUs (or CPU) to a specrun on another machine, over llama.cpp's RPC.
# A thin wrapper around `specrun worker`: copy it to each worker box and edit the variables.
#
#   scripts/worker.sh                      # 127.0.0.1:50052: only this machine can connect
#   HOST=0.0.0.0 scripts/worker.sh         # every interface: TRUSTED NETWORKS ONLY (see below)
#   PORT=50053 DEVICES=CUDA1 scripts/worker.sh
#
# On the main machine:  specrun generate -m 70b -d 8b --rpc WORKER_IP:50052 -p "..."
# RPC has no authentication and no encryption: anyone who reaches the port can use this
# machine's devices. With HOST other than 127.0.0.1 this script passes
# --i-know-rpc-is-unauthenticated; keep the port behind a firewall, or tunnel it (ssh -L).
# CACHE=DIR keeps the tensors clients send there, so the next load of the same model is local.
# Uses specrun from PATH, else <repo>/.venv/bin/specrun (made by scripts/install.sh).
set -euo pipefail

HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-50052}"
DEVICES="${DEVICES:-}"
CACHE="${CACHE:-}"
THREADS="${THREADS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 4)}"

case "${1:-}" in -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if command -v specrun >/dev/null 2>&1; then specrun=$(command -v specrun)
elif [[ -x "$repo/.venv/bin/specrun" ]]; then specrun="$repo/.venv/bin/specrun"
else echo "error: specrun not found on PATH or in $repo/.venv; run scripts/install.sh first" >&2; exit 1
fi

args=(worker --host "$HOST" --port "$PORT" -t "$THREADS")
[[ -n "$DEVICES" ]] && args+=(--device "$DEVICES")
[[ -n "$CACHE" ]] && args+=(--cache "$CACHE")
[[ "$HOST" != 127.* ]] && args+=(--i-know-rpc-is-unauthenticated)
exec "$specrun" "${args[@]}" "$@"
