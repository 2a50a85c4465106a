#!/usr/bin/env bash
# One-call GPU check for a lent NVIDIA machine (prepared; see BENCHMARKS.md, "GPU").
#
# The device machine has no network and a call carries at most 64 MiB, so the demo models
# cannot travel. Run from the repository root ON the device, with these carried paths:
#   .gpu/llama_cpp-0.3.36-cuda-sm90.tar.xz   (copy of shared/gpu's archive)
#   .whl/*.whl                              (Python 3.12 wheels of gguf, typer, rich, psutil,
#                                            nvidia-ml-py, jinja2, pytest, hypothesis; see the
#                                            device README for `pip download` flags)
# It checks, in one run: the CUDA build loads and offloads (specrun doctor, the offload
# report), the engine's exactness and rollback tests pass with every layer on the GPU, and
# `specrun bench` on generated models prints the GPU's verify-cost curve and draft cost,
# where c(b) should be nearly flat, so the controller should choose long drafts.
# MTP steps (the target's own heads, on a generated tiny qwen35 with one head: nothing to
# download): tests/test_mtp.py with every layer and the MTP context on the GPU, one
# `generate --draft mtp` (its by_source counts `mtp`), and scripts/tools/mtp_profile.py, where
# a round's time goes (verify, the heads' catch-up, draft steps) against plain decoding. The
# published figures to beat are for real models (Qwen3.6-27B: 31 -> 41-53 tok/s on an RTX 3090);
# on a 64-wide model the fixed cost per decode dominates, so read these as a working check.
# EAGLE-3 and Gemma 4's assistant file (issue 24): their tests and one generate each, on generated
# tiny heads (tests/tiny_eagle3.py, tests/tiny_gemma4.py), nothing to download.
# Hybrid and recurrent models (issue 23): real ones (Qwen3.6, LFM2, Granite-4.0-H) are far over
# the 64 MiB a call carries, so the generated qwen35/lfm2/granitehybrid run on the GPU instead:
# the exactness of every rollback method with CUDA's delta-net, short-conv and Mamba-2 kernels
# (tests/test_hybrid.py) and the rollback cost by tokens undone (scripts/tools/rollback_cost.py).
#
# From the session:  run(command="bash scripts/device-check.sh", carry=[".gpu", ".whl"])
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/specrun-device}"
mkdir -p "$out" /tmp/site /tmp/models
tar -xJf .gpu/llama_cpp-0.3.36-cuda-sm90.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
libdir=$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))')
export PYTHONPATH="/tmp/site:$PWD" LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}" PYTHONUNBUFFERED=1
specrun() { python3 -c 'from specrun.cli.main import run; run()' "$@"; }
python3 -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__, "offload:", llama_cpp.llama_supports_gpu_offload())'
specrun doctor | tee "$out/doctor.txt" || true
python3 tests/tiny_models.py /tmp/models >/dev/null
t=/tmp/models/target.gguf d=/tmp/models/draft-perturbed.gguf
specrun generate -m "$t" -d "$d" -p "def fib(n):" -n 32 -t 8 --json >"$out/generate.json" 2>"$out/generate.err" || true
grep -h "offloaded" "$out/generate.err" || echo "no offload report"
python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_pair.py 2>&1 | tail -3 | tee "$out/pytest.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_hybrid.py 2>&1 | tail -3 | tee "$out/pytest-hybrid.txt"
python3 scripts/tools/rollback_cost.py --repeats 20 -t 8 --dir /tmp/models/hybrid | tee "$out/rollback-cost.txt"
printf '{"class":"chat","prompt":"Hello there, how are you today?","chat":true}\n{"class":"code-edit","prompt":"def fibonacci(n):\\n    if n < 2:\\n        return n\\n    return fibonacci(n - 1) + fibonacci(n - 2)\\n\\nRepeat the code above.","chat":true}\n' >/tmp/prompts.jsonl
specrun bench -m "$t" -d "$d" --prompts /tmp/prompts.jsonl --runs 2 -n 64 -t 8 --markdown | tee "$out/bench.md"
# MTP heads on the GPU
python3 -m pytest -q -p no:cacheprovider tests/test_mtp.py 2>&1 | tail -3 | tee -a "$out/pytest.txt"
python3 tests/tiny_mtp.py /tmp/models >/dev/null
specrun generate -m /tmp/models/mtp.gguf --draft mtp -p "The quick brown fox" -n 64 -t 8 --json >"$out/mtp.json" 2>>"$out/generate.err" || true
python3 scripts/tools/mtp_profile.py --threads 8 --gpu-layers -1 -k 4 2>>"$out/generate.err" | tee "$out/mtp-profile.json" || true
# EAGLE-3 heads and Gemma 4's assistant file on the GPU (both generated, tiny): exactness and
# state in step (tests/test_eagle3.py, tests/test_assistant.py), and one generate with each
python3 -m pytest -q -p no:cacheprovider tests/test_eagle3.py tests/test_assistant.py 2>&1 | tail -3 | tee -a "$out/pytest.txt"
python3 tests/tiny_eagle3.py /tmp/models >/dev/null
specrun generate -m "$t" -d /tmp/models/eagle3.gguf --draft eagle3 -p "def fib(n):" -n 64 -t 8 --json >"$out/eagle3.json" 2>>"$out/generate.err" || true
python3 tests/tiny_gemma4.py /tmp/models >/dev/null
specrun generate -m /tmp/models/gemma4.gguf -d /tmp/models/mtp-gemma4.gguf --draft mtp -p "The quick brown fox" -n 64 -t 8 --json >"$out/assistant.json" 2>>"$out/generate.err" || true
