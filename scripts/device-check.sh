#!/usr/bin/env bash
# One-call GPU check for a lent NVIDIA machine (prepared; see BENCHMARKS.md, "GPU").
#
# The device machine has no network and a call carries at most 64 MiB, so the demo models
# cannot travel. Run from the repository root ON the device, with these carried paths:
#   .gpu/llama_cpp-0.3.36-cuda-sm90.tar.xz   (copy of shared/gpu's archive)
#   .whl/*.whl                              (Python 3.12 wheels the device image lacks: gguf, and
#                                            diskcache, which llama_cpp imports; see the device
#                                            README for `pip download` flags)
# Every step runs even when one before it failed; each writes its own file under $OUT, so a run
# cut off at its limit still brings back what it finished. In order of what only a GPU can tell:
# 1. The CUDA build loads and offloads (specrun doctor, the offload report).
# 2. Costs at real sizes (scripts/tools/sized_models.py: random F16 weights of Qwen2.5-1.5B's
#    shapes and a 2-block draft cut from it, with a 151,936-token output layer): where a draft
#    token's time goes, inside its llama_decode and around it (scripts/tools/draft_cost.py), and
#    `specrun bench` there: the verify-cost curve, which on a GPU should be nearly flat, the
#    chooser's draft lengths, and each mode against plain decoding and a fixed 8-token draft
#    (llama.cpp's draft-simple at n-max 8 drafts that way).
# 3. The engine's exactness and rollback tests with every layer on the GPU, on the tiny models,
#    and `specrun bench` on them.
# 4. MTP heads (a generated tiny qwen35 with one head): tests/test_mtp.py, one `generate --draft
#    mtp`, and scripts/tools/mtp_profile.py. EAGLE-3 and Gemma 4's assistant file: their tests
#    and one generate each on generated tiny heads.
# 5. Hybrid and recurrent models (generated qwen35/lfm2/granitehybrid): every rollback method's
#    exactness with CUDA's delta-net, short-conv and Mamba-2 kernels (tests/test_hybrid.py) and
#    the rollback cost by tokens undone (scripts/tools/rollback_cost.py).
#
# From the session:  run(command="bash scripts/device-check.sh", carry=[".gpu", ".whl"])
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
out="${OUT:-/tmp/specrun-device}"  # comes back: log.txt (everything printed) and files.tgz
mkdir -p "$out" /tmp/site /tmp/models
exec > >(tee "$out/log.txt") 2>&1
res=/tmp/device-results && mkdir -p "$res"  # each step's files, packed into $out after every step
tar -xJf .gpu/llama_cpp-0.3.36-cuda-sm90.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
libdir=$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))')
export PYTHONPATH="/tmp/site:$PWD" LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}" PYTHONUNBUFFERED=1 SPECRUN_SKIP_DEMO=1
export SPECRUN_CACHE_DIR=/tmp/specrun-cache XDG_CONFIG_HOME=/tmp/specrun-config
specrun() { python3 -c 'from specrun.cli.main import run; run()' "$@"; }
step() { tar -czf "$out/files.tgz" -C "$res" . 2>/dev/null; echo "== $1 ($(date +%T))"; }
pytest_q() { python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -4; }

step "1. build and offload"
python3 -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__, "offload:", llama_cpp.llama_supports_gpu_offload())'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
specrun doctor >"$res/doctor.txt" 2>&1; tail -25 "$res/doctor.txt"

step "2. costs at real sizes"
python3 scripts/tools/sized_models.py /tmp/sized 2>&1 | tee "$res/sized.txt"
st=/tmp/sized/target.gguf sd=/tmp/sized/draft.gguf
for k in 4 8 16; do
  echo "-- draft_cost.py -k $k"
  python3 scripts/tools/draft_cost.py "$st" "$sd" -t 8 -k "$k" -n 128 2>>"$res/sized.err"
done 2>&1 | tee -a "$res/sized.txt"
printf '%s\n' \
  '{"class":"code-gen","prompt":"Write a Python function that checks whether a string is a palindrome, with a docstring and three doctests.","chat":true}' \
  '{"class":"chat","prompt":"Explain in a few paragraphs why the sky is blue.","chat":true}' \
  '{"class":"code-edit","prompt":"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\nRepeat the code above, with type hints.","chat":true}' \
  >/tmp/sized-prompts.jsonl
specrun bench -m "$st" -d "$sd" --prompts /tmp/sized-prompts.jsonl --runs 3 -n 192 -t 8 --draft model,hybrid,model:8 --markdown \
  >"$res/sized-bench.md" 2>"$res/sized-bench.err"
cat "$res/sized-bench.md"; tail -5 "$res/sized-bench.err"

step "3. exactness on the GPU, tiny models"
python3 tests/tiny_models.py /tmp/models >/dev/null
t=/tmp/models/target.gguf d=/tmp/models/draft-perturbed.gguf
specrun generate -m "$t" -d "$d" -p "def fib(n):" -n 32 -t 8 --json >"$res/generate.json" 2>"$res/generate.err"
grep -h "offloaded" "$res/generate.err" || echo "no offload report"
pytest_q tests/test_engine.py tests/test_pair.py | tee "$res/pytest.txt"
printf '{"class":"chat","prompt":"Hello there, how are you today?","chat":true}\n{"class":"code-edit","prompt":"def fibonacci(n):\\n    if n < 2:\\n        return n\\n    return fibonacci(n - 1) + fibonacci(n - 2)\\n\\nRepeat the code above.","chat":true}\n' >/tmp/prompts.jsonl
specrun bench -m "$t" -d "$d" --prompts /tmp/prompts.jsonl --runs 2 -n 64 -t 8 --markdown >"$res/bench.md" 2>&1; tail -30 "$res/bench.md"

step "4. MTP, EAGLE-3, the assistant file"
pytest_q tests/test_mtp.py tests/test_eagle3.py tests/test_assistant.py | tee -a "$res/pytest.txt"
python3 tests/tiny_mtp.py /tmp/models >/dev/null
specrun generate -m /tmp/models/mtp.gguf --draft mtp -p "The quick brown fox" -n 64 -t 8 --json >"$res/mtp.json" 2>>"$res/generate.err"
python3 scripts/tools/mtp_profile.py --threads 8 --gpu-layers -1 -k 4 2>>"$res/generate.err" | tee "$res/mtp-profile.json"
python3 tests/tiny_eagle3.py /tmp/models >/dev/null
specrun generate -m "$t" -d /tmp/models/eagle3.gguf --draft eagle3 -p "def fib(n):" -n 64 -t 8 --json >"$res/eagle3.json" 2>>"$res/generate.err"
python3 tests/tiny_gemma4.py /tmp/models >/dev/null
specrun generate -m /tmp/models/gemma4.gguf -d /tmp/models/mtp-gemma4.gguf --draft mtp -p "The quick brown fox" -n 64 -t 8 --json >"$res/assistant.json" 2>>"$res/generate.err"

step "5. hybrid and recurrent targets"
pytest_q tests/test_hybrid.py | tee "$res/pytest-hybrid.txt"
python3 scripts/tools/rollback_cost.py --repeats 20 -t 8 --dir /tmp/models/hybrid | tee "$res/rollback-cost.txt"
step "done"
