"""Where a round's time goes when the target's own MTP heads draft: the target's verify decode,
queueing each target batch for the heads (``MtpHeads.process``: a decode of its own only when a
batch fills), and the draft steps (the first also feeds what was queued).

Runs greedy generation with the heads alone (a fixed draft length) on the tiny qwen35 with one
MTP head (tests/tiny_mtp.py), once per prompt, and plain decoding beside it; prints one JSON
object. A one-off measurement, not a benchmark: on a shared CPU the figures move between runs.

    python scripts/tools/mtp_profile.py [--threads 1] [--gpu-layers 0] [-k 3] [-n 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tiny_mtp import build_mtp  # noqa: E402

from specrun.decode.costs import CostModel  # noqa: E402
from specrun.decode.engine import Engine, Settings  # noqa: E402
from specrun.decode.sampling import Sampler  # noqa: E402
from specrun.llama import LoadOptions, Model, MtpHeads  # noqa: E402

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The",
    "def fibonacci(n: int) -> int:\n    if n < 2:",
    "今日はとても良い天気です。私は",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gpu-layers", type=int, default=0)
    ap.add_argument("-k", type=int, default=3, help="draft length (the target keeps k + 1 snapshots)")
    ap.add_argument("-n", type=int, default=64)
    a = ap.parse_args()
    path = build_mtp(Path(tempfile.mkdtemp()))["mtp"]
    opts = LoadOptions(n_ctx=1024, n_threads=a.threads, n_batch=64, n_gpu_layers=a.gpu_layers, load_mtp=True, rollback_depth=a.k + 1)
    out: dict = {"threads": a.threads, "gpu_layers": a.gpu_layers, "k": a.k, "tokens_per_prompt": a.n}
    for mode in ("none", "mtp"):  # plain decoding without the heads loaded, then the heads drafting
        target = Model(path, dataclasses.replace(opts, load_mtp=mode == "mtp"))
        heads = MtpHeads(target) if mode == "mtp" else None
        tot = {
            "rounds": 0,
            "tokens": 0,
            "drafted": 0,
            "accepted": 0,
            "mtp_decodes": 0,
            "wall_s": 0.0,
            "verify_s": 0.0,
            "catch_up_s": 0.0,
            "draft_s": 0.0,
        }
        for p in PROMPTS:
            target.reset()
            s = Settings(mode, draft_max=a.k, p_min=0.0, fixed=True, tie_margin=0.0)
            e = Engine(target, None, s, Sampler(0.0), CostModel(), heads=heads)
            prompt = target.tokenize(p)
            e.prefill(prompt)  # not part of the rounds' time
            d0 = target.decode_s
            c0, s0, n0 = (heads.process_s, heads.draft_s, heads.decodes) if heads else (0.0, 0.0, 0)
            t0 = time.perf_counter()
            stats = None
            for step in e.generate(prompt, a.n):
                stats = step.stats
            tot["wall_s"] += time.perf_counter() - t0
            assert stats is not None
            tot["rounds"] += stats.n_rounds
            tot["tokens"] += stats.n_generated
            tot["drafted"] += stats.n_drafted
            tot["accepted"] += stats.n_accepted
            tot["verify_s"] += target.decode_s - d0
            if heads is not None:
                tot["catch_up_s"] += heads.process_s - c0
                tot["draft_s"] += heads.draft_s - s0
                tot["mtp_decodes"] += heads.decodes - n0
        r = tot["rounds"]
        out[mode] = {
            **{k: v for k, v in tot.items() if not k.endswith("_s")},
            "ms_per_round": {k[:-2]: round(1e3 * v / r, 3) for k, v in tot.items() if k.endswith("_s")},
            "ms_per_token": round(1e3 * tot["wall_s"] / tot["tokens"], 3),
        }
        target.close()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
