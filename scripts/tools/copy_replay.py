"""Replay plain outputs through the n-gram drafter and the controller, offline.

    python scripts/tools/copy_replay.py [TARGET.gguf] [-t 2] [--outputs plain.json] [--stored-copies]

Decodes every bench prompt plainly once (greedy, the bench's -n per prompt), then, with the
verify-cost curve stored for this machine (run `specrun bench` first), computes per class:

- ceiling: a perfect drafter, every round verifying the curve's best batch, max b / c(b);
- copy oracle: the n-gram drafter with K chosen knowing how far each copy will match
  (dynamic programming over the output): the best any K policy could do with these copies;
- replay: the adaptive controller's own choices, fed the same copies, no near-ties; with
  ``--stored-copies`` its copy model starts from the statistics stored for the pair (as a new
  process does), and a second column replays it without the run's trust (rates as stored).

``--outputs FILE`` keeps the plain outputs there (decoded once, read back on the next call).

Nothing is timed here: speeds are in units of one plain decode step, from the curve, so the
figures are reproducible on a noisy machine. `specrun bench` measures the real thing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from specrun.bench import load_prompts
from specrun.config import PairConfig
from specrun.control import Controller, CopyModel, CostModel
from specrun.costs import CostStore, Learned
from specrun.drafters import NgramDrafter, common_prefix
from specrun.engine import Engine, Settings
from specrun.prompt import chat_prompt
from specrun.sampling import Sampler
from specrun.session import open_pair
from specrun.stream import stream_generate

MODELS = Path.home() / ".cache/specrun/models"
DEMO_TARGET = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT_MAX = 32


def plain_outputs(target: Path, threads: int, n_default: int) -> list[tuple[str, list[int], list[int]]]:
    pair = open_pair(target, None, PairConfig(n_ctx=4096, threads=threads))
    out = []
    try:
        for p in load_prompts():
            if p.chat:
                prompt = chat_prompt(pair, [{"role": "user", "content": p.prompt}])
            else:
                prompt = pair.target.tokenize(p.prompt, add_special=True)
            e = Engine(pair.target, None, Settings(draft="none"), Sampler(0.0), CostModel())
            e.reset()  # every prompt from an empty cache, as in the bench
            gen = [t for event in stream_generate(e, prompt, p.n_predict or n_default) for t in event.tokens]
            out.append((p.cls, prompt, gen))
    finally:
        pair.close()
    return out


def load_outputs(path: Path | None, target: Path, threads: int, n_default: int) -> list[tuple[str, list[int], list[int]]]:
    """The plain outputs, read from ``path`` if it exists, else decoded (and kept there)."""
    if path and path.exists():
        return [tuple(x) for x in json.loads(path.read_text())]
    outputs = plain_outputs(target, threads, n_default)
    if path:
        path.write_text(json.dumps(outputs))
    return outputs


def copy_runs(prompt: list[int], gen: list[int]) -> list[int]:
    """At each output position, how many tokens the n-gram drafter's proposal would match."""
    seq, d, runs = prompt + gen, NgramDrafter(), []
    for i in range(len(gen)):
        pos = len(prompt) + i
        p = d.propose(seq[:pos], DRAFT_MAX)
        runs.append(common_prefix(p.tokens, seq[pos : pos + len(p.tokens)]))
    return runs


def oracle(runs: list[int], c) -> float:
    n = len(runs)
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = c(1) + best[i + 1]
        for k in range(1, runs[i] + 1):
            best[i] = min(best[i], c(k + 1) + best[min(n, i + k + 1)])
    return n * c(1) / best[0] if n else 1.0


class FullTrust(CopyModel):
    """The copy model with the bins' rates as they are, never scaled by the run's trust."""

    def trust(self, rate: float = 1.0) -> float:
        return 1.0


def replay(prompt: list[int], gen: list[int], cost: CostModel, copies: dict | None = None, model: type[CopyModel] = CopyModel) -> float:
    copy = model.from_json(copies) if copies else None
    ctrl = Controller(["ngram"], draft_min=1, draft_max=DRAFT_MAX, p_split=0.0, fixed=False, cost=CostModel(dict(cost.verify)), copy=copy)
    seq, d, pos, spent = prompt + gen, NgramDrafter(), len(prompt), 0.0
    while pos < len(seq):
        room = len(seq) - pos - 1
        copy = d.propose(seq[:pos], max(0, min(room, DRAFT_MAX)))
        plan = ctrl.plan(ngram_available=len(copy), ngram_match=copy.match, room=room)
        k = plan.k if plan.source == "ngram" else 0
        n = common_prefix(copy.tokens[:k], seq[pos : pos + k])
        emitted = seq[pos : pos + n + 1]
        ctrl.observe_copy(copy.match, copy.tokens, emitted)
        spent += cost.verify_cost(k + 1)
        pos += len(emitted)
    return len(gen) * cost.verify_cost(1) / spent if gen else 1.0


def stored_curve(costs: Path, target: Path) -> tuple[str, Learned] | None:
    """The fullest verify curve stored for ``target`` on this machine's CPU, with its key;
    None (said on stderr) if there is none yet."""
    store = CostStore(costs)
    found = [(k, store.load(k)) for k in store.entries() if k.startswith(target.name + ":") and k.endswith("|cpu")]
    curves = [(k, learned) for k, learned in found if learned is not None and len(learned.cost.verify) > 1]
    if not curves:
        print(f"no stored verify curve for {target.name} in {costs}: run `specrun bench` first", file=sys.stderr)
        return None
    return max(curves, key=lambda kl: len(kl[1].cost.verify))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", nargs="?", type=Path, default=DEMO_TARGET)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128, help="tokens per prompt without its own n (the bench default)")
    ap.add_argument("--costs", type=Path, default=Path.home() / ".cache/specrun/costs.json")
    ap.add_argument("--outputs", type=Path, help="cache the plain outputs in this JSON file")
    ap.add_argument("--stored-copies", action="store_true", help="start from the pair's stored copy statistics")
    args = ap.parse_args()
    found = stored_curve(args.costs, args.target)
    if found is None:
        return 1
    key, learned = found
    cost = learned.cost
    c = cost.verify_cost
    ceiling = max(b * c(1) / c(b) for b in range(1, DRAFT_MAX + 2))
    copies = learned.copy if args.stored_copies else None
    if args.stored_copies:
        print(f"copy statistics: {'as stored' if copies else 'none stored'}")
    outputs = load_outputs(args.outputs, args.target, args.threads, args.n)
    rows: dict[str, list[tuple[float, ...]]] = {}
    for cls, prompt, gen in outputs:
        row = [oracle(copy_runs(prompt, gen), c), replay(prompt, gen, cost, copies)]
        if copies:
            row.append(replay(prompt, gen, cost, copies, FullTrust))
        rows.setdefault(cls, []).append(tuple(row))
    print(f"verify curve: {key}")
    print(f"ceiling (perfect drafter, best batch): {ceiling:.2f}x")
    cols = ["copy oracle", "controller replay"] + (["replay without trust"] if copies else [])
    print("| class | " + " | ".join(cols) + " | lowest prompt (replay) |")
    print("|---" * (len(cols) + 2) + "|")
    for cls, v in rows.items():
        means = [statistics.geometric_mean([r[i] for r in v]) for i in range(len(cols))]
        lows = " / ".join(f"{min(r[i] for r in v):.2f}x" for i in range(1, len(cols)))
        print(f"| {cls} | " + " | ".join(f"{m:.2f}x" for m in means) + f" | {lows} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
