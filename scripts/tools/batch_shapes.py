"""What a target decode costs by batch size, and what a change of batch size between decodes costs.

    python scripts/tools/batch_shapes.py TARGET.gguf [-t 8] [--gpu-layers -1] [--passes 2]

First the curve: each size decoded 5 times in a row at the prompt's end (then undone), so the
first of the five follows a decode of another size and the last settle. Then patterns of sizes
a run produces (a constant draft length, alternating lengths, a verify then a plain step, random
lengths, a draft model's round of one catch-up then single tokens), the mean per decode after the
first four, and the median per size where a pattern has few. On a CPU the order hardly matters;
on an H200 a decode whose batch shape differs from the one before cost a third of a step more
(BENCHMARKS.md, the eighteenth session). Set GGML_CUDA_DISABLE_GRAPHS=1 to see CUDA graphs' part.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from specrun.llama import LoadOptions, Model

SIZES = (1, 2, 3, 4, 6, 8, 9, 12, 16, 24, 32, 33, 48, 64)
PROMPT = "<|im_start|>user\nWrite a Python function that checks whether a string is a palindrome.<|im_end|>\n<|im_start|>assistant\n"


def patterns() -> dict[str, list[int]]:
    r = random.Random(1)
    return {
        "b=1 constant (plain decoding)": [1] * 24,
        "b=9 constant": [9] * 24,
        "b=17 constant": [17] * 24,
        "b=9,8 alternating": [9, 8] * 12,
        "b=9,1 alternating": [9, 1] * 12,
        "b random in 2..16": [r.randint(2, 16) for _ in range(24)],
        "2 then seven 1s (a draft round)": ([2] + [1] * 7) * 3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("-t", "--threads", type=int, default=8)
    ap.add_argument("--gpu-layers", type=int, default=-1)
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    with Model(args.target, LoadOptions(n_ctx=2048, n_threads=args.threads, n_gpu_layers=args.gpu_layers)) as t:
        toks = t.tokenize(PROMPT, add_special=False)
        t.eval(toks[:-1], logits="none")
        base, pad = t.n_past, toks[-1]

        def decode(b: int) -> float:
            s = time.perf_counter()
            t.eval([pad] * b, logits="all")
            dt = 1e3 * (time.perf_counter() - s)
            t.rollback(base)
            return dt

        for p in range(args.passes):
            print(f"== pass {p + 1}: each size 5 times in a row (ms)")
            one = None
            for b in SIZES:
                xs = [decode(b) for _ in range(5)]
                settled = statistics.median(xs[2:])
                one = one or settled
                print(f"b={b:3d}  " + " ".join(f"{x:6.2f}" for x in xs) + f"   settled {settled:6.2f} ({settled / one:.2f}x c(1))")
            print(f"== pass {p + 1}: patterns (ms per decode)")
            for name, seq in patterns().items():
                xs = [decode(b) for b in seq]
                by: dict[int, list[float]] = {}
                for b, x in list(zip(seq, xs))[4:]:
                    by.setdefault(b, []).append(x)
                per = "  ".join(f"b={b}: {statistics.median(v):.2f}" for b, v in sorted(by.items())) if len(by) <= 3 else ""
                print(f"{name:34} mean {statistics.mean(xs[4:]):6.2f}  {per}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
