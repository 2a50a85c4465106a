"""The records of a round, shared by the engine and every source: the ``Proposal`` a source
hands the engine (its guesses, with the law each was drawn from, needed for exact sampling),
and the ``Round`` the engine made of it, which every source observes afterwards; and the
reply's ``Prediction`` and ``History``, which the engine sets and a source drafts from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from specrun.decode.sampling import Dist

if TYPE_CHECKING:
    from specrun.decode.stats import RoundStats


@dataclass(frozen=True)
class Proposal:
    """A drafter's guesses, and what the chooser learns from them."""

    tokens: list[int] = field(default_factory=list)
    dists: list[Dist] = field(default_factory=list)  # q_i, the law each token was drawn from
    match: int = 0  # n-gram only: how many tokens before the guesses already match the source
    start: int = 0  # n-gram only: where in the source the guesses are copied from
    confidences: list[float] = field(default_factory=list)  # model only: the draft's top-token probability per guess
    sync_s: float = 0.0  # model only: of the time spent, what went to catching the draft's cache up (a one-off)
    caught_up: int = 0  # model only: how many tokens that catch-up evaluated
    first_s: float = 0.0  # token by token drafting: seconds to the first draft, the catch-up left out
    step_s: float = 0.0  # ... and per draft after it (0: no second draft)

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, k: int) -> Proposal:
        return replace(self, tokens=self.tokens[:k], dists=self.dists[:k], confidences=self.confidences[:k])


@dataclass(frozen=True)
class Round:
    """What one round did: the tokens it adds and how it got them. The engine yields it and
    every source observes it (drafted by that source or not)."""

    source: str  # who drafted ("none": a plain step)
    proposal: Proposal  # the drafts that were verified (already cut to the plan's K)
    accepted: int  # how many of them the target kept, a prefix of ``proposal``
    emitted: list[int]  # the tokens to append: ``accepted`` drafts, then (unless deferred) one of the target's own
    deferred: bool  # greedy: the position after the accepted drafts was a near-tie, left to a plain round
    stats: RoundStats


@dataclass
class Prediction:
    """The reply's expected text as tokens (OpenAI's Predicted Outputs), set by the engine before
    each reply (empty: none), and how much of it the reply followed, counted by the source that
    drafts from it: each prediction token the target wrote where the prediction had it, once."""

    tokens: tuple[int, ...] = ()
    followed: int = 0


class Continuations(Protocol):
    """What earlier texts went on with after a sequence's tail (an index of earlier replies)."""

    def continuation(self, tail: Sequence[int], most: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Up to ``most`` tokens, and for each: how many of the places seen went on with it, of
        how many that reached it."""
        ...


@dataclass
class History:
    """Earlier replies to draft from for this reply (None: none), set by the engine before each:
    the tenant's own, and a corpus every tenant shares (the operator's files)."""

    index: Continuations | None = None
    corpus: Continuations | None = None


def common_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of a and b (at most ``limit``)."""
    n = min(len(a), len(b))
    if limit is not None:
        n = min(n, limit)
    if a[:n] == b[:n]:
        return max(n, 0)
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
