#!/usr/bin/env bash
# A/B a change against a base commit on every bench class, in both regimes of this machine.
#
#   scripts/ab.sh BASE                   # e.g. scripts/ab.sh main~1, or a commit id
#   RUNS=3 LIMIT=1 scripts/ab.sh BASE    # runs (alternated, medians), prompts per class
#   REGIMES=q4 scripts/ab.sh BASE        # only the compute-bound demo pair (q4), or only f16
#   HELDOUT=1 scripts/ab.sh BASE         # also the held-out prompts (scripts/tools/heldout_prompts.jsonl)
#   ALONE= Q4_TYPES= F16_TYPES= scripts/ab.sh BASE   # only the two defaults and plain (a quick check)
#   VARIANTS="noline=REF nopace=REF" scripts/ab.sh BASE  # also each REF's default, over this checkout's
#
# For each regime (the Q4_K_M demo target: compute-bound on a CPU; its F16 requantization:
# memory-bound, as a GPU target is) it runs scripts/tools/compare_ngram.py with this checkout's
# default, each mode alone (--draft ngram and model; plain is --draft none), the base checkout's
# default (a git worktree of BASE), and llama.cpp's matching types (its n-gram types on the Q4
# pair, draft-simple at its defaults and n-max 4, 8 and 16 on F16), alternated, every specrun run
# from the same stored costs. It prints, per class, the ratios to plain, to the base and to the
# best mode alone, with the geometric mean over classes. Needs llama.cpp's tools
# (scripts/compare-llama-cpp.sh --build-only) and, for f16, scripts/fetch-demo-models.sh --f16.
# Run it on a quiet machine: nothing else may run meanwhile.
set -euo pipefail

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
esac
base_ref=$1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py="${PYTHON:-$repo/.venv/bin/python}"  # PYTHON: another venv's python (this checkout then goes first on PYTHONPATH)
[[ -x $py ]] || { echo "error: no python at $py; run scripts/install.sh first" >&2; exit 1; }
base_id=$(git -C "$repo" rev-parse --verify --quiet "$base_ref^{commit}") || {
  echo "error: '$base_ref' is not a commit here; give a commit id, a branch or e.g. main~1" >&2; exit 2; }
version=$("$py" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')
bin="${SPECRUN_CACHE:-$HOME/.cache/specrun}/llama.cpp-$version/build/bin"
[[ -x $bin/llama-speculative-simple ]] || {
  echo "error: llama.cpp's tools are not built in $bin; run scripts/compare-llama-cpp.sh --build-only" >&2; exit 1; }
models="${SPECRUN_MODELS_DIR:-$HOME/.cache/specrun/models}"
q4="$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
f16="${TARGET_F16_GGUF:-$models/qwen2.5-coder-1.5b-instruct-f16.gguf}"
draft="$models/qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf"
runs=${RUNS:-3}
limit=${LIMIT:-1}
threads=${THREADS:-$(getconf _NPROCESSORS_ONLN)}
classes=${CLASSES:-chat,code-gen,code-edit,translation,summarise,explain}
alone=${ALONE-ngram,model}
q4_types=${Q4_TYPES-ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache}
f16_types=${F16_TYPES-draft-simple,draft-simple@4,draft-simple@8,draft-simple@16}

work=$(mktemp -d)
cleanup() {
  for w in "$work"/base "$work"/v-*; do git -C "$repo" worktree remove --force "$w" >/dev/null 2>&1 || true; done
  rm -rf "$work"
}
trap cleanup EXIT
git -C "$repo" worktree add --detach --quiet "$work/base" "$base_id"
variant_args=()
for v in ${VARIANTS:-}; do  # NAME=REF: a worktree of REF, run as specrun@NAME
  name=${v%%=*} ref=${v#*=}
  id=$(git -C "$repo" rev-parse --verify --quiet "$ref^{commit}") || { echo "error: '$ref' (VARIANTS) is not a commit here" >&2; exit 2; }
  git -C "$repo" worktree add --detach --quiet "$work/v-$name" "$id"
  variant_args+=(--variant "$name=$work/v-$name")
done
echo "A/B: $(git -C "$repo" rev-parse --short HEAD) (this checkout$(git -C "$repo" diff --quiet || echo ', with uncommitted changes')) against base $(git -C "$repo" rev-parse --short "$base_id")"
echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, llama-cpp-python $version, $runs run(s), $limit prompt(s) a class, -t $threads"

one() {  # $1 = regime name, $2 = target, $3 = llama.cpp types; then extra arguments
  local name=$1 target=$2 types=$3
  shift 3
  [[ -f $target ]] || { echo "skipping $name: $target is missing (scripts/fetch-demo-models.sh${name:+ --$name})" >&2; return 0; }
  echo; echo "## $name: $(basename "$target") + $(basename "$draft")"
  "$py" "$repo/scripts/tools/compare_ngram.py" --bin "$bin" --target "$target" --draft "$draft" --classes "$classes" \
    --limit "$limit" --runs "$runs" -t "$threads" --types "$types" --specrun-modes "$alone" --base "$work/base" \
    --same-start "${variant_args[@]}" "$@"
}
for regime in ${REGIMES:-q4 f16}; do
  case $regime in
    q4) one q4 "$q4" "$q4_types" ;;
    f16) one f16 "$f16" "$f16_types" ;;
    *) echo "error: REGIMES takes q4 and f16, not '$regime'" >&2; exit 2 ;;
  esac
  if [[ -n ${HELDOUT:-} ]]; then
    case $regime in
      q4) one q4 "$q4" "$q4_types" --prompts "$repo/scripts/tools/heldout_prompts.jsonl" ;;
      f16) one f16 "$f16" "$f16_types" --prompts "$repo/scripts/tools/heldout_prompts.jsonl" ;;
    esac
  fi
done
