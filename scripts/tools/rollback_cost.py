"""How a rejected draft's rollback costs grow with the number of tokens undone, per method.

    python scripts/tools/rollback_cost.py [--repeats 30] [-t 2] [--dir DIR]

On the tiny generated models (tests/tiny_models.py, tests/tiny_hybrid.py), after a 40-token
prompt and a 17-token verify (the pending token plus 16 drafts), it times ``Model.rollback``
undoing 1, 2, 4, 8 or 16 tokens, the median of ``--repeats``, for:

- the attention cache of the tiny llama (trim);
- qwen35 and lfm2 with state snapshots;
- qwen35 with no snapshots asked for (``rollback_depth=0``) and granitehybrid, which has none:
  a checkpoint restored, then the tokens kept replayed (one decode, no logits).

It prints each method's milliseconds and their ratio to undoing one token. A restore replays the
tokens kept, so its cost follows the 17 - n tokens kept, not the n undone. The checkpoint's own copy,
taken before each verify, is timed apart (it is paid on every round, rejected or not). These
are 64-wide models on the CPU: the ratios, not the times, say something about real models.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tiny_hybrid import build_hybrid  # noqa: E402
from tiny_models import build_all  # noqa: E402

from specrun.llama import LoadOptions, Model  # noqa: E402

UNDO = (1, 2, 4, 8, 16)
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def measure(m: Model, repeats: int) -> tuple[dict[int, float], float]:
    """Median seconds of a rollback of each size, and of the checkpoint before a verify."""
    prompt = m.tokenize(PROMPT)[:40]
    m.reset()
    m.eval(prompt[:-1], logits="none")
    base = m.n_past
    verify = list(range(100, 117))  # a pending token and 16 drafts
    times: dict[int, list[float]] = {r: [] for r in UNDO}
    ck: list[float] = []
    for _ in range(repeats):
        for r in UNDO:
            m.rollback(base)
            m.eval([prompt[-1]], logits="none")  # a position never saved yet: the copy is really made
            t = time.perf_counter()
            m.checkpoint()
            ck.append(time.perf_counter() - t)
            m.eval(verify, logits="all")
            t = time.perf_counter()
            m.rollback(m.n_past - r)
            times[r].append(time.perf_counter() - t)
    m.rollback(base)
    return {r: statistics.median(v) for r, v in times.items()}, statistics.median(ck)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the tiny models (a temporary folder by default)")
    a = ap.parse_args()
    where = a.dir or Path(tempfile.mkdtemp(prefix="specrun-rollback-"))
    paths = build_hybrid(where) | {"llama": build_all(where)["target"]}
    cases = [("llama", 32), ("qwen35", 32), ("lfm2", 32), ("qwen35", 0), ("granitehybrid", 32)]  # (model, snapshots asked)
    print(f"{'model and method':26} {'copy (ms)':>9}  " + "  ".join(f"undo {r:>2} (ms, x1)" for r in UNDO))
    for name, depth in cases:
        with Model(paths[name], LoadOptions(n_ctx=512, n_threads=a.threads, rollback_depth=depth)) as m:
            med, ck = measure(m, a.repeats)
            cells = "  ".join(f"{1000 * med[r]:7.3f} {med[r] / med[1]:5.1f}x" for r in UNDO)
            print(f"{name + ' ' + m.rollback_method:26} {1000 * ck:9.3f}  {cells}")


if __name__ == "__main__":
    main()
