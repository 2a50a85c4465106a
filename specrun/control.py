"""The adaptive controller: measured costs and acceptance in, the next round's plan out.

Each round it picks a draft source (the model, the n-gram lookup or none) and a draft length
K that maximise the expected tokens per second::

    E[tokens | K] = 1 + sum_{i=1..K} prod_{j<=i} a_j          (a_j: acceptance at position j,
                                                               given positions < j were accepted)
    T(K)          = c(K + 1) + K * d                           (c(b): the target's measured time
                                                               to verify a batch of b tokens;
                                                               d: draft time per token, 0 for n-grams)
    rate(K)       = E[tokens | K] / T(K),    K = 0 (plain decoding) gives 1 / c(1)

``c`` is a measured curve, not a formula: on a CPU four tokens cost ~2.4 single steps but
sixteen verify faster than twelve (a GEMM path takes over); on a GPU c is nearly flat. It is
calibrated once per target and machine (and stored), then refined online with every round,
as are ``d`` and the draft model's ``a_j`` (exponential moving averages).

N-gram guesses are copies of an earlier span, and a copy that has already matched L tokens is
far likelier to go on matching than a fresh two-token match (code editing returns whole
files; chat rarely repeats itself). So their ``a_j`` come from a ``CopyModel``: the chance
that a copy continues, by how long it already is (``a_j = p(L + j - 1)``). N-gram guesses
cost nothing to make, so every round scores the one on offer against what the target
actually produced, drafted or not: the model learns from every token, and a copy that
starts to pay is taken up at once, without probing.

Near-ties (greedy decoding with a tie margin, see the engine) end a round early and cost it
its last token. In prose a fifth of the positions can be near-ties, in code almost none, so
their rate is measured too (on every row a round checks) and discounts every draft.

p-split (the model drafter stops when its top-token probability falls below it) is set to
the lowest confidence at which a draft token still pays: a draft token of confidence c is
worth proposing if acc(c) * c(1) > d + (c(K + 2) - c(K + 1)), with acc(c) measured per
confidence bin.

K = 0 is a valid outcome. The draft model, when not chosen for a while, is probed with a
short draft, at an interval that doubles after each probe that does not win (16 rounds up to
256), in case things change. The draft model is only drafted or probed while it *could*
pay: with an optimistic acceptance (``max(0.9, measured)`` at every position) its best rate must beat
plain decoding by 5%. Where verifying is nearly as dear per token as decoding and the draft
costs half the target (a CPU), it cannot, so it is never run and its cache never has to
catch up; on a GPU it easily can.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .costs import CALIBRATION_SIZES, CostModel, CostStore, Learned, calibrate, now

__all__ = ["CALIBRATION_SIZES", "Controller", "CopyModel", "CostModel", "CostStore", "Learned", "Plan", "calibrate", "now"]

if TYPE_CHECKING:
    from .stats import RunStats

EWMA = 0.15
TIE_EWMA = 0.05
EXPLORE_SHARE = 0.01  # exploration may take at most this share of the rounds, and lose at most this share of the time
EXPLORE_ROOM = 8  # an exploration of K tokens needs room for this many K-token drafts after it
OPTIMISTIC_ACCEPTANCE = 0.9
MODEL_MARGIN = 1.05
PROBE_MIN, PROBE_MAX = 16, 256
CONF_BINS = 10
COPY_BINS = (0, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # lower edges of the copy-length bins
# (0 and 1: a copy just past an edit the n-gram drafter learned)
COPY_DECAY = 0.99  # per observation: a bin remembers its last ~100 tokens
COPY_PRIOR_WEIGHT = 4.0  # the prior counts as this many observations
PERSISTED_WEIGHT = 8.0  # a stored bin counts as at most this many observations in a new run
TRUST_WEIGHT = 4.0  # this run's copies overrule the bins' rates once they reach this many expected hits
TRUST_DECAY = 0.95  # per scored copy token: the run's trust follows its last ~20
TRUST_SPLIT = 0.5  # rates from here up keep a trust of their own


@dataclass(frozen=True)
class Plan:
    source: str  # "model", "ngram" or "none"
    k: int
    p_split: float = 0.0
    probe: bool = False  # a short try of the idle draft model
    explore: bool = False  # a longer draft than the estimates favour, to check an unverified size


class CopyModel:
    """P(the next token continues a copy | the copy has already matched L tokens), per bin of L.

    Each bin is a decayed hit/total count, shrunk towards a prior that rises with L (a short
    match is weak evidence, a long one strong) until the bin has data of its own.

    The bins may have been learned on other text (a stored model: code edits, then a summary
    to write). So every rate is also scaled by this run's *trust*, how the copy tokens scored
    lately compared with what the bins predicted for them (at most 1): a run whose copies keep
    breaking pulls every bin down within a few rounds, before each bin has seen enough misses
    of its own, and the trust returns to 1 as the bins learn the run's rates.

    Trust is kept apart for confident rates (at least TRUST_SPLIT) and weak ones: in a chat
    answer two-token matches go on more often than stored (0.25 predicted) and three-token
    ones far less (0.6 predicted), and one trust over both let the weak bins' surplus cancel
    the confident bins' misses, the only ones the controller acts on.
    """

    def __init__(self) -> None:
        self.hits = [0.0] * len(COPY_BINS)
        self.total = [0.0] * len(COPY_BINS)
        self.run_hits = [0.0, 0.0]  # this run's scored copy tokens, weak and confident: decayed hits ...
        self.run_expected = [0.0, 0.0]  # ... and the hits the bins predicted for them

    @staticmethod
    def prior(length: int) -> float:
        return min(0.9, 0.3 + 0.15 * math.log2(max(length, 2) / 2))

    @staticmethod
    def _bin(length: int) -> int:
        return max(0, bisect_right(COPY_BINS, length) - 1)

    def rate(self, length: int) -> float:
        """The bin's rate, shrunk towards the prior."""
        b = self._bin(length)
        return (self.hits[b] + COPY_PRIOR_WEIGHT * self.prior(COPY_BINS[b])) / (self.total[b] + COPY_PRIOR_WEIGHT)

    @staticmethod
    def _band(rate: float) -> int:
        """Which trust a rate answers to: 0 weak, 1 confident."""
        return int(rate >= TRUST_SPLIT)

    def trust(self, rate: float = 1.0) -> float:
        """How far this run bears out rates like ``rate`` (at most 1)."""
        band = self._band(rate)
        return min(1.0, (self.run_hits[band] + TRUST_WEIGHT) / (self.run_expected[band] + TRUST_WEIGHT))

    def p(self, length: int) -> float:
        rate = self.rate(length)
        return rate * self.trust(rate)

    def acceptance(self, length: int, k: int) -> list[float]:
        """a_1..a_k for a k-token copy proposed after ``length`` matched tokens."""
        return [self.p(length + j) for j in range(k)]

    def observe(self, length: int, proposed: list[int], actual: list[int]) -> None:
        """Score a copy against the tokens that really followed, up to the first miss."""
        for j, (x, y) in enumerate(zip(proposed, actual)):
            rate = self.rate(length + j)
            band = self._band(rate)
            self.run_hits[band] = self.run_hits[band] * TRUST_DECAY + (x == y)
            self.run_expected[band] = self.run_expected[band] * TRUST_DECAY + rate
            b = self._bin(length + j)
            self.hits[b] = self.hits[b] * COPY_DECAY + (x == y)
            self.total[b] = self.total[b] * COPY_DECAY + 1.0
            if x != y:
                break

    def to_json(self) -> dict:
        return {"bins": list(COPY_BINS), "hits": [round(h, 3) for h in self.hits], "total": [round(t, 3) for t in self.total]}

    @classmethod
    def from_json(cls, d: dict | None, keep: float = PERSISTED_WEIGHT) -> CopyModel:
        """A stored model as a prior: each bin keeps its rate but counts as at most ``keep``
        observations, so a new run (another kind of text, say) soon outweighs it; anything
        malformed is a fresh model."""
        m = cls()
        try:
            if d is None or list(d["bins"]) != list(COPY_BINS):
                return m
            hits, total = [float(x) for x in d["hits"]], [float(x) for x in d["total"]]
        except (KeyError, TypeError, ValueError):
            return m
        cap = 1.0 / (1.0 - COPY_DECAY)  # what a bin can hold at most
        if len(hits) == len(total) == len(COPY_BINS) and all(0 <= h <= t <= cap + 1e-6 for h, t in zip(hits, total)):
            scale = [min(1.0, keep / t) if t > 0 else 0.0 for t in total]
            m.hits = [h * f for h, f in zip(hits, scale)]
            m.total = [t * f for t, f in zip(total, scale)]
        return m


def expected_tokens(acc: list[float], k: int) -> float:
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= acc[i]
        total += reach
    return total


class Controller:
    def __init__(
        self,
        sources: list[str],
        *,
        draft_min: int,
        draft_max: int,
        p_split: float,
        fixed: bool,
        cost: CostModel,
        copy: CopyModel | None = None,
        tie_rate: float = 0.0,
    ):
        self.sources = sources  # drafters available, in preference order for fixed mode
        self.draft_min = draft_min
        self.draft_max = draft_max
        self.fixed = fixed
        self.cost = cost
        self.p_split = p_split
        self.acc = [0.7] * draft_max  # the draft model's a_j, by position
        self.seen = [0] * draft_max  # observations per position
        self.copy = copy or CopyModel()  # the n-gram source's a_j, by copy length
        self.conf_acc = [0.5 + 0.05 * i for i in range(CONF_BINS)]  # acceptance by confidence bin
        self.tie_rate = tie_rate  # how often a position is a near-tie (greedy with a tie margin)
        self.offer_rate = 1.0  # how often the n-gram lookup has a copy on offer
        self.idle = 0  # rounds since the draft model was last run
        self.probe_every = PROBE_MIN
        self.elapsed = 0.0  # seconds of drafting and verifying observed
        self.explore_loss = 0.0  # seconds exploration cost beyond plain decoding (negative: it paid)
        self.rounds = 0  # rounds observed
        self.explored = 0  # of which explorations
        self._can_pay: tuple[tuple, bool] = ((), False)  # model_can_pay's last answer, and for what

    # --- planning ------------------------------------------------------------------

    def _draft_cost(self, source: str) -> float:
        if source != "model":
            return 0.0
        d = self.cost.draft_per_token
        return d if d is not None else 0.5 * self.cost.verify_cost(1)

    def best_k(
        self, acc: list[float], d: float, k_max: int, c: Callable[[int], float] | None = None, once: float = 0.0
    ) -> tuple[int, float]:
        """The K in {0} U [draft_min, k_max] with the highest expected rate, and that rate,
        for per-position acceptance ``acc``, draft cost ``d`` per token, verify costs ``c``
        (the current estimates unless given) and a one-off cost ``once`` (catching the draft
        model's cache up).

        A near-tie (greedy, see the engine) stops a round where it falls and costs the round
        its last token, so each drafted position is usable with probability ``a_j (1 - tie)``
        and the target's own token comes with probability ``1 - tie``."""
        c = c or self.cost.verify_cost
        best_k, best_rate = 0, 1.0 / self.cost.verify_cost(1)
        usable = 1.0 - self.tie_rate
        total, reach = usable, 1.0
        for k in range(1, min(k_max, len(acc)) + 1):
            reach *= acc[k - 1] * usable
            total += reach
            if k < self.draft_min:
                continue
            rate = total / (c(k + 1) + k * d + once)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def acceptance(self) -> list[float]:
        """Per-position acceptance; a position never drafted takes the estimate of the last
        one that was, so good news at position 2 lets the controller try position 3."""
        out, last = [], None
        for a, n in zip(self.acc, self.seen):
            last = a if n or last is None else last
            out.append(last)
        return out

    def plan(self, ngram_available: int = 0, ngram_match: int = 0, room: int | None = None, model_lag: int = 0) -> Plan:
        """Choose the next round. ``ngram_available``: length of the n-gram proposal on offer,
        ``ngram_match``: how many tokens its copy has already matched; ``room``: how many
        draft tokens the context and the token budget still allow; ``model_lag``: how many
        tokens the draft model's cache must catch up before it can draft (after a stretch of
        n-gram or plain rounds). Planning changes nothing: only ``observe*`` learn."""
        k_cap = self.draft_max if room is None else max(0, min(self.draft_max, room))
        # an exploration only of a size the rest of the run has room to use: a one-shot run's
        # last tokens would pay a long verify for a curve this run can no longer draft with
        explore_cap = k_cap if room is None else min(k_cap, room // EXPLORE_ROOM)
        lengths = {"model": k_cap, "ngram": min(ngram_available, k_cap), "none": 0}
        usable = [s for s in self.sources if lengths.get(s, 0) >= max(1, self.draft_min)]
        if not self.fixed and "model" in usable and not self.model_can_pay(lengths["model"]):
            usable.remove("model")
        if self.fixed:
            if not usable:
                return Plan("none", 0)
            s = usable[0]
            return Plan(s, lengths[s], self.p_split if s == "model" else 0.0)

        best, best_rate, best_tokens = Plan("none", 0), 1.0 / self.cost.verify_cost(1), 1.0
        explore, explore_rate, explore_tokens = None, best_rate, 1.0
        catch_up = self.cost.catch_up_cost(model_lag)
        for s in usable:
            acc = self.copy.acceptance(ngram_match, lengths[s]) if s == "ngram" else self.acceptance()
            d, once = self._draft_cost(s), catch_up if s == "model" else 0.0
            k, rate = self.best_k(acc, d, lengths[s], once=once)
            if k and rate > best_rate:
                best, best_rate, best_tokens = Plan(s, k, self._p_split(k) if s == "model" else 0.0), rate, expected_tokens(acc, k)
            # what if the sizes not verified in this process cost no more than smaller ones that were?
            k, rate = self.best_k(acc, d, min(lengths[s], explore_cap), self.cost.optimistic, once)
            if k and self.cost.unseen(k + 1) and rate > explore_rate:
                explore, explore_rate = Plan(s, k, self._p_split(k) if s == "model" else 0.0, explore=True), rate
                explore_tokens = expected_tokens(acc, k)
        # exploring stakes a verify of an unmeasured size: only for a draft expected to bring at
        # least one token more than the best known plan (a weak copy gains little however cheap)
        if explore is not None and explore_rate > best_rate and explore_tokens >= best_tokens + 1 and self.may_explore():
            return explore
        if "model" in usable and best.source != "model" and self.idle >= self.probe_every and catch_up <= 2 * self.cost.verify_cost(1):
            # the draft model has not been run for a while: try a short draft, in case
            # things changed (the n-gram source needs no probing: it is scored every round);
            # not while its cache lags far behind: catching it up would cost more than the try
            k = min(lengths["model"], max(self.draft_min, 2))
            best = Plan("model", k, self._p_split(k), probe=True)
        return best

    def may_explore(self) -> bool:
        """At most EXPLORE_SHARE of the rounds explore (the first after 1 / EXPLORE_SHARE rounds:
        a short generation has no time to recover a wasted long verify), while what exploring
        lost stays within EXPLORE_SHARE of the time spent."""
        return self.explored + 1 <= EXPLORE_SHARE * self.rounds and self.explore_loss <= EXPLORE_SHARE * self.elapsed

    def model_can_pay(self, k_max: int) -> bool:
        """Could the draft model beat plain decoding by MODEL_MARGIN with optimistic acceptance?
        (Answered once per round: it scans every draft length, and planning and explaining
        both ask.)"""
        key = (self.rounds, k_max, self.cost.verify_cost(1))
        if self._can_pay[0] != key:
            optimistic = [max(OPTIMISTIC_ACCEPTANCE, a) for a in self.acc]
            k, rate = self.best_k(optimistic, self._draft_cost("model"), k_max)
            self._can_pay = (key, k > 0 and rate > MODEL_MARGIN / key[2])
        return self._can_pay[1]

    def _p_split(self, k: int) -> float:
        """The lowest confidence whose measured acceptance still pays for the extra token."""
        c1 = self.cost.verify_cost(1)
        marginal = self._draft_cost("model") + self.cost.verify_cost(k + 2) - self.cost.verify_cost(k + 1)
        threshold = min(0.95, max(0.0, marginal / c1))
        for b in range(CONF_BINS):
            if all(a >= threshold for a in self.conf_acc[b:]):
                return b / CONF_BINS
        return 1.0

    # --- learning -----------------------------------------------------------------

    def observe(
        self,
        plan: Plan,
        drafted: int,
        accepted: int,
        verify_s: float,
        draft_s: float,
        confidences: list[float] | None = None,
        tie_stop: bool = False,
        caught_up: tuple[int, float] = (0, 0.0),
    ) -> None:
        """``draft_s`` leaves out catching the draft model's cache up, which ``caught_up``
        gives as (tokens, seconds). ``tie_stop``: the round stopped at a near-tie, not at a
        rejection (the tie rate accounts for that, so the position is not counted against the
        draft)."""
        self.cost.observe_verify(drafted + 1, verify_s)
        self.cost.observe_catch_up(*caught_up)
        self.elapsed += verify_s + draft_s
        self.rounds += 1
        if plan.explore:  # what it cost beyond decoding the same tokens plainly
            self.explore_loss += verify_s + draft_s - (accepted + 1) * self.cost.verify_cost(1)
            self.explored += 1
        self.idle = 0 if plan.source == "model" else self.idle + 1
        if plan.probe:  # the next probe waits longer, unless this one pays (below)
            self.probe_every = min(PROBE_MAX, self.probe_every * 2)
        if plan.source != "model" or not drafted:
            return  # n-gram guesses are scored by observe_copy, drafted or not
        self.cost.observe_draft(drafted, draft_s)
        table, seen = self.acc, self.seen
        # positions 0..accepted-1 were accepted; position `accepted` (if drafted) was rejected
        for i in range(min(drafted, accepted + (not tie_stop))):
            hit = 1.0 if i < accepted else 0.0
            if not seen[i]:  # first look at this position: start from what the one before knows
                table[i] = self.acceptance()[i]
            seen[i] += 1
            table[i] += EWMA * (hit - table[i])
            if confidences and i < len(confidences):
                b = min(CONF_BINS - 1, int(confidences[i] * CONF_BINS))
                self.conf_acc[b] += EWMA * (hit - self.conf_acc[b])
        if plan.probe:
            # a probe that paid for itself resets the probing interval
            k_rate = expected_tokens(self.acceptance(), drafted) / (verify_s + draft_s)
            if k_rate > 1.0 / self.cost.verify_cost(1):
                self.probe_every = PROBE_MIN

    def observe_ties(self, checked: int, ties: int) -> None:
        """A greedy round checked ``checked`` positions for a near-tie and found ``ties`` (the
        last ones: a near-tie ends the round). The rate is per position, as ``best_k`` uses it:
        counting only each round's first row (as before) counted every near-tie that ended a
        round but only one of its other positions, and read 10-30% on summaries."""
        for i in range(checked):
            self.tie_rate += TIE_EWMA * (float(i >= checked - ties) - self.tie_rate)

    def observe_copy(self, match: int, proposed: list[int], emitted: list[int]) -> None:
        """The n-gram proposal on offer this round (used or not; empty if none) against what
        was emitted."""
        self.offer_rate += TIE_EWMA * (float(bool(proposed)) - self.offer_rate)
        self.copy.observe(match, proposed, emitted)

    # --- explaining ----------------------------------------------------------------

    def idle_reason(self, stats: RunStats, window: int = 32) -> str | None:
        """Why the controller has drafted little or nothing lately, in words; None while it
        drafts in more than a quarter of the recent rounds (or is not adaptive)."""
        recent = stats.draft_lengths[-window:]
        if self.fixed or not self.sources or len(recent) < 8 or sum(1 for k in recent if k) > len(recent) / 4:
            return None
        why = []
        if "ngram" in self.sources:
            if self.offer_rate < 0.25:
                why.append("n-gram: no copy in sight")
            else:
                why.append(f"n-gram: copies on offer rarely go on (a fresh match continues {self.copy.p(2):.0%} of the time)")
        if "model" in self.sources:
            c1, d = self.cost.verify_cost(1), self._draft_cost("model")
            if not self.model_can_pay(self.draft_max):
                optimistic = [max(OPTIMISTIC_ACCEPTANCE, a) for a in self.acc]
                k = max(
                    range(1, min(8, self.draft_max) + 1),
                    key=lambda j: expected_tokens(optimistic, j) / (self.cost.verify_cost(j + 1) + j * d),
                )
                best = expected_tokens(optimistic, k) * c1 / (self.cost.verify_cost(k + 1) + k * d)
                why.append(
                    f"draft model idle: even at {OPTIMISTIC_ACCEPTANCE:.0%} acceptance its best draft would run {best:.2f}x plain here "
                    f"(verifying {k + 1} tokens costs {self.cost.verify_cost(k + 1) / c1:.1f} plain steps, drafting {k} costs {k * d / c1:.1f})"
                )
            else:
                why.append(
                    f"draft model idle: its drafts are accepted {self.acceptance()[0]:.0%} of the time at the first position, too rarely to pay"
                )
        return "; ".join(why) or None
