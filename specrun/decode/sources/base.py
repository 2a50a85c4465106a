"""What every draft source is to the chooser: an arm whose acceptance is a posterior.

A source offers up to ``cap`` draft tokens a round, states the chance that each position is
accepted (given the positions before it were), what drafting K tokens costs it, and learns
from every round, drafted by it or not. The chooser (``chooser.py``) compares them all by
expected tokens per second; nothing outside a source's own module names it.

Acceptance is kept as Beta posteriors (``Rate``): decayed counts of hits and misses on top of a
prior. The chooser acts on a *draw* from them (Thompson sampling), so a source that is uncertain
is tried now and then and one that is known to lose is not, with no separate probing rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from specrun.decode.round import Proposal, Round

# The chooser's tuning constants that live with the sources (the others are in chooser.py):
DECAY = 0.99  # evidence fades by this much each round: a source idle for ~100 rounds is uncertain
# again and gets retried (trades: faster to follow a change of text, against noisier estimates)
PRIOR_WEIGHT = 2.0  # a prior counts as this many observations (trades: trying more, against
# drafting on hope in a run's first rounds)
STORED_WEIGHT = 8.0  # what an earlier run stored counts as at most this many observations, so a
# run on other text overrules it within a few rounds (trades: a warm start, against carrying
# another text's rates over); copy rates, which differ more between texts, count as a prior
# (PRIOR_WEIGHT)


class Rate:
    """A Beta posterior over one rate from decayed hits and trials, shrunk towards a prior."""

    __slots__ = ("hits", "n")

    def __init__(self, hits: float = 0.0, n: float = 0.0):
        self.hits, self.n = hits, n

    def mean(self, prior: float) -> float:
        return (self.hits + PRIOR_WEIGHT * prior) / (self.n + PRIOR_WEIGHT)

    def draw(self, prior: float, rng: np.random.Generator) -> float:
        """A draw from the posterior."""
        a = self.hits + PRIOR_WEIGHT * prior
        b = self.n - self.hits + PRIOR_WEIGHT * (1.0 - prior)
        return float(rng.beta(max(a, 1e-3), max(b, 1e-3)))

    def add(self, hit: bool) -> None:
        self.hits += float(hit)
        self.n += 1.0

    def decay(self) -> None:
        self.hits *= DECAY
        self.n *= DECAY

    @classmethod
    def stored(cls, hits: float, n: float, keep: float = STORED_WEIGHT) -> Rate:
        """Counts an earlier run stored, as a prior worth at most ``keep`` observations."""
        f = min(1.0, keep / n) if n > 0 else 0.0
        return cls(hits * f, n * f)


class RateTable:
    """Rates by bin (a draft position, a copy's length): a bin with little data of its own leans
    on the one before it, so good news at position 2 lets position 3 be tried."""

    def __init__(self, n: int, first_prior: float = 0.5):
        self.bins = [Rate() for _ in range(n)]
        self.first_prior = first_prior

    def means(self, k: int | None = None) -> list[float]:
        """The first ``k`` bins' means (all, without ``k``)."""
        out, prior = [], self.first_prior
        for r in self.bins[:k]:
            prior = r.mean(prior)
            out.append(prior)
        return out

    def draws(self, rng: np.random.Generator | None, k: int | None = None) -> list[float]:
        """One draw of each of the first ``k`` bins (the means, without ``rng``). A bin leans on
        the *draw* of the one before it, so a hopeful draw where data ends carries on past it: a
        source that may be good gets tried at length, not one token at a time."""
        if rng is None:
            return self.means(k)
        out, prior = [], self.first_prior
        for r in self.bins[:k]:
            prior = min(1.0, max(0.0, r.draw(prior, rng)))
            out.append(prior)
        return out

    def decay(self) -> None:
        for r in self.bins:
            r.decay()

    def to_json(self) -> dict:
        return {"hits": [round(r.hits, 3) for r in self.bins], "n": [round(r.n, 3) for r in self.bins]}

    def load(self, d: object, keep: float = STORED_WEIGHT) -> None:
        """Take stored counts as a prior worth at most ``keep`` observations per bin; anything
        malformed leaves the table as it is. A table stored with more bins or fewer (a run with
        another draft cap) gives the bins both have: bin j means the same at any length."""
        try:
            assert isinstance(d, dict)
            hits, n = [float(x) for x in d["hits"]], [float(x) for x in d["n"]]
        except (AssertionError, KeyError, TypeError, ValueError):
            return
        if len(hits) != len(n) or not all(0 <= h <= t for h, t in zip(hits, n)):
            return
        k = min(len(hits), len(self.bins))
        self.bins[:k] = [Rate.stored(h, t, keep) for h, t in zip(hits[:k], n[:k])]


class Source(Protocol):
    """A draft source. ``prepare`` is called every round before the choice, ``observe`` after."""

    name: str

    def begin(self, prompt: list[int], may_draft: Callable[[], bool]) -> None:
        """A new prompt (its last token pending); ``may_draft()``: is it expected to beat plain
        decoding, at the means (asked once the source knows its own costs)?"""

    def prepare(self, tokens: list[int], room: int, left: int) -> int:
        """Get ready to draft after ``tokens``; the most tokens it can offer this round (at most
        ``room``; ``left``: the tokens the reply is expected to have left, over which a one-off cost
        is spread)."""

    def acceptance(self, k: int, rng: np.random.Generator | None) -> list[float]:
        """a_1..a_k: the chance each position is accepted given the ones before were (a draw
        from their posteriors; without ``rng``, their means)."""

    def cost(self, k: int | np.ndarray) -> float | np.ndarray:
        """Seconds to draft k >= 1 tokens this round (catching its cache up included); ``k`` may
        be an array of lengths (the chooser prices them all at once): the same shape back, or
        one number that holds for every length."""

    def propose(
        self, tokens: list[int], k: int, worth: float, offered: int = 0, verify: Sequence[float] = (),
        rival: Callable[[list[int]], float] | None = None,
    ) -> Proposal:  # fmt: skip
        """Up to k drafts. A source that sees its confidence decides how far as it drafts, up to
        ``offered`` (what it offered), weighing each further token against ``worth`` tokens a
        second, or against ``rival(sequence)``, the most the other sources could make a second of
        a round from there, where that is more (``verify``: the verify curve c(1..) the round was
        planned on, a draw; none given, its means)."""

    def peek(self, seq: list[int], room: int) -> list[float]:
        """a_1.. of the draft it would offer after ``seq`` (at most ``room`` tokens), found without
        preparing: ``seq`` may end in another source's drafts. [] where it cannot say (a source
        that drafts from a cache of its own)."""

    def observe(self, outcome: Round) -> None:
        """Learn from the round just done."""

    def rollback(self, keep: int) -> None:
        """Forget positions >= keep (a source with a cache keeps it in step with the target)."""

    def to_json(self) -> dict:
        """What to store for the next run."""

    def load(self, d: dict) -> None:
        """Start from what an earlier run stored."""


@runtime_checkable
class Branching(Protocol):
    """A source that can offer a token tree: second candidates beside its chain (``Proposal.parents``)."""

    def branch(self, tokens: list[int], chain: Proposal, nodes: int, branches: int) -> Proposal:
        """``chain`` (what it just proposed after ``tokens``, as verified) with branches added:
        at most ``nodes`` more nodes, and at most ``branches`` root-to-leaf paths in all. The
        chain stays first, as the tree's trunk; each node's law is the one it was drawn from."""
