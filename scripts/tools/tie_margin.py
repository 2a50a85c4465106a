"""How far a verify batch moves the target's logits from plain decoding's, and what that means
for the near-tie guard (``--tie-margin``).

    python scripts/tools/tie_margin.py [TARGET.gguf] [-t 2] [--outputs plain.json] [--per-class 2] [--tokens 96]

For a few of the bench's prompts per class (their plain greedy outputs, decoded once and kept
with ``--outputs`` as ``copy_replay.py`` does), every position is decoded twice:

- plainly, one token at a time, as ``--draft none`` does;
- as a row of a verify batch of 2, 4, 8 or 16 tokens (the sizes in turn) appended to a cache
  that plain decoding filled, as a round that drafts does.

It prints how far the batch moves the gap between plain decoding's top two tokens (by batch
size), and for each margin the share of batched rows the guard would defer (a near-tie) and
how many rows would still pick another token than plain decoding (the batched top token
differs, but its gap is at least the margin: the guard misses it). The margin is
right when the second count is zero at a deferred share the controller can live with.

Nothing is timed. A flip at a gap below the KV cache's own noise (a cache that verify
batches filled) is outside what this measures: see README "How exact is exact".
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from copy_replay import DEMO_TARGET, load_outputs

from specrun.backend import LoadOptions, Model

SIZES = (2, 4, 8, 16)
MARGINS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)


def top2(row: np.ndarray) -> tuple[int, int, float]:
    a, c = np.argpartition(row, -2)[-2:]
    a, c = (a, c) if row[a] >= row[c] else (c, a)
    return int(a), int(c), float(row[a] - row[c])


def measure(m: Model, prompt: list[int], output: list[int]) -> list[tuple[int, float, bool, float]]:
    """(batch size, how far the batch moved plain's top-two gap, whether its top token differs,
    the batched row's own top-two gap) for every batched row."""
    m.reset()
    m.eval(prompt[:-1], logits="none")
    seq = prompt + output
    plain = {}  # position -> plain decoding's (top, runner-up, gap) there
    for p in range(len(prompt), len(seq)):
        plain[p] = top2(m.eval([seq[p - 1]], logits="last")[0])
    rows = []
    # from the end backwards, so that every batch is appended to a cache that plain decoding filled
    for i, s in enumerate(range(len(seq) - 2, len(prompt) - 2, -1)):
        batch = seq[s : s + SIZES[i % len(SIZES)]]
        m.rollback(s)
        got = m.eval(batch, logits="all")
        assert got is not None
        for j, row in enumerate(got):
            p = s + j + 1
            if p in plain:
                a, c, gap = plain[p]
                b_top, _, b_gap = top2(row)
                rows.append((len(batch), float(row[a] - row[c]) - gap, b_top != a, b_gap))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", nargs="?", type=Path, default=DEMO_TARGET)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--outputs", type=Path, help="the plain outputs, cached in this JSON file (as copy_replay.py)")
    ap.add_argument("--per-class", type=int, default=2, help="prompts per class")
    ap.add_argument("--tokens", type=int, default=96, help="positions per prompt")
    args = ap.parse_args()
    outputs = load_outputs(args.outputs, args.target, args.threads, 128)
    by_class: dict[str, list[tuple[int, float, bool, float]]] = {}
    taken: dict[str, int] = {}
    with Model(args.target, LoadOptions(n_ctx=4096, n_threads=args.threads)) as m:
        for cls, prompt, output in outputs:
            if taken.get(cls, 0) < args.per_class:
                taken[cls] = taken.get(cls, 0) + 1
                by_class.setdefault(cls, []).extend(measure(m, list(prompt), list(output)[: args.tokens]))
    rows = [r for v in by_class.values() for r in v]
    print(f"{len(rows)} batched rows, {len(by_class)} classes")
    print("| batch | rows | plain's top-two gap moved by: median | p99 | p99.9 | max |")
    print("|---|---|---|---|---|---|")
    for b in SIZES:
        moved = np.abs([r[1] for r in rows if r[0] == b])
        if len(moved):
            q = np.percentile(moved, [50, 99, 99.9])
            print(f"| {b} | {len(moved)} | {q[0]:.3f} | {q[1]:.3f} | {q[2]:.3f} | {moved.max():.3f} |")
    print()
    print("| margin | " + " | ".join(f"{c}: deferred" for c in by_class) + " | other token than plain, not deferred |")
    print("|---" * (len(by_class) + 2) + "|")
    for margin in MARGINS:
        shares = [np.mean([r[3] < margin for r in v]) for v in by_class.values()]
        missed = sum(1 for r in rows if r[2] and r[3] >= margin)
        print(f"| {margin:.1f} | " + " | ".join(f"{s:.1%}" for s in shares) + f" | {missed} of {sum(r[2] for r in rows)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
