"""The sampler, and exact speculative (rejection) sampling.

A :class:`Sampler` is a value built once per run. Temperature 0 means argmax. Otherwise the
filters run in llama.cpp's default order, on the untempered distribution: top-k, top-p, min-p;
then the temperature is applied to the survivors. The same filters shape the target's ``p``
and the draft's ``q``, as exact speculative sampling requires.

Exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023), for a draft token ``x``
drawn from ``q``:

* accept ``x`` with probability ``min(1, p(x) / q(x))``;
* on a rejection, draw the replacement from ``norm(max(0, p - q))``;
* after every draft is accepted, draw a bonus token from the next ``p``.

The output then has exactly the target's distribution, whatever ``q`` is. A deterministic
proposal (the n-gram drafter) is the special case ``q = one-hot(x)``.

Several candidates for one position (the children of a node in a token tree), candidate i drawn
from ``q_i`` (which may depend on the candidates before it, not on the test's coins), are tried
in turn (SpecInfer's multi-step speculative sampling, Miao et al. 2024; Sequoia's form without
replacement): accept candidate i with probability ``min(1, p(x_i) / q_i(x_i))``; on a rejection
``p <- norm(max(0, p - q_i))`` and the next candidate is tried against that; if every one is
rejected, the token is drawn from the last ``p``. Each step is the one-candidate rule with the
next steps standing in for its residual draw, so the output again has exactly the target's law.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrun.errors import UsageError


@dataclass(frozen=True)
class Dist:
    """A sparse probability distribution: token ids and their probabilities (summing to 1)."""

    ids: np.ndarray
    probs: np.ndarray

    def prob(self, token: int) -> float:
        hit = np.nonzero(self.ids == token)[0]
        return float(self.probs[hit[0]]) if hit.size else 0.0

    @property
    def top(self) -> tuple[int, float]:
        i = int(np.argmax(self.probs))
        return int(self.ids[i]), float(self.probs[i])

    def sample(self, rng: np.random.Generator) -> int:
        return int(self.ids[_draw(self.probs, rng)])

    @staticmethod
    def one_hot(token: int) -> Dist:
        return Dist(np.array([token], dtype=np.int64), np.array([1.0]))


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    c = np.cumsum(probs)
    return min(int(np.searchsorted(c, rng.random() * c[-1], side="right")), len(probs) - 1)


# logits further than this below the top one are left out of its softmax probability: together
# they weigh at most n_vocab * e^-16 of the top one (1.7% for a 151,936-token vocabulary), far
# inside the 0.1-wide confidence bins the draft sources learn by, and leaving them out skips
# an exp over the whole vocabulary on every draft token (on real logits a few hundred are left)
CONF_SPAN = 16.0


def greedy_confidence(row: np.ndarray, x: int) -> float:
    """The softmax probability of token ``x``, the row's top logit (see CONF_SPAN)."""
    top = row[x]
    near = row[row > top - CONF_SPAN]
    return 1.0 / float(np.exp(near - top).sum())


@dataclass(frozen=True)
class Sampler:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise UsageError(f"{{temperature}} must be >= 0, got {self.temperature}", "use 0 for greedy decoding", "temperature")
        if self.top_k < 0:
            raise UsageError(f"{{top_k}} must be >= 0, got {self.top_k}", "use 0 to disable it", "top_k")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"{{top_p}} must be in (0, 1], got {self.top_p}", "use 1 to disable it", "top_p")
        if not 0 <= self.min_p <= 1:
            raise UsageError(f"{{min_p}} must be in [0, 1], got {self.min_p}", "use 0 to disable it", "min_p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)

    def dist(self, logits: np.ndarray) -> Dist:
        """The filtered, tempered distribution of one row of logits."""
        if self.greedy:
            return Dist.one_hot(int(np.argmax(logits)))
        logits = np.asarray(logits, dtype=np.float32)
        n = logits.shape[0]
        if 0 < self.top_k < n:
            ids = np.argpartition(logits, n - self.top_k)[n - self.top_k :]
        else:
            ids = np.arange(n)
        ids = ids[np.argsort(-logits[ids], kind="stable")]  # descending
        z = logits[ids].astype(np.float64)
        p = np.exp(z - z[0])
        p /= p.sum()
        keep = len(p)
        if self.top_p < 1.0:  # smallest prefix whose mass reaches top_p
            keep = min(keep, int(np.searchsorted(np.cumsum(p), self.top_p, side="left")) + 1)
        if self.min_p > 0:
            keep = min(keep, int(np.count_nonzero(p[:keep] >= self.min_p * p[0])))
        ids, z = ids[: max(keep, 1)], z[: max(keep, 1)]
        t = np.exp((z - z[0]) / self.temperature)
        return Dist(ids.astype(np.int64), t / t.sum())


def residual(p: Dist, q: Dist) -> Dist:
    """norm(max(0, p - q)), the distribution a rejected position is resampled from."""
    ids = np.union1d(p.ids, q.ids)
    pp = np.zeros(len(ids))
    qq = np.zeros(len(ids))
    pp[np.searchsorted(ids, p.ids)] = p.probs
    qq[np.searchsorted(ids, q.ids)] = q.probs
    r = np.maximum(pp - qq, 0.0)
    total = r.sum()
    if total <= 0:  # p == q up to rounding: any draw from p is exact
        return p
    keep = r > 0
    return Dist(ids[keep], r[keep] / total)


def accept_or_resample(x: int, p: Dist, q: Dist, rng: np.random.Generator) -> tuple[bool, int | None]:
    """One position of exact speculative sampling.

    Returns (True, None) if draft token ``x`` is accepted, else (False, replacement).
    """
    px, qx = p.prob(x), q.prob(x)
    # q(x) > 0 because x was drawn from q; if p(x) >= q(x) the draft is always accepted
    if qx > 0 and rng.random() < min(1.0, px / qx):
        return True, None
    return False, residual(p, q).sample(rng)


def accept_among(candidates: list[tuple[int, Dist]], p: Dist, rng: np.random.Generator) -> tuple[int | None, int | None]:
    """One position of exact multi-candidate speculative sampling: ``candidates`` are (token,
    the law it was drawn from), tried in order against the target's law ``p``.

    Returns (i, None) if candidate i is accepted, else (None, the token drawn from the residual).
    With one candidate it draws exactly as :func:`accept_or_resample` does."""
    for i, (x, q) in enumerate(candidates):
        px, qx = p.prob(x), q.prob(x)
        if qx > 0 and rng.random() < min(1.0, px / qx):
            return i, None
        p = residual(p, q)  # what is left of p once q's share has had its chance
    return None, p.sample(rng)
