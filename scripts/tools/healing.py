"""A poisoned verify curve, before and after it heals: tok/s on a code-edit prompt.

    python scripts/tools/healing.py [-t 2] [--reps 2] [--lock /tmp/specrun-cpu.lock]

With the demo pair and a private cost store: calibrate a fresh curve; then, alternated, plain
decoding, the default mode on the fresh curve, the default mode on a stored curve with every
size >= 6 at 8x its value (as a calibration taken on a busy machine would store it; the run
heals it), and the default mode in a new engine on what that run stored. Prints tok/s and the
longest draft of each, and c(16)/c(1) as stored before and after.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import statistics
import tempfile
from pathlib import Path

from specrun.bench.runner import load_prompts
from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.learned import CostStore, Learned
from specrun.decode.sampling import Sampler
from specrun.run.config import PairConfig
from specrun.run.prompt import chat_prompt
from specrun.run.session import open_engine, open_pair
from specrun.run.stream import stream_generate

MODELS = Path(os.environ.get("SPECRUN_MODELS_DIR") or Path.home() / ".cache/specrun/models")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=0, help="which code-edit prompt of the bench")
    ap.add_argument("--lock", type=Path)
    args = ap.parse_args()
    lock = open(args.lock, "a") if args.lock else None  # noqa: SIM115
    if lock is not None:
        fcntl.flock(lock, fcntl.LOCK_EX)
    pair = open_pair(
        MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        MODELS / "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        PairConfig(threads=args.threads),
    )
    p = [q for q in load_prompts() if q.cls == "code-edit"][args.prompt]
    prompt = chat_prompt(pair, [{"role": "user", "content": p.prompt}])
    with tempfile.TemporaryDirectory() as tmp:
        store = CostStore(Path(tmp) / "costs.json")
        fresh = open_engine(pair, Settings(), Sampler(0.0), store)  # calibrates
        truth = fresh.cost.curve()
        store.save(pair.cost_key, Learned(CostModel(dict(truth)), fresh.learned().sources))

        def run(engine: Engine) -> tuple[float, int]:
            engine.reset()
            s = list(stream_generate(engine, prompt, p.n_predict or 512))[-1].stats
            return s.generation_tps, max(s.draft_lengths)

        rows: dict[str, list[tuple[float, int]]] = {}
        stored_after = None
        for _ in range(args.reps):
            poisoned = {b: v * 8 if b >= 6 else v for b, v in truth.items()}
            rows.setdefault("plain", []).append(run(Engine(pair.target, None, Settings("none"), Sampler(0.0))))
            rows.setdefault("default, fresh curve", []).append(
                run(Engine(pair.target, pair.draft, Settings(), Sampler(0.0), CostModel(dict(truth)), fresh.learned()))
            )
            store.save(pair.cost_key, Learned(CostModel(poisoned), fresh.learned().sources))
            sick = open_engine(pair, Settings(), Sampler(0.0), store)
            rows.setdefault("default, poisoned curve (heals in the run)", []).append(run(sick))
            store.save(pair.cost_key, sick.learned())
            stored_after = store.load(pair.cost_key)
            healed = open_engine(pair, Settings(), Sampler(0.0), store)
            rows.setdefault("default, next run on what it stored", []).append(run(healed))
    pair.close()
    plain = statistics.median(t for t, _ in rows["plain"])
    print("| run | tok/s (median) | vs plain | longest draft |")
    print("|---|---|---|---|")
    for name, vals in rows.items():
        tps = statistics.median(t for t, _ in vals)
        print(f"| {name} | {tps:.1f} | {tps / plain:.2f}x | {max(k for _, k in vals)} |")
    c1 = truth[1]
    after = stored_after.cost.verify if stored_after else {}
    print(
        f"\nc(16)/c(1): fresh {truth[16] / c1:.2f}, poisoned {8 * truth[16] / c1:.2f}, stored after the poisoned run {after.get(16, float('nan')) / after.get(1, c1):.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
