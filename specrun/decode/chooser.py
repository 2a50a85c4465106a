"""The chooser: every round, the draft source and length with the most expected tokens per second.

For a source whose position j is accepted with chance ``a_j`` (given the positions before it
were), drafting K tokens brings and costs::

    E[tokens | K] = u + sum_{i=1..K} prod_{j<=i} (u a_j)      (u = 1 - near-tie rate, see below)
    T(K)          = c(K + 1) + D(K) + (1 - prod_{j<=K} a_j) r  (c(b): the target's time to verify b
                                                               tokens; D(K): the source's time to
                                                               draft K; r: rolling a rejection back)
    rate(K)       = E[tokens | K] / T(K),    K = 0 (plain decoding) gives 1 / c(1)

and the chooser takes the best (source, K) over every source and K, K = 0 included. ``c`` is a
measured curve (``costs.py``); each source states its own ``a_j`` and ``D`` (``sources/``).

That ratio is the right goal when every round faces the same options. A reply's rounds do not:
an edit's copy breaks where the edit is, and a round with no copy on offer can do far less than
the reply has been doing. A second of such a round is worth what a second of this reply's rounds
has been expected to make (its pace: each round's expected rate at the posterior means, averaged
over their time, so that like is weighed with like, and a draft that ran further than its
numbers said does not set a pace that rules its own source out), so when the pace beats
every option's rate, the round takes the most tokens *beyond* that,
``E[tokens | K] - pace T(K)`` (average reward): a short draft, or a plain step, that gets back to
the copy soon, rather than a long one that pays less a second than the copy will. Where the pace
is below the best rate, both goals pick the same K.

Everything it does not know yet (an idle source, a batch size never verified in this process)
is a posterior, and the choice is made on one *draw* from them (Thompson sampling): what is
uncertain but could pay gets tried, what is known to lose does not, and trying and exploiting
are the same rule. A lesson is only worth its risk if the run can use it, so each draw is pulled
towards the posterior mean by how little of the reply is left (``left / INFO_HORIZON``). Nothing
says where a reply ends, so what is left is taken as no more than what it has run so far, and
never more than its budget: a reply's first tokens and its budget's last act on the means. A
lesson that comes free needs no draw: the n-gram source's copy rates learn from every round,
drafted or not, so it states their means.

Near-ties (greedy with a tie margin, see the engine) end a round early and cost it its last
token; their rate ``1 - u`` is measured on every row checked.

The explanation of an idle stretch (``idle_reason``) reads the same numbers at their means, and
the reply's pace where that is what kept a round plain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from specrun.decode.sources.base import Rate

if TYPE_CHECKING:
    from specrun.decode.costs import CostModel
    from specrun.decode.sources import Source
    from specrun.decode.stats import RunStats


INFO_HORIZON = 64  # a draw counts in full while at least this many tokens are left to use what
# it teaches; fewer, and it is pulled towards the mean (trades: learning early in a reply, against
# paying for lessons it has no time to use)


@dataclass(frozen=True)
class Plan:
    source: str  # a source's name, or "none"
    k: int
    rate: float = 0.0  # what a second of this round is worth, which a source's stop rule weighs each
    # draft against: its expected tokens per second, or the reply's pace where that is higher
    expected: float = 0.0  # its own expected tokens per second, at the posterior means
    offered: int = 0  # what the source offered: one that decides how far as it drafts may go past k, up to there
    verify: tuple[float, ...] = ()  # the verify curve c(1..) it was chosen on (a draw)


@dataclass(frozen=True)
class Option:
    """One source's best draft at the posterior means, for explaining the choice."""

    k: int
    speedup: float  # its rate over plain decoding's
    a1: float  # acceptance at the first position
    verify_steps: float  # c(K + 1) / c(1)
    draft_steps: float  # D(K) / c(1)


def tree_nodes(reach: Sequence[float], trunk: int, worth: float, c: Sequence[float]) -> int:
    """How many of a token tree's nodes beyond its trunk of ``trunk`` drafts (in the tree's
    order) pay at ``worth`` tokens a second. A tree's expected accepted length is the sum over
    its nodes of the chance that the whole path to each is accepted (``reach``, one a node
    beyond the trunk), so each node adds its chance, and costs its row of the verify: m nodes
    add c(trunk + 1 + m) - c(trunk + 1) (drafting them costs nothing: a draft model's runner-up
    comes from rows it drafted from anyway, a copy from the lookup). The m that makes the most
    tokens beyond ``worth`` times its time, as the chooser weighs a chain's length at the
    reply's pace; every m is looked at (a curve with a step in it can make more rows cheaper).
    ``c``: c(1..), taken on beyond its end at its last step's slope."""
    c = list(c)

    def cost(b: int) -> float:
        if b <= len(c):
            return c[b - 1]
        slope = c[-1] - c[-2] if len(c) > 1 else c[-1]
        return c[-1] + (b - len(c)) * slope

    best, best_gain, gained = 0, 0.0, 0.0
    for m in range(1, len(reach) + 1):
        gained += reach[m - 1]
        gain = gained - worth * (cost(trunk + 1 + m) - cost(trunk + 1))
        if gain > best_gain:
            best, best_gain = m, gain
    return best


@dataclass
class Chooser:
    sources: dict[str, Source]
    cost: CostModel
    draft_min: int = 1
    draft_max: int = 32
    fixed: bool = False
    ties: Rate = field(default_factory=Rate)  # near-ties per row checked
    options: dict[str, Option] = field(default_factory=dict)  # the best per source, at the means, of the last round with anything on offer
    pace: float = 0.0  # the reply's pace the last round was weighed against, where it beat every option (else 0)
    pace_seconds: float = 0.0  # seconds this reply's rounds took ...
    pace_tokens: float = 0.0  # ... and the tokens they were expected to make in them

    @property
    def tie_rate(self) -> float:
        return self.ties.mean(0.0)

    def _tokens_and_time(self, acc: np.ndarray, draft: np.ndarray, c: np.ndarray, r: float) -> tuple[np.ndarray, np.ndarray]:
        """E[tokens | K] and T(K) for K = 1..len(acc) (the module's formula); K below
        ``draft_min`` yields nothing."""
        u = 1.0 - self.tie_rate
        total = u + np.cumsum(np.cumprod(acc * u))
        total[: self.draft_min - 1] = -np.inf
        return total, c[1 : len(acc) + 1] + draft + (1.0 - np.cumprod(acc)) * r

    def best(self, acc: np.ndarray, draft: np.ndarray, c: np.ndarray, r: float, drafting: bool = False) -> tuple[int, float]:
        """The K in {0} U [draft_min, len(acc)] with the highest rate, and that rate (K >= 1
        only, if ``drafting``). ``acc``: a_1..a_K; ``draft``: D(1..K); ``c``: c(1..K+1)."""
        total, time = self._tokens_and_time(acc, draft, c, r)
        rates = total / time
        k = int(np.argmax(rates)) + 1 if len(rates) else 0
        if k and (drafting or rates[k - 1] > 1.0 / c[0]):
            return k, float(rates[k - 1])
        return 0, 0.0 if drafting else 1.0 / float(c[0])

    def surplus(self, acc: np.ndarray, draft: np.ndarray, c: np.ndarray, r: float, pace: float) -> tuple[int, float]:
        """The K in [draft_min, len(acc)] that makes the most tokens beyond what its time makes at
        ``pace`` tokens a second, and that surplus (K = 0, a plain step, makes 1 - pace c(1))."""
        total, time = self._tokens_and_time(acc, draft, c, r)
        gains = total - pace * time
        k = int(np.argmax(gains)) + 1 if len(gains) else 0
        return (k, float(gains[k - 1])) if k else (0, -np.inf)

    def begin_reply(self) -> None:
        self.pace_seconds = self.pace_tokens = 0.0

    def observe_round(self, plan: Plan, seconds: float) -> None:
        """A round of ``plan`` took ``seconds`` (drafting, verifying, sampling): the reply's pace
        counts it at the rate it was expected to make, whatever it made."""
        self.pace_seconds += seconds
        self.pace_tokens += (plan.expected or 1.0 / self.cost.verify_cost(1)) * seconds

    @property
    def reply_pace(self) -> float:
        """What this reply's rounds were expected to make a second (0 before its first)."""
        return self.pace_tokens / self.pace_seconds if self.pace_seconds > 0 else 0.0

    def choose(self, caps: dict[str, int], rng: np.random.Generator | None, pace: float | None = None, left: int | None = None) -> Plan:
        """The next round: ``caps`` are what each source can offer this round, ``rng`` draws the
        posteriors (None: act on their means), ``pace`` the tokens a second a round is worth
        (default: the reply's pace), ``left`` the tokens the reply is expected to have left to
        use what this round teaches (None: enough)."""
        pace = self.reply_pace if pace is None else pace
        caps = {s: min(k, self.draft_max) for s, k in caps.items() if k >= max(1, self.draft_min)}
        if not caps:  # no source can offer a token (a budget's or the context's last one): a plain
            return Plan("none", 0)  # step, and the last explanation stands (it was not this round's doing)
        if self.fixed:
            s = next(iter(caps))
            return Plan(s, caps[s])
        n = max(caps.values(), default=0) + 1
        scale = 1.0 if left is None else min(1.0, left / INFO_HORIZON)  # the draw, pulled towards the means
        draw = rng if scale > 0 else None  # (nothing left to learn for: the means, no draw made)
        mean_c, r = self.cost.table(n), self.cost.rollback_s
        c = mean_c + scale * (self.cost.drawn(draw, n) - mean_c)
        plan = Plan("none", 0, 1.0 / c[0])
        self.options = {}
        offers = {}
        for name, cap in caps.items():
            src = self.sources[name]
            draft = _draft_costs(src, cap)
            means = np.array(src.acceptance(cap, None))
            drawn = means if draw is None else means + scale * (np.array(src.acceptance(cap, draw)) - means)
            offers[name] = (drawn, draft, means)
            k, rate = self.best(drawn, draft, c, r)
            if k and rate > plan.rate:
                plan = Plan(name, k, rate, offered=cap, verify=tuple(c))
            km, mrate = self.best(means, draft, mean_c, r, drafting=True)
            self.options[name] = Option(km, mrate * mean_c[0], means[0], mean_c[km] / mean_c[0], draft[km - 1] / mean_c[0])
        self.pace = pace if pace > plan.rate else 0.0
        if self.pace:  # the reply's rounds have made tokens faster than anything on offer now
            plan, best_gain = Plan("none", 0, pace), 1.0 - pace * c[0]
            for name, (drawn, draft, _) in offers.items():
                k, gain = self.surplus(drawn, draft, c, r, pace)
                if k and gain > best_gain:
                    plan, best_gain = Plan(name, k, pace, offered=caps[name], verify=tuple(c)), gain
        # what the round is expected to make a second, at the means (a draw that won the choice is
        # likelier high than low): the reply's pace is built of these
        expected = float(1.0 / mean_c[0])
        if plan.k:
            _, draft, means = offers[plan.source]
            total, time = self._tokens_and_time(means[: plan.k], draft[: plan.k], mean_c, r)
            expected = float(total[-1] / time[-1])
        return dataclasses.replace(plan, expected=expected)

    def rival(self, seq: list[int], sources: list[Source]) -> float:
        """The most tokens a second any of ``sources`` could make, at the means, of a round after
        ``seq`` (which may end in drafts not yet verified); 0 where none can say."""
        top = 0.0
        for src in sources:
            acc = np.array(src.peek(seq, self.draft_max))
            if len(acc):
                top = max(top, self.best(acc, _draft_costs(src, len(acc)), self.cost.table(len(acc) + 1), self.cost.rollback_s, True)[1])
        return top

    def pays(self, src: Source, cap: int) -> bool:
        """Does ``src`` beat plain decoding at the means of its acceptance, its cache caught up?
        (Else a prompt does not wait to bring its cache up: see ``ModelSource.begin``.)"""
        acc = np.array(src.acceptance(cap, None))
        return self.best(acc, _draft_costs(src, len(acc)), self.cost.table(len(acc) + 1), self.cost.rollback_s)[0] > 0

    def observe_ties(self, checked: int, ties: int) -> None:
        """A greedy round checked ``checked`` rows for a near-tie and found ``ties`` (the last
        ones: a near-tie ends the round)."""
        self.ties.decay()
        for i in range(checked):
            self.ties.add(i >= checked - ties)

    def idle_reason(self, stats: RunStats, window: int = 32) -> str | None:
        """Why little or nothing was drafted lately, in words, from the numbers the choice used
        (at their means); None while more than a quarter of the recent rounds draft."""
        recent = stats.draft_lengths[-window:]
        if self.fixed or not self.sources or len(recent) < 8 or sum(1 for k in recent if k) > len(recent) / 4:
            return None
        why = []
        for name in self.sources:
            o = self.options.get(name)
            if o is None:
                why.append(f"{name}: nothing on offer")
            else:
                why.append(
                    f"{name}: its best draft ({o.k} token{'s' if o.k != 1 else ''}, {o.a1:.0%} accepted at the first) would run {o.speedup:.2f}x plain "
                    f"(verifying {o.k + 1} costs {o.verify_steps:.1f} plain steps, drafting {o.k} costs {o.draft_steps:.1f})"
                )
        if self.pace:
            why.append(
                f"this reply's rounds were expected to run {self.pace * self.cost.verify_cost(1):.2f}x plain so far (its pace), faster than any of these, "
                "so each round takes what gains most beyond that pace"
            )
        return "; ".join(why)


def _draft_costs(src: Source, cap: int) -> np.ndarray:
    """D(1..cap): the source's seconds to draft each length this round."""
    return np.zeros(cap) + src.cost(np.arange(1, cap + 1))
