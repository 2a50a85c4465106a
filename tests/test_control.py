"""The adaptive controller on a simulated cost model: its choices follow measured numbers."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.control import COPY_BINS, Controller, CopyModel, CostModel, CostStore, Learned, expected_tokens

# this CPU, from llama-bench: verify throughput (tok/s) by batch size, target at 30 tok/s
CPU_TPS = {1: 30, 2: 40, 3: 47, 4: 50, 5: 52, 8: 50, 12: 58, 16: 84, 24: 81, 32: 94, 64: 105}
CPU_CURVE = {b: b / tps for b, tps in CPU_TPS.items()}
# a consumer GPU: verifying a few tokens costs about as much as one
GPU_CURVE = {b: 0.020 * (1 + 0.01 * (b - 1)) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}


def simulate(curve, draft_cost, accept, rounds=400, seed=0):
    """Drive the controller with a draft model whose every position is accepted with
    probability `accept`; return the (source, K, probe) it chose in the last half."""
    cost = CostModel(dict(curve), draft_per_token=draft_cost)
    ctrl = Controller(["model"], draft_min=1, draft_max=16, p_split=0.5, fixed=False, cost=cost)
    rng = np.random.default_rng(seed)
    chosen = []
    for i in range(rounds):
        plan = ctrl.plan(room=1000)
        n = 0
        while n < plan.k and rng.random() < accept:
            n += 1
        d = draft_cost * plan.k if plan.source == "model" else 0.0
        ctrl.observe(plan, plan.k, n, cost.verify_cost(plan.k + 1), d, [0.9] * plan.k)
        if i >= rounds // 2:
            chosen.append((plan.source, plan.k, plan.probe))
    return chosen


def simulate_copy(curve, cont, fresh_match=2, tokens=3000, seed=0):
    """A text where a copy, once found (``fresh_match`` tokens long), goes on with
    probability ``cont`` per token. Returns (chosen K per round, tokens per unit of time
    relative to plain decoding)."""
    cost = CostModel(dict(curve))
    ctrl = Controller(["ngram"], draft_min=1, draft_max=32, p_split=0.5, fixed=False, cost=cost)
    rng = np.random.default_rng(seed)
    match, made, spent, ks = fresh_match, 0, 0.0, []
    while made < tokens:
        plan = ctrl.plan(ngram_available=32, ngram_match=match, room=1000)
        run = 0  # how many of the 32 offered tokens the target would write
        while run < 32 and rng.random() < cont:
            run += 1
        offered = [7] * 32
        # the accepted drafts, then the target's own token: the copy's next one, or another
        written = [7] * min(run, plan.k) + ([7] if run > plan.k else [8])
        ctrl.observe(plan, plan.k, min(run, plan.k), cost.verify_cost(plan.k + 1), 0.0)
        ctrl.observe_copy(match, offered, written)
        made += len(written)
        spent += cost.verify_cost(plan.k + 1)
        match = match + len(written) if written[-1] == 7 else fresh_match
        ks.append(plan.k)
    return ks, made / spent * cost.verify_cost(1)


def test_expensive_verify_and_draft_choose_plain_decoding():
    # this CPU: a 0.5B draft costs half the target, 4 tokens verify at 2.4x one
    chosen = simulate(CPU_CURVE, draft_cost=0.5 / 30, accept=0.85)
    # even a 90%-accepted draft could not pay here, so the draft model is never run at all
    assert all(k == 0 for _, k, _ in chosen)


def test_the_draft_model_comes_back_when_costs_change():
    cost = CostModel(dict(CPU_CURVE), draft_per_token=0.5 / 30)
    ctrl = Controller(["ngram", "model"], draft_min=1, draft_max=16, p_split=0.5, fixed=False, cost=cost)
    assert ctrl.plan(room=100).source == "none"
    cost.verify = dict(GPU_CURVE)  # say the user moved the models to a GPU
    cost.draft_per_token = 0.002
    plan = ctrl.plan(room=100)
    assert plan.source == "model" and plan.k >= 3 and plan.p_split < 0.5


def test_cheap_accepted_drafts_choose_a_long_draft():
    chosen = simulate(GPU_CURVE, draft_cost=0.002, accept=0.9)
    ks = [k for s, k, probe in chosen if not probe]
    assert np.median(ks) >= 6


def test_a_poor_draft_on_a_gpu_still_drafts_less():
    good = simulate(GPU_CURVE, draft_cost=0.004, accept=0.9)
    poor = simulate(GPU_CURVE, draft_cost=0.004, accept=0.4)
    assert np.median([k for _, k, _ in poor]) < np.median([k for _, k, _ in good])


def test_long_copies_use_the_cheap_wide_verify_on_a_cpu():
    # copying text: n-gram guesses cost nothing and are nearly always right; the CPU curve
    # makes 16-token verifies cheap per token, so a long run pays
    ks, speed = simulate_copy(CPU_CURVE, cont=0.98)
    assert np.median(ks[len(ks) // 2 :]) >= 12
    assert speed > 1.8


def test_copies_that_break_often_are_not_drafted_on_a_cpu():
    ks, speed = simulate_copy(CPU_CURVE, cont=0.3)
    assert sum(1 for k in ks[len(ks) // 2 :] if k) / (len(ks) // 2) < 0.05
    assert speed > 0.97


def test_copies_are_drafted_on_a_gpu_even_when_they_break_often():
    ks, speed = simulate_copy(GPU_CURVE, cont=0.5)
    assert np.median(ks[len(ks) // 2 :]) >= 1 and speed > 1.3


def test_copy_model_learns_by_copy_length():
    m = CopyModel()
    before_short, before_long = m.p(2), m.p(40)
    assert before_short < before_long  # the prior: a long copy is likelier to go on
    for _ in range(200):
        m.observe(2, [1, 1], [2])  # short copies always break at once
        m.observe(40, [1] * 8, [1] * 8)  # long ones never do
    assert m.p(2) < 0.05 and m.p(40) > 0.95
    assert m.acceptance(2, 3) == [m.p(2), m.p(3), m.p(4)]
    m.observe(3, [5, 6, 7], [5, 9, 7])  # scored up to the first miss only
    assert m.total[m._bin(4)] == 1 and m.total[m._bin(6)] == 0


def _learned_on_code_edits(rate: float = 0.75) -> dict:
    m = CopyModel()
    m.hits, m.total = [rate * 100.0] * len(COPY_BINS), [100.0] * len(COPY_BINS)
    return m.to_json()


def _drafted_rounds(copies: dict, hit: bool, rounds: int = 60) -> list[int]:
    """Rounds of copies offered at match lengths 2, 3, 4, 6, 8 in turn (one bin each), that all
    go on (``hit``) or all break at once; the draft length planned for each."""
    ctrl = Controller(
        ["ngram"], draft_min=1, draft_max=16, p_split=0.0, fixed=False, cost=CostModel(dict(CPU_CURVE)), copy=CopyModel.from_json(copies)
    )
    ks = []
    for i in range(rounds):
        match = (2, 3, 4, 6, 8)[i % 5]
        ks.append(ctrl.plan(ngram_available=8, ngram_match=match, room=100).k)
        ctrl.observe_copy(match, [1] * 8, [1] * 9 if hit else [2])
    return ks


def test_stored_copy_rates_from_other_text_are_dropped_within_a_few_rounds(monkeypatch):
    """A new run on text whose copies break (a summary after code edits) stops trusting every
    bin at once: each bin on its own would need misses of its own first."""
    stored = _learned_on_code_edits()
    with_trust = _drafted_rounds(stored, hit=False)
    monkeypatch.setattr(CopyModel, "trust", lambda self, rate=1.0: 1.0)
    bins_alone = _drafted_rounds(stored, hit=False)
    assert with_trust[0] > 0  # the stored rates are believed at first
    assert sum(k > 0 for k in with_trust) <= 4 < sum(k > 0 for k in bins_alone)
    assert not any(with_trust[10:])


def test_weak_copies_that_go_on_do_not_vouch_for_confident_ones_that_break():
    """A chat answer: two-token matches go on more often than stored, three-token ones (the
    confident bin, the one drafted) break. The weak bin's surplus must not keep the confident
    one trusted: it stops being drafted after a few misses, sooner than its bin learns alone."""
    m = CopyModel()
    m.hits[CopyModel._bin(2)], m.total[CopyModel._bin(2)] = 25.0, 100.0
    m.hits[CopyModel._bin(3)], m.total[CopyModel._bin(3)] = 70.0, 100.0
    # learned in this process, on code edits: each bin holds ~100 observations
    ctrl = Controller(["ngram"], draft_min=1, draft_max=16, p_split=0.0, fixed=False, cost=CostModel(dict(CPU_CURVE)), copy=m)
    drafted = []
    for _ in range(30):
        ctrl.observe_copy(2, [1, 1], [1])  # the weak copy's first token went on (a plain step)
        plan = ctrl.plan(ngram_available=4, ngram_match=3, room=100)
        drafted.append(plan.k)
        ctrl.observe_copy(3, [1] * 4, [2])  # and the confident one broke at once
    assert drafted[0] > 0  # the stored rate is believed at first
    assert sum(k > 0 for k in drafted) <= 3


def test_stored_copy_rates_that_hold_keep_full_trust():
    ks = _drafted_rounds(_learned_on_code_edits(), hit=True)
    assert all(k > 0 for k in ks)
    m = CopyModel.from_json(_learned_on_code_edits())
    for _ in range(50):
        m.observe(4, [1] * 8, [1] * 8)
    assert m.trust() == 1.0


def test_fresh_ngram_guesses_that_fail_are_never_drafted_and_need_no_probe():
    cost = CostModel(dict(CPU_CURVE))
    ctrl = Controller(["ngram"], draft_min=1, draft_max=16, p_split=0.5, fixed=False, cost=cost)
    plans = []
    for _ in range(600):
        plans.append(ctrl.plan(ngram_available=8, ngram_match=2, room=100))
        ctrl.observe_copy(2, [1] * 8, [2])
    assert all(p.k == 0 and not p.probe for p in plans)


def test_fixed_mode_always_drafts_draft_max():
    ctrl = Controller(["ngram", "model"], draft_min=2, draft_max=5, p_split=0.3, fixed=True, cost=CostModel(dict(CPU_CURVE)))
    assert ctrl.plan(ngram_available=0, room=100).source == "model"
    assert ctrl.plan(ngram_available=0, room=100).k == 5
    assert ctrl.plan(ngram_available=3, room=100).source == "ngram"
    assert ctrl.plan(ngram_available=1, room=100).source == "model"  # shorter than draft-min
    assert ctrl.plan(ngram_available=0, room=3).k == 3


def test_expected_tokens_formula():
    assert expected_tokens([0.5, 0.5], 2) == 1 + 0.5 + 0.25
    assert expected_tokens([1.0] * 4, 4) == 5


def test_cost_curve_interpolates_measured_points():
    c = CostModel({1: 1.0, 4: 2.5, 16: 5.0})
    assert c.verify_cost(4) == 2.5
    assert 2.5 < c.verify_cost(8) < 5.0
    assert c.verify_cost(32) == 10.0


def test_cost_store_round_trips_and_survives_damage(tmp_path):
    store = CostStore(tmp_path / "costs.json")
    store.save("k", Learned(CostModel({1: 0.03, 2: 0.05}, 0.01)))
    got = store.load("k").cost
    assert got.verify == {1: 0.03, 2: 0.05} and got.draft_per_token == 0.01
    (tmp_path / "costs.json").write_text("{not json")
    assert store.load("k") is None


def test_the_near_tie_rate_is_per_position_checked():
    # rounds that check five positions and end at a near-tie on the fifth: one position in five
    ctrl = Controller(["ngram"], draft_min=1, draft_max=16, p_split=0.5, fixed=False, cost=CostModel(dict(GPU_CURVE)))
    for _ in range(100):
        ctrl.observe_ties(5, 1)
    assert ctrl.tie_rate == pytest.approx(0.2, abs=0.03)


def test_near_ties_discount_drafts():
    # a copy accepted 70% of the time pays on a GPU-like curve, until a third of the
    # positions turn out to be near-ties that end rounds early (as in prose)
    ctrl = Controller(["ngram"], draft_min=1, draft_max=16, p_split=0.5, fixed=False, cost=CostModel(dict(GPU_CURVE)))
    for _ in range(300):
        ctrl.observe_copy(8, [1, 1, 1, 1], [1, 1, 2])
        ctrl.observe_copy(8, [1, 1, 1, 1], [1, 2])
        ctrl.observe_copy(8, [1, 1, 1, 1], [2])
        ctrl.observe_copy(8, [1, 1, 1, 1], [1, 1, 1, 1])
    assert ctrl.plan(ngram_available=4, ngram_match=8, room=100).k > 0
    for _ in range(200):
        ctrl.observe_ties(1, 1)
    assert ctrl.tie_rate > 0.99
    assert ctrl.plan(ngram_available=4, ngram_match=8, room=100).k == 0
