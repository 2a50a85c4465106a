"""The most any choice of draft lengths could gain with this draft on this prompt: an oracle that
knows which drafts the target will accept.

    python scripts/tools/oracle.py TARGET.gguf DRAFT.gguf [--class translation] [--index 0] [-n 128] [-t 2]

Greedy. The target's reply is decoded once; the draft, fed that reply, predicts each next token,
so from position i it agrees with the target for A(i) tokens in a row. A round there may draft
any m <= A(i) tokens, all accepted, and brings m + 1 tokens for c(m + 1) + D(m). The oracle picks
the rounds that finish the reply soonest (a shortest path over positions): it never drafts a
token the target rejects, never pays a catch-up, and knows the reply's length. No policy with
this draft does better, so a speed target above the oracle's is out of reach on that prompt.

Beside it: every fixed draft length K without an early stop (llama.cpp's n-max K at p-min 0),
on the same agreement. Costs are the pair's stored ones (`specrun costs`): the verify curve
c(b) and the draft's first and later token times.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from specrun.bench.runner import load_prompts
from specrun.decode.costs import CostModel
from specrun.gguf.facts import model_info
from specrun.llama import LoadOptions, Model
from specrun.run.config import PairConfig
from specrun.run.session import cost_key, cost_store

sys.path.insert(0, str(Path(__file__).parent))
from compare_ngram import render  # noqa: E402


def greedy_reply(target: Model, prompt: list[int], n: int) -> list[int]:
    """The target's greedy reply to ``prompt``, up to n tokens (or its end of turn)."""
    reply: list[int] = []
    logits = target.eval_last(prompt)
    while len(reply) < n:
        x = int(np.argmax(logits))
        reply.append(x)
        if target.is_eog(x):
            break
        logits = target.eval_last([x])
    return reply


def fed_reply(draft: Model, prompt: list[int], reply: list[int], n_vocab: int) -> Iterator[tuple[np.ndarray, list[int]]]:
    """The draft fed ``prompt`` and then ``reply`` itself, 64 tokens a decode: each decode's rows of
    logits (over the target's ``n_vocab``) and the reply tokens they guess, in order."""
    draft.eval(prompt[:-1], logits="none")
    feed = [prompt[-1], *reply[:-1]]  # the draft's guess for reply[j] comes after feed[j]
    for start in range(0, len(feed), 64):
        rows = draft.eval(feed[start : start + 64], logits="all")
        assert rows is not None
        yield rows[:, :n_vocab], reply[start : start + 64]


def stored_costs(target: Path, draft: Path, threads: int) -> tuple[CostModel, float, float]:
    """What `specrun generate -m TARGET -d DRAFT -t N` learned and stored on this machine: the
    verify curve, and the draft model's first and later token times (exits where nothing is)."""
    learned = cost_store().load(cost_key(model_info(target), model_info(draft), PairConfig(threads=threads)))
    if learned is None or not learned.cost.verify or "model" not in learned.sources:
        sys.exit(f"no stored costs for this pair at {threads} threads: run `specrun generate` with it first")
    src = learned.sources["model"]
    step = float(src.get("per_token") or 0.0)
    return learned.cost, float(src.get("first_s") or step), step


def agreement(target: Model, draft: Model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """The target's greedy reply (up to n tokens), and A(i): how many of its tokens from i on the
    draft predicts in a row, fed the reply itself."""
    reply = greedy_reply(target, prompt, n)
    guesses = [int(g) for rows, _ in fed_reply(draft, prompt, reply, target.n_vocab) for g in np.argmax(rows, axis=1)]
    hit = np.array(guesses) == np.array(reply)
    run = np.zeros(len(reply) + 1, dtype=int)
    for i in range(len(reply) - 1, -1, -1):
        run[i] = run[i + 1] + 1 if hit[i] else 0
    return reply, run[:-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--class", dest="cls", default="translation")
    ap.add_argument("--index", type=int, default=0, help="which prompt of the class (0: its first)")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--k-max", type=int, default=32)
    args = ap.parse_args()

    cost, first, step = stored_costs(args.target, args.draft, args.threads)

    def draft_s(m: int) -> float:
        return 0.0 if m == 0 else first + (m - 1) * step

    p = [q for q in load_prompts() if q.cls == args.cls][args.index]
    opts = LoadOptions(n_ctx=4096, n_threads=args.threads, n_outputs_max=64)
    with Model(args.target, opts) as target, Model(args.draft, opts) as draft:
        prompt = target.tokenize(render(args.target, p.prompt), add_special=True, parse_special=True)
        reply, run = agreement(target, draft, prompt, p.n_predict or args.n)
    n = len(reply)
    c = cost.table(args.k_max + 1)

    # best[i]: the least time to write reply[i:], a round at i drafting m <= run[i] tokens
    best = np.zeros(n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = min(c[m] + draft_s(m) + best[min(n, i + m + 1)] for m in range(min(int(run[i]), args.k_max, n - 1 - i) + 1))
    plain = n * c[0]

    def fixed(k: int) -> float:
        i, t = 0, 0.0
        while i < n:
            m = min(k, n - 1 - i)
            t += c[m] + draft_s(m)
            i += min(int(run[i]), m) + 1
        return t

    agree = sum(int(r > 0) for r in run) / max(1, n)
    print(f"{p.cls} #{args.index}: {n} tokens; the draft predicts {agree:.0%} of them (fed the reply)")
    print(f"costs: c(1) {1e3 * c[0]:.1f} ms; c(b)/c(1) at 2, 4, 8, 16: {', '.join(f'{c[b - 1] / c[0]:.2f}' for b in (2, 4, 8, 16))}")
    print(f"       a draft token {step / c[0]:.2f} of a step, the first of a round {first / c[0]:.2f}")
    print(f"oracle (knows what is accepted): {plain / best[0]:.2f}x plain")
    ks = (1, 2, 3, 4, 6, 8, 12, 16)
    print("fixed K, no early stop:          " + "  ".join(f"K={k} {plain / fixed(k):.2f}x" for k in ks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
