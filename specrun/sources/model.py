"""The draft-model source: a small model with the target's vocabulary drafts autoregressively.

Its KV cache holds a prefix of the sequence (``model.tokens``); each proposal first re-syncs it
(rolling back the rejected guesses, evaluating what is new) in one batch, then drafts one token
per decode. Two posteriors say how it does: acceptance by draft position (for the chooser, which
must pick a length before any draft exists) and acceptance by the draft's own confidence (for
the stop rule, which sees each token's confidence as it is drafted).

The stop rule is the chooser's rule applied one token at a time: a round's worth is tokens per
second, so a drafted token is kept while what it is expected to add (the chance the draft so far
is accepted, times its own chance by confidence) is worth at least the extra verify width it
costs at the round's planned rate, and drafting goes on while the next token, at its position's
rate, is worth a draft decode plus that width. On a memory-bound target (flat verify, cheap
draft) that drafts long runs of confident tokens; on a compute-bound one it stops early.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ..drafters import Proposal, common_prefix
from ..sampling import Dist, Sampler
from .base import Outcome, Rate, RateTable

if TYPE_CHECKING:
    from ..backend import Model
    from ..costs import CostModel

CONF_BINS = 10  # the draft's confidence, in bins of 0.1


def conf_bin(conf: float) -> int:
    return min(CONF_BINS - 1, int(conf * CONF_BINS))


class ModelSource:
    name = "model"

    def __init__(self, model: Model, sampler: Sampler, rng: np.random.Generator, n_vocab_target: int, cost: CostModel, k_max: int):
        self.model = model
        self.sampler = sampler
        self.rng = rng
        self.n_vocab = min(model.n_vocab, n_vocab_target)
        self.verify = cost  # the target's verify curve, for the stop rule
        self.positions = RateTable(k_max)  # a_j: position j accepted, given the ones before were
        self.by_conf = [Rate() for _ in range(CONF_BINS)]  # acceptance by the draft's confidence
        self.per_token: float | None = None  # seconds per drafted token
        self.catch_up_per_token: float | None = None  # seconds per token evaluated to catch the cache up
        self.lag = 0  # tokens the cache must catch up before it can draft
        self.p_split = 0.0  # fixed mode: stop below this confidence (the chooser's rule is off)

    # --- the chooser's view ----------------------------------------------------------

    def begin(self, prompt: list[int], may_draft: bool) -> None:
        """Prefill the cache as the target's, if it may draft: its first draft need not catch
        up the whole prompt. Measure its per-token cost if nothing has yet."""
        if not may_draft:
            return
        n = common_prefix(self.model.tokens, prompt, limit=len(prompt) - 1)
        self.model.rollback(n)
        if prompt[n:-1]:
            self.model.eval(prompt[n:-1], logits="none")
        if self.per_token is None and self.model.n_past < self.model.n_ctx:
            self.per_token = self.measure_token_cost(prompt[-1])

    def prepare(self, tokens: list[int], room: int) -> int:
        self.lag = len(tokens) - self.model.n_past
        return max(0, min(room, self.model.n_ctx - len(tokens), len(self.positions.bins)))

    def acceptance(self, k: int, rng: np.random.Generator | None, scale: float) -> list[float]:
        return self.positions.draws(rng, scale)[:k]

    def cost(self, k: int) -> float:
        c1 = self.verify.verify_cost(1)
        d = self.per_token if self.per_token is not None else 0.5 * c1
        # a round's usual one or two new tokens are part of the per-token cost; more is a catch-up
        catch = self.catch_up_per_token if self.catch_up_per_token is not None else 0.5 * d
        return k * d + (self.lag * catch if self.lag > 2 else 0.0)

    def conf_rate(self, conf: float) -> float:
        """Acceptance of a draft token of this confidence (prior: a calibrated draft, rate = confidence)."""
        b = conf_bin(conf)
        return self.by_conf[b].mean((b + 0.5) / CONF_BINS)

    # --- drafting --------------------------------------------------------------------

    def propose(self, tokens: list[int], k: int, worth: float) -> Proposal:
        k = min(k, self.model.n_ctx - len(tokens))
        if k <= 0:
            return Proposal()
        t = time.perf_counter()
        n = common_prefix(self.model.tokens, tokens, limit=len(tokens) - 1)  # keep the last to evaluate
        self.model.rollback(n)
        evaluated = len(tokens) - n
        logits = self.model.eval_last(tokens[n:])
        caught_up = evaluated > 2  # more than a round's usual one or two tokens: a one-off
        out = Proposal(sync_s=time.perf_counter() - t if caught_up else 0.0, caught_up=evaluated if caught_up else 0)
        c = self.verify.verify_cost
        d = self.per_token or 0.0
        a = self.positions.means()
        reach = 1.0  # the chance every draft so far is accepted
        for i in range(k):
            row = logits[: self.n_vocab]
            if self.sampler.greedy:
                x = int(np.argmax(row))
                conf = 1.0 / float(np.sum(np.exp(row - row[x])))
                q = Dist.one_hot(x)
            else:
                q = self.sampler.dist(row)
                x = q.sample(self.rng)
                conf = q.top[1]
            width = c(i + 2) - c(i + 1)  # verifying one token more
            if i > 0 and (conf < self.p_split or (worth > 0 and reach * self.conf_rate(conf) < worth * width)):
                break
            reach *= self.conf_rate(conf)
            out.tokens.append(x)
            out.dists.append(q)
            out.confidences.append(conf)
            if i + 1 >= k or (worth > 0 and i + 1 < len(a) and reach * a[i + 1] < worth * (d + c(i + 3) - c(i + 2))):
                break  # the last guess is not evaluated here: the target judges it first
            logits = self.model.eval_last([x])
        return out

    def measure_token_cost(self, token: int) -> float:
        """Seconds for one single-token draft decode, measured past the cache, then undone."""
        base = self.model.n_past
        self.model.eval([token], logits="last")  # warm-up: the first decode after a load is slow
        self.model.rollback(base)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            self.model.eval([token], logits="last")
            best = min(best, time.perf_counter() - t)
            self.model.rollback(base)
        return best

    # --- learning --------------------------------------------------------------------

    def observe(self, outcome: Outcome) -> None:
        self.positions.decay()
        for r in self.by_conf:
            r.decay()
        p = outcome.proposal
        if outcome.source != self.name or not p.tokens:
            return
        drafted = len(p.tokens)
        per = (outcome.stats.draft_s - p.sync_s) / drafted
        self.per_token = per if self.per_token is None else self.per_token + 0.15 * (per - self.per_token)
        if p.caught_up and p.sync_s > 0:
            cu = p.sync_s / p.caught_up
            self.catch_up_per_token = (
                cu if self.catch_up_per_token is None else self.catch_up_per_token + 0.15 * (cu - self.catch_up_per_token)
            )
        # positions 0..accepted-1 were accepted; position `accepted` (if drafted) was rejected,
        # unless the round stopped at a near-tie there, which says nothing about the draft
        for i in range(min(drafted, outcome.accepted + (not outcome.deferred))):
            hit = i < outcome.accepted
            self.positions.bins[i].add(hit)
            if i < len(p.confidences):
                self.by_conf[conf_bin(p.confidences[i])].add(hit)

    def rollback(self, keep: int) -> None:
        self.model.rollback(keep)

    def to_json(self) -> dict:
        return {
            "positions": self.positions.to_json(),
            "by_conf": {"hits": [round(r.hits, 3) for r in self.by_conf], "n": [round(r.n, 3) for r in self.by_conf]},
            "per_token": self.per_token,
            "catch_up_per_token": self.catch_up_per_token,
        }

    def load(self, d: dict) -> None:
        if not isinstance(d, dict):
            return
        self.positions.load(d.get("positions"))
        conf = RateTable(CONF_BINS)
        conf.load(d.get("by_conf"))
        if any(r.n for r in conf.bins):
            self.by_conf = conf.bins
        for name in ("per_token", "catch_up_per_token"):
            v = d.get(name)
            if isinstance(v, (int, float)) and v > 0:
                setattr(self, name, float(v))
