"""Drafters: whatever guesses the next tokens. One small interface, two implementations.

``propose(tokens, k)`` looks at the whole sequence so far (prompt plus output; its last token
is not yet in the target's cache) and returns up to ``k`` guesses with the distribution each
was drawn from (needed for exact sampling). The hybrid choice between them is the
controller's (see ``control.py``), so there is no third class.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .sampling import Dist, Sampler

if TYPE_CHECKING:
    from .backend import Model


@dataclass(frozen=True)
class Proposal:
    """A drafter's guesses, and what the controller learns from them."""

    tokens: list[int] = field(default_factory=list)
    dists: list[Dist] = field(default_factory=list)  # q_i, the law each token was drawn from
    match: int = 0  # n-gram only: how many tokens before the guesses already match the source
    confidences: list[float] = field(default_factory=list)  # model only: the draft's top-token probability per guess
    sync_s: float = 0.0  # model only: of the time spent, what went to catching the draft's cache up (a one-off)
    caught_up: int = 0  # model only: how many tokens that catch-up evaluated

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, k: int) -> Proposal:
        return Proposal(self.tokens[:k], self.dists[:k], self.match, self.confidences[:k], self.sync_s, self.caught_up)


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


class Drafter(Protocol):
    """Whatever guesses the next tokens: up to ``k`` of them after ``tokens``. ``p_split``:
    stop early below this confidence (only a drafter with confidences can)."""

    name: str

    def propose(self, tokens: list[int], k: int, p_split: float = 0.0) -> Proposal: ...


class ModelDrafter:
    """Autoregressive drafts from a small model with the target's vocabulary.

    Its KV cache holds a prefix of the sequence (``model.tokens``); each call first re-syncs
    it with the sequence (rolling back the rejected guesses, evaluating what is new) in one
    batch, then drafts one token per decode. Drafting stops early when the draft's own
    top-token probability falls below ``p_split`` (the controller's choice, passed with each
    call): it is unsure, the target probably disagrees, and a rejected guess costs draft time
    and verify width.
    """

    name = "model"

    def __init__(self, model: Model, sampler: Sampler, rng: np.random.Generator, n_vocab_target: int):
        self.model = model
        self.sampler = sampler
        self.rng = rng
        self.n_vocab = min(model.n_vocab, n_vocab_target)

    def _sync(self, tokens: list[int]) -> tuple[np.ndarray, int]:
        """Make the draft cache hold ``tokens``; return the logits after the last one and how
        many tokens that evaluated."""
        n = common_prefix(self.model.tokens, tokens, limit=len(tokens) - 1)  # keep the last to evaluate
        self.model.rollback(n)
        return self.model.eval_last(tokens[n:]), len(tokens) - n

    def rollback(self, keep: int) -> None:
        """Forget cached positions >= keep (called by the engine's rollback helper)."""
        self.model.rollback(keep)

    def prefill(self, prompt: list[int]) -> None:
        """Make the cache hold ``prompt[:-1]`` (reusing what it already holds of it)."""
        n = common_prefix(self.model.tokens, prompt, limit=len(prompt) - 1)
        self.model.rollback(n)
        if prompt[n:-1]:
            self.model.eval(prompt[n:-1], logits="none")

    def measure_token_cost(self, token: int) -> float:
        """Seconds for one single-token draft decode, measured past the cache, then undone."""
        base = self.model.n_past
        self.model.checkpoint(full=True)  # hybrid/recurrent drafts: each measured decode is undone
        self.model.eval([token], logits="last")  # warm-up: the first decode after a load is slow
        self.model.rollback(base)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            self.model.eval([token], logits="last")
            best = min(best, time.perf_counter() - t)
            self.model.rollback(base)
        return best

    def propose(self, tokens: list[int], k: int, p_split: float = 0.0) -> Proposal:
        room = self.model.n_ctx - len(tokens)
        k = min(k, room)
        if k <= 0:
            return Proposal()
        t = time.perf_counter()
        logits, evaluated = self._sync(tokens)
        self.model.checkpoint(full=True)  # hybrid/recurrent drafts: the drafting decodes below may be undone
        # more than a round's usual one or two tokens: a catch-up, not a per-token cost
        caught_up = evaluated > 2
        out = Proposal(sync_s=time.perf_counter() - t if caught_up else 0.0, caught_up=evaluated if caught_up else 0)
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
            if conf < p_split and i > 0:
                break
            out.tokens.append(x)
            out.dists.append(q)
            out.confidences.append(conf)
            if i + 1 < k:  # the last guess is not evaluated here: the target judges it first
                logits = self.model.eval_last([x])
        return out


class NgramDrafter:
    """Prompt lookup: find the longest recent suffix (n in [n_min, n_max]) that occurred
    earlier in the prompt or output, and propose what followed it. Costs no model time. Of
    the suffix's recent occurrences, the one whose context matches furthest back is copied
    (in an edited file the same line may appear in the source and in what was written).

    Once a copy is under way, the next call continues from the same source span without
    searching, as long as the sequence has kept copying it: in code editing and summarising
    the output copies the input for hundreds of tokens. Each proposal says how long its copy
    already is (``match``): the controller trusts long copies more.

    Edits are learned: when an established copy breaks because the target wrote Y where the
    source has X (a rename, say), the copy goes on past it, and from then on every X in a
    proposal is written as Y. A learned edit that turns out wrong is replaced by what the
    target wrote instead, or dropped.
    """

    name = "ngram"
    MATCH_CAP = 64
    OCCURRENCES = 8  # the latest occurrences of an n-gram kept; the one matching furthest back is copied
    EDIT_MIN_MATCH = 4  # a copy must have matched this many tokens before a break counts as an edit

    def __init__(self, n_min: int = 2, n_max: int = 6):
        if not 1 <= n_min <= n_max:
            raise ValueError("need 1 <= n_min <= n_max")
        self.n_min, self.n_max = n_min, n_max
        self._seen: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions after its latest occurrences
        self._follow: tuple[int, int, int] | None = None  # (sequence length, source position, match) of a copy
        self.edits: dict[int, int] = {}  # source token -> what the target writes instead

    def _update(self, tokens: list[int]) -> None:
        n_old = len(self._seen)
        if tokens[:n_old] != self._seen:  # the sequence was rolled back or replaced: rebuild
            self._seen, self._index, self._follow, n_old = [], {}, None, 0
            self.edits = {}
        # index n-grams that end before the current last token (the suffix itself is the query)
        for end in range(max(n_old, 1), len(tokens)):
            for n in range(self.n_min, self.n_max + 1):
                if end - n >= 0:
                    seen = self._index.setdefault(tuple(tokens[end - n : end]), [])
                    seen.append(end)
                    if len(seen) > self.OCCURRENCES:
                        del seen[0]
        self._seen = list(tokens)

    def _copy(self, tokens: list[int], src: int, k: int, match: int) -> Proposal:
        """Propose the k source tokens from ``src`` on, with the learned edits applied."""
        edits, match = self.edits, min(match, self.MATCH_CAP)
        run = [edits.get(t, t) for t in tokens[src : src + k]] if edits else tokens[src : src + k]
        self._follow = (len(tokens), src, match)
        return Proposal(run, [Dist.one_hot(t) for t in run], match)

    def _continue(self, tokens: list[int], k: int) -> Proposal | None:
        """Go on with the copy under way, learning an edit where it broke. None: no copy."""
        if self._follow is None:
            return None
        seq_end, src, match = self._follow
        grown = len(tokens) - seq_end  # what the last round added: drafts accepted, then one token
        nxt = src + grown
        if grown <= 0 or nxt >= len(tokens):
            return None
        was = [self.edits.get(t, t) for t in tokens[src:nxt]]
        got = tokens[seq_end:]
        if got == was:
            return self._copy(tokens, nxt, k, match + grown)
        if got[:-1] != was[:-1]:  # pragma: no cover - a round only ever differs at its last token
            return None
        source_token, written = tokens[nxt - 1], got[-1]
        if written == source_token:
            self.edits.pop(source_token, None)  # a learned edit was wrong here: the source stands
        elif match + grown - 1 >= self.EDIT_MIN_MATCH:  # the copy had matched this much before the break
            self.edits[source_token] = written
        else:
            self.edits.pop(source_token, None)
            return None
        return self._copy(tokens, nxt, k, 0)  # past the edit; a fresh edit starts with no evidence

    def propose(self, tokens: list[int], k: int, p_split: float = 0.0) -> Proposal:
        """The copy on offer after ``tokens`` (``p_split`` does not apply: a copy has no confidence)."""
        if k <= 0 or len(tokens) < self.n_min + 1:
            return Proposal()
        self._update(tokens)
        # 1. keep copying the span we were following, if the sequence has kept copying it
        out = self._continue(tokens, k)
        if out is not None:
            return out
        # 2. otherwise look the longest suffix up, and count how far back the match goes
        self._follow = None
        end = len(tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if end <= n:
                continue
            best, best_match = None, -1
            for src in reversed(self._index.get(tuple(tokens[end - n :]), ())):  # latest first: it wins ties
                match = n
                while match < self.MATCH_CAP and match < src and tokens[end - 1 - match] == tokens[src - 1 - match]:
                    match += 1
                if match > best_match:
                    best, best_match = src, match
            if best is not None:
                return self._copy(tokens, best, k, best_match)
        return Proposal()
