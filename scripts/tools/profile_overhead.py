"""Python time per generated token outside llama_decode and NumPy.

    python scripts/tools/profile_overhead.py [TARGET.gguf DRAFT.gguf] [-n 128] [-t 2]

For `--draft model --fixed --draft-max 4` and `--draft hybrid` (greedy): run once plainly
and time everything outside llama_decode (the backend times each llama_decode call); run
again under cProfile to measure the NumPy share (argmax, softmax for p-min). specrun's
own Python per token = (wall - llama_decode) / tokens - NumPy per token. Without arguments
the demo pair is used.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.sampling import Sampler
from specrun.llama import LoadOptions, Model
from specrun.run.stream import stream_generate

PROMPT = (
    "<|im_start|>user\nWrite a Python function that merges two sorted lists into one sorted list, "
    "with a docstring.<|im_end|>\n<|im_start|>assistant\n"
)


def run(t: Model, d: Model, settings: Settings, n: int, profile: bool):
    cost = CostModel({1: 0.03, 2: 0.04, 4: 0.05, 8: 0.08, 16: 0.1, 32: 0.2})
    e = Engine(t, d, settings, Sampler(0.0), cost)
    toks = t.tokenize(PROMPT, add_special=False)
    e.prefill(toks)
    t.decode_s = d.decode_s = 0.0
    prof = cProfile.Profile() if profile else None
    got = 0
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for event in stream_generate(e, toks, n):
        got += len(event.tokens)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    numpy_s = 0.0
    if prof:
        for (file, _, name), (_cc, _nc, tt, _ct, _c) in pstats.Stats(prof).stats.items():
            if (
                "numpy" in file
                or "numpy" in name
                or name in ("<method 'argmax' of 'numpy.ndarray' objects>", "<method 'max' of 'numpy.ndarray' objects>")
            ):
                numpy_s += tt
    return got, wall, t.decode_s + d.decode_s, numpy_s


def main() -> int:
    models = Path(os.environ.get("SPECRUN_MODELS_DIR") or Path.home() / ".cache/specrun/models")
    ap = argparse.ArgumentParser()
    ap.add_argument("target", nargs="?", default=str(models / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("draft", nargs="?", default=str(models / "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf"))
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    a = ap.parse_args()
    t = Model(a.target, LoadOptions(n_ctx=2048, n_threads=a.t))
    d = Model(a.draft, LoadOptions(n_ctx=2048, n_threads=a.t, n_outputs_max=1))
    for label, s in (("model --fixed K=4", Settings("model", draft_max=4, fixed=True)), ("hybrid (adaptive)", Settings("hybrid"))):
        n, wall, dec, _ = run(t, d, s, a.n, profile=False)
        n2, _, _, numpy_s = run(t, d, s, a.n, profile=True)
        outside = (wall - dec) / n
        numpy_per = numpy_s / n2
        print(
            f"{label}: {n} tokens in {wall:.2f} s, llama_decode {dec:.2f} s; per token outside llama_decode "
            f"{1000 * outside:.3f} ms, of which NumPy {1000 * numpy_per:.3f} ms; specrun Python {1000 * (outside - numpy_per):.3f} ms/token"
        )
    t.close()
    d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
