"""What the drafted rounds of a class cost: the bench's plain and default modes side by side in
one process, and every round that drafted, with what it cost in target steps.

    python scripts/tools/trace_rounds.py TARGET.gguf DRAFT.gguf --classes translation [--runs 2] [-t 2] [--modes plain,default,model]

As `specrun bench` runs them: the pair's stored verify curve, sources that start from nothing
and learn across the prompts, the prompts through the chat template, 128 tokens (a prompt's own
``n`` wins), greedy, the two modes alternated. Per prompt and run: both speeds and their ratio,
then each drafted round as (source, drafted, accepted, verify steps, draft steps) and the
target steps the drafted rounds lost against plain decoding of the tokens they wrote (their
verify and draft time, less one step per token). At the end, per mode, where its time went, by
the source of each round ("none" for plain rounds), in target steps. Nothing is stored.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from specrun.bench.runner import load_prompts
from specrun.decode.engine import Engine, Settings
from specrun.decode.sampling import Sampler
from specrun.gguf.facts import model_info
from specrun.llama import LoadOptions, Model
from specrun.run.config import PairConfig
from specrun.run.session import cost_key, cost_store

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
    ap.add_argument("--modes", default="plain,default", help="plain first; others from default (hybrid), model, ngram")
    ap.add_argument("--show", type=int, default=20, help="drafted rounds shown per reply")
    args = ap.parse_args()

    # what `specrun generate -m TARGET -d DRAFT -t N` learned and stored on this machine
    learned = cost_store().load(cost_key(model_info(args.target), model_info(args.draft), PairConfig(threads=args.threads)))
    if learned is None or not learned.cost.verify:
        sys.exit(f"no stored verify curve for this pair at {args.threads} threads: run `specrun generate` with it first")
    prompts = [p for p in load_prompts() if p.cls in args.classes.split(",")]
    opts = LoadOptions(n_ctx=4096, n_threads=args.threads)
    with Model(args.target, opts) as target, Model(args.draft, opts) as draft:
        cost = learned.cost
        kinds = {"plain": "none", "default": "hybrid", "model": "model", "ngram": "ngram"}
        names = args.modes.split(",")
        if names[0] != "plain" or any(n not in kinds for n in names):
            sys.exit(f"--modes: plain first, then any of {', '.join(list(kinds)[1:])}")
        modes = {n: Engine(target, None if n == "plain" else draft, Settings(kinds[n]), Sampler(0.0), cost=cost) for n in names}
        spent: dict[str, dict[str, list[float]]] = {n: {} for n in names}  # mode -> source -> totals
        walls: dict[str, float] = dict.fromkeys(names, 0.0)
        tokens = [target.tokenize(render(args.target, p.prompt), add_special=True, parse_special=True) for p in prompts]
        for e in modes.values():  # warm-up, as the bench
            e.reset()
            for _ in e.generate(tokens[0], 16):
                pass
        ratios: dict[str, list[float]] = {}
        for run in range(args.runs):
            for i, (p, toks) in enumerate(zip(prompts, tokens)):
                order = names if (run * len(prompts) + i) % 2 == 0 else names[::-1]
                tps, rounds, c1 = {}, {}, cost.verify_cost(1)
                for name in order:
                    e = modes[name]
                    e.reset()
                    stats = None
                    rounds[name] = []
                    for step in e.generate(toks, p.n_predict or args.n):
                        stats = step.stats
                        rounds[name].append(step.round)
                    assert stats is not None
                    tps[name] = stats.generation_tps
                    walls[name] += stats.wall_s
                    for r in rounds[name]:
                        t = spent[name].setdefault(r.source, [0.0] * 7)
                        for j, x in enumerate((1, r.drafted, r.accepted, r.emitted, r.verify_s, r.draft_s, r.sample_s + r.rollback_s)):
                            t[j] += x
                print(f"{p.cls} #{i} run {run + 1}: " + ", ".join(f"{n} {tps[n]:.2f} tok/s ({tps[n] / tps['plain']:.3f}x)" for n in names))
                for name in names[1:]:
                    ratios.setdefault((p.cls, name), []).append(tps[name] / tps["plain"])
                    drafted = [r for r in rounds[name] if r.drafted]
                    lost = sum(r.verify_s + r.draft_s - r.emitted * c1 for r in drafted) / c1
                    shown = [(r.source, r.drafted, r.accepted, round(r.verify_s / c1, 2), round(r.draft_s / c1, 2)) for r in drafted]
                    print(f"  {name}: {len(drafted)} drafted rounds, {lost:.1f} target steps lost: {shown[: args.show]}")
        for (cls, name), xs in ratios.items():
            print(f"{cls} {name}: geometric mean {statistics.geometric_mean(xs):.3f}x over {len(xs)} (prompt, run) pairs")
        c1 = cost.verify_cost(1)
        print("where the time went, in target steps (rounds, drafted, accepted, emitted: counts):")
        for name in names:
            accounted = 0.0
            for src, (n, d, a, em, v, dr, other) in sorted(spent[name].items()):
                accounted += v + dr + other
                print(
                    f"  {name:8} {src:6} rounds {n:5.0f} drafted {d:5.0f} accepted {a:5.0f} emitted {em:5.0f}  verify {v / c1:7.1f}  draft {dr / c1:6.1f}  sample+rollback {other / c1:5.1f}"
                )
            print(f"  {name:8} wall {walls[name] / c1:7.1f} steps, {(walls[name] - accounted) / c1:.1f} outside the rounds' timed parts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
