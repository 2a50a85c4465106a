"""The adaptive controller on a simulated cost model: its choices follow measured numbers."""

from __future__ import annotations

import numpy as np

from specrun.control import Controller, CostModel, CostStore, expected_tokens

# this CPU, from llama-bench: verify throughput (tok/s) by batch size, target at 30 tok/s
CPU_TPS = {1: 30, 2: 40, 3: 47, 4: 50, 5: 52, 8: 50, 12: 58, 16: 84, 24: 81, 32: 94, 64: 105}
CPU_CURVE = {b: b / tps for b, tps in CPU_TPS.items()}
# a consumer GPU: verifying a few tokens costs about as much as one
GPU_CURVE = {b: 0.020 * (1 + 0.01 * (b - 1)) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}


def simulate(curve, draft_cost, accept, sources=("model",), rounds=400, seed=0, ngram_len=0, continued=False):
    """Drive the controller with a world where every draft position is accepted with
    probability `accept`; return the K it chose in the last half of the rounds."""
    cost = CostModel(dict(curve), draft_per_token=draft_cost)
    ctrl = Controller(list(sources), draft_min=1, draft_max=16, p_split=0.5, fixed=False, cost=cost)
    rng = np.random.default_rng(seed)
    chosen = []
    for i in range(rounds):
        plan = ctrl.plan(ngram_available=ngram_len, ngram_continued=continued, room=1000)
        n = 0
        while n < plan.k and rng.random() < accept:
            n += 1
        d = draft_cost * plan.k if plan.source == "model" else 0.0
        ctrl.observe(plan, plan.k, n, cost.verify_cost(plan.k + 1), d, [0.9] * plan.k, continued)
        if i >= rounds // 2:
            chosen.append((plan.source, plan.k, plan.probe))
    return chosen


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


def test_hybrid_probes_the_ngram_source_now_and_then():
    chosen = simulate(CPU_CURVE, 0.0, accept=0.05, sources=("ngram",), ngram_len=4, rounds=600)
    assert any(probe for _, _, probe in chosen)
    assert sum(1 for _, k, _ in chosen if k) / len(chosen) < 0.1


def test_cheap_accepted_drafts_choose_a_long_draft():
    chosen = simulate(GPU_CURVE, draft_cost=0.002, accept=0.9)
    ks = [k for s, k, probe in chosen if not probe]
    assert np.median(ks) >= 6


def test_a_poor_draft_on_a_gpu_still_drafts_less():
    good = simulate(GPU_CURVE, draft_cost=0.004, accept=0.9)
    poor = simulate(GPU_CURVE, draft_cost=0.004, accept=0.4)
    assert np.median([k for _, k, _ in poor]) < np.median([k for _, k, _ in good])


def test_continued_ngram_runs_use_the_cheap_wide_verify_on_a_cpu():
    # copying text: n-gram guesses cost nothing and are nearly always right; the CPU curve
    # makes 16-token verifies cheap per token, so a long run pays
    chosen = simulate(CPU_CURVE, 0.0, accept=0.97, sources=("ngram",), ngram_len=16, continued=True)
    ks = [k for _, k, probe in chosen if not probe]
    assert np.median(ks) >= 12


def test_fresh_ngram_guesses_that_fail_are_dropped():
    chosen = simulate(CPU_CURVE, 0.0, accept=0.1, sources=("ngram",), ngram_len=8)
    plain = sum(1 for _, k, _ in chosen if k == 0)
    assert plain / len(chosen) > 0.9


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
    store.save("k", CostModel({1: 0.03, 2: 0.05}, 0.01))
    got = store.load("k")
    assert got.verify == {1: 0.03, 2: 0.05} and got.draft_per_token == 0.01
    (tmp_path / "costs.json").write_text("{not json")
    assert store.load("k") is None
