"""What the drafted rounds of a class cost: the bench's plain and default modes side by side in
one process, and every round that drafted, with what it cost in target steps.

    python scripts/tools/trace_rounds.py TARGET.gguf DRAFT.gguf --classes translation [--runs 2] [-t 2]

As `specrun bench` runs them: the pair's stored verify curve, sources that start from nothing
and learn across the prompts, the prompts through the chat template, 128 tokens (a prompt's own
``n`` wins), greedy, the two modes alternated. Per prompt and run: both speeds and their ratio,
then each drafted round as (source, drafted, accepted, verify steps, draft steps) and the
target steps the drafted rounds lost against plain decoding of the tokens they wrote (their
verify and draft time, less one step per token). Nothing is stored.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from specrun.backend import LoadOptions, Model
from specrun.bench import load_prompts
from specrun.config import PairConfig
from specrun.engine import Engine, Settings
from specrun.modelinfo import model_info
from specrun.sampling import Sampler
from specrun.session import cost_key, cost_store

sys.path.insert(0, str(Path(__file__).parent))
from compare_ngram import render  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--classes", default="translation")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()

    # what `specrun generate -m TARGET -d DRAFT -t N` learned and stored on this machine
    learned = cost_store().load(cost_key(model_info(args.target), model_info(args.draft), PairConfig(threads=args.threads)))
    if learned is None or not learned.cost.verify:
        sys.exit(f"no stored verify curve for this pair at {args.threads} threads: run `specrun generate` with it first")
    prompts = [p for p in load_prompts() if p.cls in args.classes.split(",")]
    opts = LoadOptions(n_ctx=4096, n_threads=args.threads)
    with Model(args.target, opts) as target, Model(args.draft, opts) as draft:
        cost = learned.cost
        modes = {
            "plain": Engine(target, None, Settings("none"), Sampler(0.0), cost=cost),
            "default": Engine(target, draft, Settings("hybrid"), Sampler(0.0), cost=cost),
        }
        tokens = [target.tokenize(render(args.target, p.prompt), add_special=True, parse_special=True) for p in prompts]
        for e in modes.values():  # warm-up, as the bench
            e.reset()
            for _ in e.generate(tokens[0], 16):
                pass
        ratios: dict[str, list[float]] = {}
        for run in range(args.runs):
            for i, (p, toks) in enumerate(zip(prompts, tokens)):
                order = list(modes) if (run * len(prompts) + i) % 2 == 0 else list(modes)[::-1]
                tps, rounds, c1 = {}, [], cost.verify_cost(1)
                for name in order:
                    e = modes[name]
                    e.reset()
                    stats = None
                    for step in e.generate(toks, p.n_predict or args.n):
                        stats = step.stats
                        if name == "default" and step.round.drafted:
                            rounds.append(step.round)
                    assert stats is not None
                    tps[name] = stats.generation_tps
                ratio = tps["default"] / tps["plain"]
                ratios.setdefault(p.cls, []).append(ratio)
                lost = sum(r.verify_s + r.draft_s - r.emitted * c1 for r in rounds) / c1
                print(f"{p.cls} #{i} run {run + 1}: plain {tps['plain']:.2f} tok/s, default {tps['default']:.2f} ({ratio:.3f}x)")
                shown = [(r.source, r.drafted, r.accepted, round(r.verify_s / c1, 2), round(r.draft_s / c1, 2)) for r in rounds]
                print(f"  {len(rounds)} drafted rounds, {lost:.1f} target steps lost: {shown[:20]}")
        for cls, xs in ratios.items():
            print(f"{cls}: geometric mean {statistics.geometric_mean(xs):.3f}x over {len(xs)} (prompt, run) pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
