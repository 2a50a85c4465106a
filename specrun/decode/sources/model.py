"""Sources that draft one token at a time from logits of their own: a draft model, or the
target's own MTP heads (``mtp.py``). What they share lives here.

Three posteriors say how such a source does: acceptance by draft position (for the chooser,
which must weigh the source before any draft exists), and, for the stop rule, which sees each
token's confidence as it is drafted, acceptance by the draft's own confidence and acceptance of
the draft after an accepted one, by that one's confidence.

The stop rule is the chooser's rule applied as the drafts come: at the round's planned rate
``worth`` (tokens per second), a cut of the first n drafts is worth its expected tokens (by each
draft's confidence) less ``worth`` times its verify time. The round keeps the best cut, and
drafts on while some longer draft would beat that cut by more than its draft steps cost, each
further draft expected to be accepted as often as, in this source's rounds so far, a draft
following one as confident as the last was (measured: a confident token in a copied file is
followed by more of them, one in prose often is not). So the chooser decides which source
drafts, and how far is decided here, up to what the source offered this round: the draft's
confidence is what this text says now, where the position posteriors pool every text seen. It
also stops where the other sources could make more of the next tokens than drafting on would
(``rival``: where the drafts reproduce the context, the n-gram lookup drafts the rest for free).
On a memory-bound target (flat verify, cheap draft) that drafts long runs of confident tokens;
on a compute-bound one it stops early. A draft also stops at a token that ends the target's
turn: the target stops there, so nothing past it could be kept.

The draft model (``ModelSource``) is a small model with the target's vocabulary. Its KV cache
holds a prefix of the sequence (``model.tokens``); each proposal first re-syncs it (rolling back
the rejected guesses, evaluating what is new) in one batch, then drafts one token per decode.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from specrun.decode.costs import CALIBRATION_SIZES, EWMA
from specrun.decode.round import Proposal, Round, common_prefix
from specrun.decode.sampling import Dist, Sampler, greedy_confidence
from specrun.decode.sources.base import Rate, RateTable

if TYPE_CHECKING:
    from specrun.decode.costs import CostModel
    from specrun.llama import Model

CONF_BINS = 10  # the draft's confidence, in bins of 0.1
STEP = "draft step"  # the key a draft step's time is kept under on its model (``Model.timed``)


def conf_bin(conf: float) -> int:
    return min(CONF_BINS - 1, int(conf * CONF_BINS))


class Autoregressive:
    """A source that drafts token by token: posteriors, stop rule, learning. A subclass says how
    to get the first guess's logits (``_start``), feed a guess (``_step``) and finish (``_end``)."""

    name = ""

    def __init__(
        self,
        sampler: Sampler,
        rng: np.random.Generator,
        n_vocab: int,
        cost: CostModel,
        draft_max: int,
        ends_turn: Callable[[int], bool] | None = None,
    ):
        """``ends_turn(token)``: does the target stop generating at it? (None: never)"""
        self.sampler = sampler
        self.ends_turn = ends_turn if ends_turn is not None else (lambda t: False)
        self.rng = rng
        self.n_vocab = n_vocab
        self.verify = cost  # the target's verify curve, for the stop rule
        self.positions = RateTable(draft_max)  # a_j: position j accepted, given the ones before were
        self.by_conf = [Rate() for _ in range(CONF_BINS)]  # acceptance by the draft's confidence
        self.after = [Rate() for _ in range(CONF_BINS)]  # acceptance of the draft after an accepted
        # one, by that one's confidence
        self.per_token: float | None = None  # seconds per draft step: each draft after a round's first
        self.first_s: float | None = None  # seconds to a round's first draft: it also feeds what the
        # last round added (one or two tokens), so it costs more than a step
        self.p_min = 0.0  # fixed mode: stop below this confidence (the chooser's rule is off)
        self.timed = False  # a step has been timed in this process (a stored time is only a prior)

    # --- what a subclass provides ------------------------------------------------------

    def _start(self, tokens: list[int]) -> tuple[np.ndarray | None, float, int]:
        """Logits for the first guess after ``tokens`` (None: cannot draft now), and the
        seconds and tokens a catch-up of its cache took (a one-off, not a per-token cost)."""
        raise NotImplementedError

    def _step(self, x: int) -> np.ndarray:
        """Feed guess ``x``; the logits for the next guess."""
        raise NotImplementedError

    def _end(self) -> None:
        """Drafting is over (the last guess is never fed: the target judges it first)."""

    def _confidence(self, i: int, row: np.ndarray, x: int) -> float:
        """The confidence in greedy draft ``i``, ``x``, the argmax of ``row``: its softmax
        probability, unless the source states one of its own."""
        return greedy_confidence(row, x)

    # --- the chooser's view ----------------------------------------------------------

    def acceptance(self, k: int, rng: np.random.Generator | None) -> list[float]:
        return self.positions.draws(rng, k)

    def token_cost(self) -> float:
        """A draft step's seconds; before it is timed (its prompt did not fit), a target's step."""
        return self.per_token if self.per_token is not None else self.verify.verify_cost(1)

    def cost(self, k: int | np.ndarray) -> float | np.ndarray:
        step = self.token_cost()
        return (self.first_s if self.first_s is not None else step) + (k - 1) * step

    def retime(self, step: float) -> float:
        """A draft step timed in this process: it replaces the stored one (a prior from another
        day), and the costs stored with it move by the same factor, which it returns."""
        f = step / self.per_token if self.per_token else 1.0
        self.per_token = step
        if self.first_s is not None:
            self.first_s *= f
        return f

    def conf_rate(self, conf: float) -> float:
        """Acceptance of a draft token of this confidence (prior: a calibrated draft, rate = confidence)."""
        b = conf_bin(conf)
        return self.by_conf[b].mean((b + 0.5) / CONF_BINS)

    def next_rate(self, conf: float) -> float:
        """Acceptance of the draft after an accepted one of this confidence (prior: that one's
        own rate, as if confidence persisted)."""
        return self.after[conf_bin(conf)].mean(self.conf_rate(conf))

    # --- drafting --------------------------------------------------------------------

    def peek(self, seq: list[int], room: int) -> list[float]:
        return []  # it drafts from its own cache, which holds no other source's drafts

    def propose(
        self, tokens: list[int], k: int, worth: float, offered: int = 0, verify: Sequence[float] = (),
        rival: Callable[[list[int]], float] | None = None,
    ) -> Proposal:  # fmt: skip
        if k <= 0:
            return Proposal()
        t0 = time.perf_counter()
        logits, sync_s, caught_up = self._start(tokens)
        out = Proposal(sync_s=sync_s, caught_up=caught_up)
        if logits is None:
            return out
        most = max(k, offered) if worth > 0 else k  # with a stop rule, as far as the source offered
        # c[b - 1]: verifying b tokens (the pending one and b - 1 drafts)
        c = np.asarray(verify) if len(verify) > most else self.verify.table(most + 1)
        d = self.per_token or 0.0
        picked: list[float] = []  # when each draft was picked
        gained = 0.0  # expected tokens the drafts so far bring, by their confidences
        reach = 1.0  # the chance every draft so far is accepted
        keep, kept_value = 0, 0.0  # the best cut so far, and its value: tokens - worth * verify time
        try:
            for i in range(most):
                row = logits[: self.n_vocab]
                if self.sampler.greedy:
                    x = int(np.argmax(row))
                    conf = self._confidence(i, row, x)
                    q = Dist.one_hot(x)
                else:
                    q = self.sampler.dist(row)
                    x = q.sample(self.rng)
                    conf = q.top[1]
                if i > 0 and conf < self.p_min:
                    break
                reach *= self.conf_rate(conf)
                gained += reach
                out.tokens.append(x)
                out.dists.append(q)
                out.confidences.append(conf)
                picked.append(time.perf_counter())
                value = gained - worth * (c[i + 1] - c[0])
                if value >= kept_value or i == 0:
                    keep, kept_value = i + 1, value
                if i + 1 >= most or self.ends_turn(x):  # the target stops at such a token: nothing past it is kept
                    break
                if worth > 0:
                    nxt = self.next_rate(conf)
                    if not _more_pays(reach, gained, i + 1, most, kept_value, worth, nxt, c, d):
                        break
                    other = rival(tokens + out.tokens) if rival is not None else 0.0
                    if other > worth and not _more_pays(reach, gained, i + 1, most, gained - other * (c[i + 1] - c[0]), other, nxt, c, d):
                        break  # another source (a copy of the context) would make more of the next tokens
                logits = self._step(x)
        finally:
            self._end()
        if picked:
            step = (picked[-1] - picked[0]) / (len(picked) - 1) if len(picked) > 1 else 0.0
            out = dataclasses.replace(out, first_s=picked[0] - t0 - sync_s, step_s=step)
        if worth > 0:
            out = out.cut(keep)
        return out

    # --- learning --------------------------------------------------------------------

    def observe(self, outcome: Round) -> None:
        self.positions.decay()
        for r in (*self.by_conf, *self.after):
            r.decay()
        p = outcome.proposal
        if outcome.source != self.name or not p.tokens:
            return
        # a catch-up's decode also gave the first draft's logits: that round says nothing of
        # what a first draft costs, only of its steps
        if not p.caught_up:
            self.first_s = _ewma(self.first_s, p.first_s)
        if p.step_s > 0:
            self.per_token = _ewma(self.per_token, p.step_s)
        # positions 0..accepted-1 were accepted; position `accepted` (if drafted) was rejected,
        # unless the round stopped at a near-tie there, which says nothing about the draft
        # (a tree: its trunk, the chain this source drafted, as far as the path followed it; where
        # the path left it, the trunk's token there was a miss)
        accepted = outcome.on_trunk
        deferred = outcome.deferred and accepted == outcome.accepted
        for i in range(min(p.trunk, accepted + (not deferred))):
            hit = i < accepted
            self.positions.bins[i].add(hit)
            if i < len(p.confidences):
                self.by_conf[conf_bin(p.confidences[i])].add(hit)
            if 0 < i <= len(p.confidences):  # draft i - 1 was accepted: did the one after it follow?
                self.after[conf_bin(p.confidences[i - 1])].add(hit)

    def to_json(self) -> dict:
        conf, after = RateTable(CONF_BINS), RateTable(CONF_BINS)
        conf.bins, after.bins = self.by_conf, self.after
        return {
            "positions": self.positions.to_json(), "by_conf": conf.to_json(), "after_conf": after.to_json(),
            "per_token": self.per_token, "first_s": self.first_s,
        }  # fmt: skip

    def load(self, d: dict) -> None:
        if not isinstance(d, dict):
            return
        self.positions.load(d.get("positions"))
        for key, attr in (("by_conf", "by_conf"), ("after_conf", "after")):
            table = RateTable(CONF_BINS)
            table.load(d.get(key))
            if any(r.n for r in table.bins):
                setattr(self, attr, table.bins)
        for key in ("per_token", "first_s"):
            v = d.get(key)
            if isinstance(v, (int, float)) and v > 0:
                setattr(self, key, float(v))


def _more_pays(
    reach: float, gained: float, n: int, most: int, kept_value: float, worth: float, rate: float, c: np.ndarray, d: float
) -> bool:
    """Could drafting on from ``n`` tokens to some m <= ``most`` beat the best cut so far? Each
    further token is expected at ``rate``; it costs a draft step and its share of verifying m, at
    the round's planned rate ``worth``. Any m, not just the next: a verify curve with a step in it
    can make 16 tokens cheaper than 12."""
    for m in range(n + 1, min(most, len(c) - 1) + 1):
        reach *= rate
        gained += reach
        if gained - worth * (c[m] - c[0] + (m - n) * d) > kept_value:
            return True
    return False


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA * (new - old)


class ModelSource(Autoregressive):
    """A small draft model with the target's vocabulary, in a cache of its own."""

    name = "model"

    def __init__(
        self,
        model: Model,
        sampler: Sampler,
        rng: np.random.Generator,
        n_vocab_target: int,
        cost: CostModel,
        draft_max: int,
        ends_turn: Callable[[int], bool] | None = None,
    ):
        super().__init__(sampler, rng, min(model.n_vocab, n_vocab_target), cost, draft_max, ends_turn)
        self.model = model
        self.catch_up_per_token: float | None = None  # seconds per token evaluated to catch the cache up
        self.lag = 0  # tokens the cache must catch up before it can draft
        self.left = 1  # tokens the reply is expected to have left
        self.stretch: float | None = None  # the tokens its rounds brought between catch-ups, lately
        self.since_catch_up = 0  # ... and since the last one (or the prompt)
        self.keep_rows = False  # keep the rows each draft was picked from (token trees branch from them)
        self._rows: list[np.ndarray] = []  # ... this round's

    def begin(self, prompt: list[int], may_draft: Callable[[], bool]) -> None:
        """Once in a process, time a draft step (a stored time is only a prior: one from a busy
        day would price the draft model out, and a draft never tried is never timed again)
        past the prompt's first tokens, no more than the longest batch the verify curve is
        measured at (a step into a nearly empty cache can take hundreds of times as long; one
        deep in a long prompt costs a little more than there). Once, not once a source: a
        server's every slot and every request's settings draft from the same model, and a
        request that waits for its own timing waits half a second for nothing (the model
        keeps the time). Then, where the draft model is expected to pay (``may_draft``),
        prefill its cache as the target's, so that its first draft need not catch up the whole
        prompt. Elsewhere (a compute-bound target, where it seldom drafts) the prompt does not
        wait for it: a round that drafts from it catches its cache up then, at a price the
        chooser weighs (``cost``)."""
        self.lag = 0  # the last prompt's lag is no cost of this one (``prepare`` measures this one's)
        self.since_catch_up = 0  # a stretch starts with the prompt (a reply's end cut the last one short)
        if not self.timed:
            step = self.model.timed.get(STEP)
            if step is None and len(prompt) < self.model.n_ctx:
                self._fill(prompt[: CALIBRATION_SIZES[-1] + 1])
                step = self.model.timed[STEP] = self.measure_token_cost(prompt[-1])
            if step is not None:
                self.retime(step)
                self.timed = True
        if may_draft():
            self._fill(prompt)

    def _fill(self, prompt: list[int]) -> None:
        """The cache holds the prompt but its last token."""
        n = common_prefix(self.model.tokens, prompt, limit=len(prompt) - 1)
        self.model.rollback(n)
        if prompt[n:-1]:
            self.model.eval(prompt[n:-1], logits="none")

    def prepare(self, tokens: list[int], room: int, left: int) -> int:
        self.lag = len(tokens) - self.model.n_past
        self.left = max(1, left)
        return max(0, min(room, self.model.n_ctx - len(tokens), len(self.positions.bins)))

    def cost(self, k: int | np.ndarray) -> float | np.ndarray:
        # a round's usual one or two new tokens are part of its first draft's cost; more is a
        # catch-up, paid once for the stretch of rounds it drafts before it falls behind again:
        # this round bears its share (k + 1 of the stretch's tokens)
        if self.lag <= 2:
            return super().cost(k)
        return super().cost(k) + self.lag * self._catch_up_token() * np.minimum(1.0, (k + 1) / min(self.left, self._stretch()))

    def _catch_up_token(self) -> float:
        """Seconds per token of a catch-up; before one is timed, a draft step scaled as the
        target's verify curve scales a batch of the lag (the longest it measured at most)."""
        if self.catch_up_per_token is not None:
            return self.catch_up_per_token
        b = min(self.lag, CALIBRATION_SIZES[-1])
        return self.token_cost() * self.verify.verify_cost(b) / (b * self.verify.verify_cost(1))

    def _stretch(self) -> float:
        """The tokens its rounds are expected to bring between two catch-ups: as many as they
        brought between those of this process so far, the stretch that has just ended (it fell
        behind) included; where the n-gram lookup takes most rounds, every stretch pays a
        catch-up of its own. Before any stretch, the rest of the reply."""
        if self.since_catch_up:
            return _ewma(self.stretch, self.since_catch_up)
        return self.stretch if self.stretch is not None else self.left

    def _start(self, tokens: list[int]) -> tuple[np.ndarray | None, float, int]:
        if self.model.n_ctx - len(tokens) <= 0:
            return None, 0.0, 0
        t = time.perf_counter()
        n = common_prefix(self.model.tokens, tokens, limit=len(tokens) - 1)  # keep the last to evaluate
        self.model.rollback(n)
        logits = self.model.eval_last(tokens[n:])
        self.model.checkpoint(full=True)  # hybrid/recurrent drafts: the drafting decodes may be undone
        evaluated = len(tokens) - n
        caught_up = evaluated > 2  # more than a round's usual one or two tokens: a one-off
        self._rows = []
        return self._kept(logits), time.perf_counter() - t if caught_up else 0.0, evaluated if caught_up else 0

    def _step(self, x: int) -> np.ndarray:
        return self._kept(self.model.eval_last([x]))

    def _kept(self, row: np.ndarray) -> np.ndarray:
        if self.keep_rows:
            self._rows.append(np.array(row[: self.n_vocab]))
        return row

    def branch(self, tokens: list[int], chain: Proposal, nodes: int, branches: int) -> Proposal:
        """Second candidates: at a drafted position, the draft's runner-up as a leaf beside the
        trunk's token. A leaf, not a branch drafted on: it costs no draft step and never enters
        the draft's cache, and where the target takes it the round still ends with the target's
        own token after it (two tokens where the chain had one).

        Each node's chance to be on the target's path (``Proposal.reach``): a trunk token's, its
        confidence's measured rate (``conf_rate``) times its parent's; a runner-up's, its parent's
        times the chance the trunk's token there is rejected times the runner-up's share of the
        draft's law beside it. A runner-up is added where that chance is at least the whole
        trunk's (a node as likely as one the round verifies anyway), the likeliest first. At T > 0
        it is drawn from the draft's law without the trunk's token (Sequoia's sampling without
        replacement), after the choice of where, which must not depend on the draw."""
        rows = self._rows[: len(chain)]
        if len(rows) < len(chain) or nodes <= 0 or branches <= 1:
            return chain
        reach, trunk, found = 1.0, [], []
        law: Dist | None
        for i, (x, row) in enumerate(zip(chain.tokens, rows)):
            if self.sampler.greedy:
                px = chain.confidences[i]
                runner = int(np.argmax(np.where(np.arange(len(row)) == x, -np.inf, row)))
                law = Dist.one_hot(runner)
                share = px * float(np.exp(row[runner] - row[x])) / (1.0 - px) if px < 1.0 else 0.0
            else:
                q = chain.dists[i]
                rest = q.ids != x
                law = Dist(q.ids[rest], q.probs[rest] / q.probs[rest].sum()) if rest.any() and q.probs[rest].sum() > 0 else None
                share = law.top[1] if law is not None else 0.0
            hit = self.conf_rate(chain.confidences[i])
            if law is not None and share > 0:
                found.append((reach * (1.0 - hit) * min(1.0, share), i, law))
            reach *= hit
            trunk.append(reach)
        picked = sorted((f for f in found if f[0] >= reach), key=lambda f: -f[0])[: min(nodes, branches - 1)]
        tree = dataclasses.replace(chain, reach=trunk)
        for chance, i, law in picked:
            y = law.top[0] if self.sampler.greedy else law.sample(self.rng)
            grown = tree.grow([*chain.tokens[:i], y], [*chain.dists[:i], law], [*chain.confidences[:i], chance])
            tree = dataclasses.replace(grown, reach=[*tree.reach, chance])
        return tree

    def propose(
        self, tokens: list[int], k: int, worth: float, offered: int = 0, verify: Sequence[float] = (),
        rival: Callable[[list[int]], float] | None = None,
    ) -> Proposal:  # fmt: skip
        return super().propose(tokens, min(k, self.model.n_ctx - len(tokens)), worth, offered, verify, rival)

    def measure_token_cost(self, token: int) -> float:
        """Seconds for one single-token draft decode (the median of five), measured past the
        cache, then undone."""
        base = self.model.n_past
        self.model.checkpoint(full=True)  # hybrid/recurrent drafts: each measured decode is undone
        self.model.eval([token], logits="last")  # warm-up: the first decode after a load is slow
        self.model.rollback(base)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            self.model.eval([token], logits="last")
            times.append(time.perf_counter() - t)
            self.model.rollback(base)
        return statistics.median(times)

    def observe(self, outcome: Round) -> None:
        super().observe(outcome)
        p = outcome.proposal
        if outcome.source != self.name:
            return
        if p.caught_up:  # a stretch ends, and another starts with this round
            if p.sync_s > 0:
                self.catch_up_per_token = _ewma(self.catch_up_per_token, p.sync_s / p.caught_up)
            if self.since_catch_up:
                self.stretch = self._stretch()
            self.since_catch_up = 0
        self.since_catch_up += len(outcome.emitted)

    def rollback(self, keep: int) -> None:
        self.model.rollback(keep)

    def retime(self, step: float) -> float:
        f = super().retime(step)
        if self.catch_up_per_token is not None:
            self.catch_up_per_token *= f
        return f

    def to_json(self) -> dict:
        return {**super().to_json(), "catch_up_per_token": self.catch_up_per_token}

    def load(self, d: dict) -> None:
        super().load(d)
        v = d.get("catch_up_per_token") if isinstance(d, dict) else None
        if isinstance(v, (int, float)) and v > 0:
            self.catch_up_per_token = float(v)
