"""Exact speculative sampling reproduces the target distribution (chi-square, fixed seed)."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.decode.sampling import Dist, Sampler, accept_or_resample, greedy_confidence, residual
from specrun.errors import UsageError

# chi-square critical values at alpha = 0.001 (from tables), by degrees of freedom
CHI2_CRIT_001 = {5: 20.515, 7: 24.322, 9: 27.877}


def dist(probs) -> Dist:
    p = np.asarray(probs, dtype=float)
    ids = np.nonzero(p)[0]
    return Dist(ids.astype(np.int64), p[ids] / p.sum())


def chi2(counts: np.ndarray, p: np.ndarray) -> float:
    n = counts.sum()
    expected = n * p
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token with zero target probability was produced"
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


def speculative_draws(p: Dist, q: Dist, n: int, seed: int, vocab: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = np.zeros(vocab, dtype=np.int64)
    for _ in range(n):
        x = q.sample(rng)
        ok, r = accept_or_resample(x, p, q, rng)
        counts[x if ok else r] += 1
    return counts


CASES = {
    # q has zeros where p does not (tokens 0 and 6)
    "q-zeros": ([0.05, 0.3, 0.1, 0.2, 0.05, 0.1, 0.15, 0.05], [0.0, 0.1, 0.4, 0.2, 0.1, 0.2, 0.0, 0.0]),
    # p has zeros where q does not
    "p-zeros": ([0.0, 0.5, 0.2, 0.0, 0.1, 0.1, 0.05, 0.05], [0.3, 0.1, 0.1, 0.3, 0.05, 0.05, 0.05, 0.05]),
    # near-identical
    "close": ([0.1, 0.2, 0.05, 0.15, 0.1, 0.2, 0.1, 0.1], [0.12, 0.18, 0.05, 0.15, 0.1, 0.2, 0.1, 0.1]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_accept_resample_reproduces_target_distribution(case):
    p_raw, q_raw = CASES[case]
    p, q = dist(p_raw), dist(q_raw)
    counts = speculative_draws(p, q, 100_000, seed=1234, vocab=8)
    p_full = np.asarray(p_raw) / np.sum(p_raw)
    df = int(np.count_nonzero(p_full)) - 1
    assert chi2(counts, p_full) < CHI2_CRIT_001[df]


def test_a_draft_row_with_minus_inf_entries():
    """An EAGLE-3 head with its own smaller vocabulary (d2t) leaves -inf in its logits for the
    target tokens it cannot guess: under every sampler they get no probability (and nothing
    turns into NaN), and drafts from such a row still give the target's distribution."""
    row = np.array([2.0, -np.inf, 0.5, -np.inf, 1.0, -1.0, -np.inf, 0.0], np.float32)
    p_full = np.array([0.05, 0.3, 0.1, 0.2, 0.05, 0.1, 0.15, 0.05])  # the target likes what the draft cannot guess
    unfiltered = Sampler(1.5, top_k=0, top_p=1.0, min_p=0.0)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        for s in (Sampler(0.0), unfiltered, Sampler(0.8)):
            q = s.dist(row)
            assert np.isfinite(q.probs).all() and abs(q.probs.sum() - 1) < 1e-9
            assert [q.prob(t) for t in (1, 3, 6)] == [0.0, 0.0, 0.0]
        counts = speculative_draws(dist(p_full), unfiltered.dist(row), 50_000, seed=1234, vocab=8)
    assert chi2(counts, p_full) < CHI2_CRIT_001[7]


def test_the_chi_square_check_catches_a_wrong_sampler():
    """Sanity check of the test itself: always accepting the draft gives q, not p."""
    p_raw, q_raw = CASES["close"]
    p_full, q = np.asarray(p_raw), dist(q_raw)
    rng = np.random.default_rng(1234)
    counts = np.zeros(8, dtype=np.int64)
    for _ in range(100_000):
        counts[q.sample(rng)] += 1
    assert chi2(counts, p_full) > CHI2_CRIT_001[7]


def test_residual_is_normalised_positive_part():
    p = dist([0.5, 0.3, 0.2, 0.0])
    q = dist([0.2, 0.5, 0.0, 0.3])
    r = residual(p, q)
    full = np.zeros(4)
    full[r.ids] = r.probs
    np.testing.assert_allclose(full, np.array([0.3, 0.0, 0.2, 0.0]) / 0.5)


def test_one_hot_draft_is_accepted_with_probability_p():
    p = dist([0.7, 0.2, 0.1])
    rng = np.random.default_rng(7)
    n, hits = 20_000, 0
    for _ in range(n):
        ok, _ = accept_or_resample(0, p, Dist.one_hot(0), rng)
        hits += ok
    assert abs(hits / n - 0.7) < 0.015


def test_sampler_filters_in_llama_cpp_order():
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], dtype=np.float32))
    # top-k 3 keeps 0,1,2; top-p 0.7 then keeps 0,1 (0.4 + 0.3 reaches 0.7 of the untempered mass)
    d = Sampler(temperature=1.0, top_k=3, top_p=0.7, min_p=0.0).dist(logits)
    assert sorted(d.ids.tolist()) == [0, 1]
    np.testing.assert_allclose(sorted(d.probs.tolist()), [0.3 / 0.7, 0.4 / 0.7], rtol=1e-6)
    # min-p 0.3 keeps tokens with p >= 0.3 * 0.4 = 0.12
    d = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3).dist(logits)
    assert sorted(d.ids.tolist()) == [0, 1, 2]
    # temperature sharpens the survivors
    hot = Sampler(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0).dist(logits)
    assert hot.prob(0) > 0.4 * 1.2


def test_greedy_is_argmax():
    s = Sampler(temperature=0)
    assert s.greedy
    d = s.dist(np.array([0.1, 3.0, 2.9]))
    assert d.ids.tolist() == [1] and d.prob(1) == 1.0


@pytest.mark.parametrize("kw", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": -1}, {"top_k": -2}])
def test_bad_sampler_values_are_usage_errors(kw):
    with pytest.raises(UsageError):
        Sampler(**kw)


def test_seed_makes_sampling_reproducible():
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    s = Sampler(temperature=0.8, seed=42)
    a = [s.dist(logits).sample(r) for r in [s.rng()] for _ in range(50)]
    b = [s.dist(logits).sample(r) for r in [s.rng()] for _ in range(50)]
    assert a == b


def _softmax_top(row: np.ndarray) -> float:
    z = row.astype(np.float64) - row.max()
    return float(1.0 / np.exp(z).sum())


@pytest.mark.parametrize(
    "spread",
    [
        3.0,  # a peaked row, as a language model's usually is: a few hundred logits near the top
        0.5,  # a flat one: every logit within the span, nothing left out
        8.0,  # a wide one: most of the vocabulary far below the top
    ],
)
def test_a_draft_tokens_confidence_is_its_softmax_probability(spread):
    """The draft's confidence leaves out logits far below the top one; over a 151,936-token
    vocabulary it stays within 2% of the full softmax (the sources learn by bins 0.1 wide) in
    every shape of row."""
    rng = np.random.default_rng(3)
    row = (rng.standard_normal(151_936) * spread).astype(np.float32)
    row[17] = row.max() + 2.0
    exact = _softmax_top(row)
    got = greedy_confidence(row, 17)
    assert got == pytest.approx(exact, rel=0.02)
    assert got >= exact  # what is left out can only lower the sum


def test_a_confidence_counts_every_near_rival():
    """Two tokens tied at the top, the rest far below: each has half the mass."""
    row = np.full(1000, -50.0, np.float32)
    row[[3, 9]] = 4.0
    assert greedy_confidence(row, 3) == pytest.approx(0.5, rel=1e-6)
