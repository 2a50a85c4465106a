"""The records of a round, shared by the engine and every source: the ``Proposal`` a source
hands the engine (its guesses, with the law each was drawn from, needed for exact sampling),
and the ``Round`` the engine made of it, which every source observes afterwards; and the
reply's ``Prediction`` and ``History``, which the engine sets and a source drafts from.

A proposal is a chain of guesses, or a tree of them (``Proposal.parents``): each guess follows
its parent guess, or the sequence's pending token (parent -1). A tree's nodes come parents
first, and its first nodes are a chain of their own, the *trunk*: the guesses the source would
have offered as a chain. The rest are branches off it (a draft model's second candidate, another
copy of the context), all verified in one decode (see the engine)."""

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
    # a tree: the node each guess follows (-1: the pending token; always an earlier node); empty:
    # a chain, guess i following guess i - 1
    parents: list[int] = field(default_factory=list)
    # a tree: each node's chance, by the source's estimate, that the whole path to it is accepted
    # (what the chooser prices its nodes by; empty: not stated)
    reach: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, k: int) -> Proposal:
        """The first ``k`` guesses (of a tree: still a tree, parents come first)."""
        return replace(
            self,
            tokens=self.tokens[:k],
            dists=self.dists[:k],
            confidences=self.confidences[:k],
            parents=self.parents[:k],
            reach=self.reach[:k],
        )

    def chain(self) -> Proposal:
        """The trunk alone, as a chain."""
        return replace(self.cut(self.trunk), parents=[], reach=[])

    @property
    def is_tree(self) -> bool:
        return bool(self.parents)

    def parent(self, i: int) -> int:
        return self.parents[i] if self.parents else i - 1

    def children(self) -> dict[int, list[int]]:
        """Each node's children, in order (-1: the pending token's)."""
        out: dict[int, list[int]] = {-1: []}
        for i in range(len(self.tokens)):
            out.setdefault(i, [])
            out[self.parent(i)].append(i)
        return out

    @property
    def trunk(self) -> int:
        """How many of the first nodes form a chain from the pending token (all, for a chain)."""
        return next((i for i in range(len(self.tokens)) if self.parent(i) != i - 1), len(self.tokens))

    @property
    def depth(self) -> int:
        """The longest path from the pending token, in drafts: the positions it proposes (a
        chain's length; a tree's nodes sit side by side at them)."""
        depth: list[int] = []
        for i in range(len(self.tokens)):  # a parent comes before its children
            depth.append(1 + (depth[self.parent(i)] if self.parent(i) >= 0 else 0))
        return max(depth, default=0)

    def path(self, node: int) -> list[int]:
        """The nodes from the pending token's first child down to ``node`` (none for -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parent(node)
        return out[::-1]

    def grow(self, path: Sequence[int], dists: Sequence[Dist], confidences: Sequence[float] = (), most: int | None = None) -> Proposal:
        """This proposal as a tree with ``path`` (tokens after the pending one) in it: the path
        follows the nodes that already hold its tokens, and the rest becomes a new branch (at most
        ``most`` new nodes). ``dists[j]`` and ``confidences[j]`` belong to ``path[j]``."""
        kids = self.children()
        tokens, ds, cs = list(self.tokens), list(self.dists), list(self.confidences)
        parents = list(self.parents) if self.parents else list(range(-1, len(tokens) - 1))
        node, j = -1, 0
        while j < len(path):
            same = next((c for c in kids.get(node, []) if tokens[c] == path[j]), None)
            if same is None:
                break
            node, j = same, j + 1
        room = len(path) - j if most is None else min(most, len(path) - j)
        for t in range(j, j + room):
            tokens.append(path[t])
            ds.append(dists[t])
            if cs:  # a source that states confidences states one for every node
                cs.append(confidences[t] if t < len(confidences) else 0.0)
            parents.append(node)
            node = len(tokens) - 1
        return replace(self, tokens=tokens, dists=ds, confidences=cs, parents=parents) if room else self


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
    path: tuple[int, ...] = ()  # a tree's: the nodes accepted, in order (a chain's are its first ``accepted``)

    @property
    def on_trunk(self) -> int:
        """How many of the proposal's trunk (its chain, for a chain) were accepted: what a source
        that drafted the trunk learns from, and what its cache may keep."""
        if not self.proposal.is_tree:
            return self.accepted
        return next((j for j, node in enumerate(self.path) if node != j), len(self.path))


@dataclass
class Prediction:
    """The reply's expected text as tokens (OpenAI's Predicted Outputs), set by the engine before
    each reply (empty: none), and how much of it the reply followed, counted by the source that
    drafts from it: each prediction token the target wrote where the prediction had it, once."""

    tokens: tuple[int, ...] = ()
    followed: int = 0


class Continuations(Protocol):
    """What earlier texts went on with after a sequence's tail (an index of earlier replies)."""

    def continuation(self, tail: Sequence[int], most: int) -> tuple[list[int], list[tuple[int, int]], int]:
        """Up to ``most`` tokens, and for each: how many of the places seen went on with it, of
        how many that reached it; and how far back those places match the tail (0: none)."""
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
