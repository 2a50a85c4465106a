"""How much token trees could add over a chain with this draft on these prompts, at this pair's
measured costs: every fixed chain length against every fixed tree shape, on the same replies.

    python scripts/tools/tree_ceiling.py TARGET.gguf DRAFT.gguf [--classes chat,explain,translation]
        [--index 0] [-n 128] [-t 2] [--width-cost X]

Greedy. The target's reply to each prompt is decoded once; the draft, fed the reply itself,
ranks each next token (so along the reply, and along any branch that is the reply, its guesses
are exactly what drafting would give). A round at position i then plays out with no guesswork:

* a chain of K drafts keeps the draft's first choices while they are the reply's tokens;
* a tree of trunk K puts, at each of its first D depths, the draft's second choice beside the
  first (at depth 1 also its third, W = 3), and lets a winning sibling go on for up to C more
  drafts of its own; it keeps the reply's tokens down whichever branch holds them.

A round brings what it keeps plus the target's own token, for the verify of all its nodes (the
stored chain curve c(b) at b = nodes + 1: a tree is priced as a chain of as many tokens, which
favours the tree) and the trunk's draft steps, plus C steps for the siblings' continuations
(as if all siblings' went in one decode, which favours the tree too). Siblings themselves cost
no draft step: they are the same rows' second choices.

The shapes are fixed for a whole reply, as llama.cpp's `-np`/`--draft-p-split` and a DDTree
budget are; the best of each kind is printed per class, with their ratio. The chooser picks
lengths and shapes per round from the draft's confidences, which helps both kinds; what this
bounds is what a second guess is worth on these replies at these costs. Costs are the pair's
stored ones (`specrun costs`), as in oracle.py; ``--width-cost X`` prices a verify of b tokens
at 1 + X (b - 1) steps instead (a GPU's nearly free width: X around 0.01), the draft's as stored.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

from specrun.bench.runner import load_prompts
from specrun.llama import LoadOptions, Model

sys.path.insert(0, str(Path(__file__).parent))
from compare_ngram import render  # noqa: E402
from oracle import fed_reply, greedy_reply, stored_costs  # noqa: E402

RANKS = 3  # the draft's choices looked at: the first, and up to two siblings


def ranks(target: Model, draft: Model, prompt: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The rank of each of the target's greedy reply tokens among the draft's choices, fed the
    reply (1: its first choice; RANKS + 1: below the ones looked at), and the draft's confidence
    in its first choice there (its softmax)."""
    out, conf = [], []
    for rows, wanted in fed_reply(draft, prompt, greedy_reply(target, prompt, n), target.n_vocab):
        top = np.argsort(-rows, axis=1)[:, :RANKS]
        for row, logits, want in zip(top, rows, wanted):
            hit = np.nonzero(row == want)[0]
            out.append(int(hit[0]) + 1 if hit.size else RANKS + 1)
            conf.append(1.0 / float(np.exp(logits - logits[row[0]]).sum()))
    return np.array(out), np.array(conf)


def play(rank: np.ndarray, i: int, k: int, d: int, c: int, w: int) -> int:
    """Drafts kept by a round at ``i`` of trunk ``k``, siblings at depths 1..``d`` (``w`` choices
    at depth 1, two below), a winning sibling going on for ``c`` more."""
    return play_at(rank, i, k, set(range(d)), c, w)


def play_at(rank: np.ndarray, i: int, k: int, at: set[int], c: int, w: int = 2) -> int:
    """The same with siblings at the trunk depths ``at`` (0: the first draft's)."""
    n = len(rank)
    for j in range(k):
        if i + j >= n:
            return j
        r = rank[i + j]
        if r == 1:
            continue
        if j in at and r <= (w if j == 0 else 2):  # a sibling holds it: on down that branch
            more = 0
            while more < c and i + j + 1 + more < n and rank[i + j + 1 + more] == 1:
                more += 1
            return j + 1 + more
        return j
    return k


def adaptive(rank: np.ndarray, conf: np.ndarray, k: int, stop: float, branch: float | None, c: int, step, cost) -> float:
    """Tokens per second of a reply written by rounds that draft while the draft's confidence
    is at least ``stop`` (the first always, at most ``k``) and, where ``branch`` is given, put
    the second choice beside every trunk draft whose confidence is under it (a winning sibling
    going on for ``c`` more). Past a rejection the confidences are the reply's, not those of the
    drafts that were made there: a stand-in for how long a chain the stop rule would have
    drafted."""
    n, i, t = len(rank), 0, 0.0
    while i < n:
        m = 1
        while m < k and i + m < n and conf[i + m] >= stop:
            m += 1
        at = {j for j in range(m) if i + j < n and branch is not None and conf[i + j] < branch}
        t += cost(m + len(at) * (1 + c), m, c if at else 0)
        i += play_at(rank, i, m, at, c) + 1
    return n / t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--classes", default="chat,explain,translation")
    ap.add_argument("--index", type=int, default=0, help="which prompt of each class (0: its first)")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--width-cost", type=float, default=None, help="a verify of b tokens costs 1 + X (b - 1) steps")
    args = ap.parse_args()

    cost, first, step = stored_costs(args.target, args.draft, args.threads)
    c = cost.table(64)
    if args.width_cost is not None:
        c = c[0] * (1.0 + args.width_cost * np.arange(len(c)))

    def draft_s(m: int) -> float:
        return 0.0 if m == 0 else first + (m - 1) * step

    print(f"costs: c(b)/c(1) at 2, 4, 8, 16: {', '.join(f'{c[b - 1] / c[0]:.2f}' for b in (2, 4, 8, 16))};")
    print(f"       a draft token {step / c[0]:.2f} of a step, the first of a round {first / c[0]:.2f}")
    chains = [(k, 0, 0, 1) for k in range(1, 17)]
    trees = [
        (k, d, cc, w)
        for k, d, cc, w in itertools.product(range(1, 17), range(1, 5), (0, 1, 2, 4), (2, 3))
        if d <= k and not (w == 3 and d == 0)
    ]
    opts = LoadOptions(n_ctx=4096, n_threads=args.threads, n_outputs_max=64)
    with Model(args.target, opts) as target, Model(args.draft, opts) as draft:
        for cls in args.classes.split(","):
            p = [q for q in load_prompts() if q.cls == cls][args.index]
            target.reset()
            draft.reset()
            prompt = target.tokenize(render(args.target, p.prompt), add_special=True, parse_special=True)
            rank, conf = ranks(target, draft, prompt, p.n_predict or args.n)
            n = len(rank)

            def rate(shape: tuple[int, int, int, int], rank: np.ndarray = rank, n: int = n) -> float:
                k, d, cc, w = shape
                nodes = k + d + (w - 2 if d else 0) + d * cc
                i, t = 0, 0.0
                while i < n:
                    t += c[min(nodes, len(c) - 1)] + draft_s(k) + (cc * step if d else 0.0)
                    i += play(rank, i, k, d, cc, w) + 1
                return n / t

            plain = 1.0 / c[0]

            def cost(nodes: int, m: int, cc: int) -> float:
                return float(c[min(nodes, len(c) - 1)] + draft_s(m) + cc * step)

            stops, branches = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9), (0.3, 0.5, 0.7, 0.9)
            a_chain = max(((k, s_, None, 0) for k in range(1, 17) for s_ in stops), key=lambda a: adaptive(rank, conf, *a, step, cost))
            a_tree = max(
                ((k, s_, b, cc) for k in range(1, 17) for s_ in stops for b in branches for cc in (0, 1, 2)),
                key=lambda a: adaptive(rank, conf, *a, step, cost),
            )
            a_rate = adaptive(rank, conf, *a_chain, step, cost), adaptive(rank, conf, *a_tree, step, cost)
            best_chain = max(chains, key=rate)
            best_tree = max(trees, key=rate)
            first_rate = float(np.mean(rank == 1))
            second = float(np.mean(rank[rank > 1] == 2)) if (rank > 1).any() else 0.0
            print(
                f"{cls}: {n} tokens; the draft's first choice is the reply's {first_rate:.0%}, its second {second:.0%} of the rest; "
                f"best chain K={best_chain[0]} {rate(best_chain) / plain:.2f}x plain; best tree K={best_tree[0]} D={best_tree[1]} "
                f"C={best_tree[2]} W={best_tree[3]} {rate(best_tree) / plain:.2f}x; tree / chain {rate(best_tree) / rate(best_chain):.3f}"
            )
            print(
                f"    by confidence: best chain K<={a_chain[0]} stop<{a_chain[1]} {a_rate[0] / plain:.2f}x plain; best tree K<={a_tree[0]} "
                f"stop<{a_tree[1]} sibling where <{a_tree[2]} C={a_tree[3]} {a_rate[1] / plain:.2f}x; tree / chain {a_rate[1] / a_rate[0]:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
