"""Where a draft token's time goes: inside the draft's llama_decode, and around it.

    python scripts/tools/draft_cost.py TARGET.gguf DRAFT.gguf [-n 96] [-t 2] [-k 8]

Runs `--draft model --fixed --draft-max K --draft-p-min 0` (every round drafts K tokens) on
one prompt and splits the draft time per drafted token into the draft's own llama_decode calls
and the rest (logits reads, the confidence's softmax, Python); beside it, one single-token
decode of the draft alone, measured past its cache, and the target's one-token step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.sampling import Sampler
from specrun.llama import LoadOptions, Model

PROMPT = (
    "<|im_start|>user\nWrite a Python function that checks whether a string is a palindrome, with a "
    "docstring and three doctests.<|im_end|>\n<|im_start|>assistant\n"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("draft", type=Path)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-k", type=int, default=8)
    args = ap.parse_args()
    opts = LoadOptions(n_ctx=2048, n_threads=args.threads)
    with Model(args.target, opts) as t, Model(args.draft, opts) as d:
        s = Settings("model", draft_max=args.k, p_min=0.0, fixed=True)
        e = Engine(t, d, s, Sampler(0.0), CostModel())
        toks = t.tokenize(PROMPT, add_special=False)
        e.prefill(toks)
        alone = e.sources["model"].measure_token_cost(toks[-1])
        t1 = e.calibrate().verify_cost(1)
        t.decode_s = d.decode_s = 0.0
        decodes = [0]
        real = d._decode

        def counted(tokens, logits):
            decodes[0] += 1
            return real(tokens, logits)

        d._decode = counted  # type: ignore[method-assign]
        stats = None
        t0 = time.perf_counter()
        for step in e.generate(toks, args.n):
            stats = step.stats
        wall = time.perf_counter() - t0
        assert stats is not None
        n = max(1, stats.n_drafted)
        print(f"{stats.n_generated} tokens in {wall:.2f} s, {stats.n_drafted} drafted, {stats.n_accepted} accepted")
        print(f"target one-token step           {1e3 * t1:8.2f} ms")
        print(f"draft decode alone (one token)  {1e3 * alone:8.2f} ms  ({alone / t1:.2f} of a target step)")
        print(f"draft time per drafted token    {1e3 * stats.draft_s / n:8.2f} ms  ({stats.draft_s / n / t1:.2f} of a target step)")
        print(
            f"  inside the draft's decodes     {1e3 * d.decode_s / n:8.2f} ms  ({decodes[0]} decodes, {1e3 * d.decode_s / max(1, decodes[0]):.2f} ms each)"
        )
        print(f"  around them                    {1e3 * (stats.draft_s - d.decode_s) / n:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
