"""Costs that know when they were disturbed, heal online, and persist with what was learned."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from specrun.cli.display import costs_table
from specrun.decode.costs import CALIBRATION_SIZES, CostModel, calibrate
from specrun.decode.engine import Engine, Settings
from specrun.decode.learned import CostStore, Learned
from specrun.decode.sampling import Sampler
from specrun.decode.sources.base import PRIOR_WEIGHT
from specrun.decode.sources.ngram import NgramSource, copy_bin
from specrun.llama import LoadOptions, Model
from specrun.run.stream import stream_generate

SPECRUN = Path(sys.executable).parent / "specrun"
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)
# a CPU-like curve in units of one token: c(b) / c(1)
CPU = {1: 1.0, 2: 1.5, 3: 1.9, 4: 2.4, 5: 2.7, 6: 3.0, 7: 3.4, 8: 4.0, 12: 5.0, 16: 5.7, 24: 8.0, 32: 10.2}


# --- calibration ---------------------------------------------------------------------------------


def test_a_quiet_calibration_is_stored(tmp_path):
    cost = calibrate(lambda b: 0.01 * CPU[b], SIZES)
    assert not cost.provisional and cost.measured["disturbed"] is None
    store = CostStore(tmp_path / "costs.json")
    store.save("k", Learned(cost))
    assert store.load("k").cost.verify == pytest.approx({b: 0.01 * v for b, v in CPU.items()})


def test_a_gpu_whose_decodes_cost_more_after_a_change_of_shape_calibrates_quietly():
    """On a GPU a decode costs more the first time its batch shape is seen, more again (1.3-2x)
    right after a decode of another shape, and settles once a shape repeats (as the H200 did).
    A verify follows a decode of another size, as in a run, so that is what its size is timed
    at; plain decoding repeats one shape, so c(1) is the settled one. Timing a size's repeats
    in a row mixed the three, flagged a quiet GPU as busy and stored nothing."""
    settled = {1: 2.6e-3} | {b: 3.3e-3 + 2e-5 * b for b in SIZES[1:]}
    seen: set[int] = set()
    last = [0]

    def gpu(b: int) -> float:
        t = settled[b] * (4.0 if b not in seen else 1.7 if b != last[0] else 1.0)
        seen.add(b)
        last[0] = b
        return t

    cost = calibrate(gpu, SIZES)
    assert not cost.provisional, cost.measured["disturbed"]
    assert cost.verify[1] == pytest.approx(settled[1])
    assert all(cost.verify[b] == pytest.approx(1.7 * settled[b]) for b in SIZES[1:])


def test_times_that_jump_mark_a_calibration_disturbed_and_it_is_not_stored(tmp_path):
    calls = []

    def jumpy(b: int) -> float:  # another process starts halfway through: everything slows 3x
        calls.append(b)
        return 0.01 * CPU[b] * (3.0 if len(calls) > 20 else 1.0)

    cost = calibrate(jumpy, SIZES)
    assert cost.provisional and "one token took" in cost.measured["disturbed"]
    store = CostStore(tmp_path / "costs.json")
    store.save("k", Learned(cost, {"ngram": NgramSource().to_json()}, 0.1))
    got = store.load("k")
    assert got.cost.verify == {} and got.tie_rate == 0.1  # what else was learned is kept


def test_a_disturbed_calibration_keeps_the_curve_stored_before(tmp_path):
    store = CostStore(tmp_path / "costs.json")
    store.save("k", Learned(calibrate(lambda b: 0.01 * CPU[b], SIZES)))
    busy = calibrate(lambda b: 0.01 * CPU[b], SIZES, others=lambda: 1.5)  # other processes kept 1.5 cores busy
    assert busy.provisional and "other processes" in busy.measured["disturbed"]
    store.save("k", Learned(busy))
    assert store.load("k").cost.verify[32] == pytest.approx(0.01 * CPU[32])


def test_a_run_on_a_disturbed_calibration_still_works(tiny):
    calls = []

    def jumpy(b: int) -> float:
        calls.append(b)
        return 0.001 * (1 + 0.01 * b) * (1 if len(calls) % 7 else 5)

    cost = calibrate(jumpy, SIZES)
    assert cost.provisional
    with Model(tiny["target"], LoadOptions(n_ctx=512, n_threads=2)) as t:
        e = Engine(t, None, Settings("ngram"), Sampler(0.0), cost)
        events = list(stream_generate(e, t.tokenize("The quick brown fox. The quick brown fox"), 24))
    assert events[-1].finish_reason in ("length", "stop") and events[-1].stats.n_generated > 0


def test_calibration_measures_the_kernels_gap_and_the_near_tie_guard_follows_it(tiny, tmp_path):
    """Each calibration batch's first row is the position the one-token decode saw: their largest
    difference is the gap between llama.cpp's batched and one-token kernels, and the default
    near-tie guard is TIE_SAFETY times it (at most TIE_MARGIN); a margin that is set wins, and the
    gap is stored with the curve."""
    from specrun.decode.engine import TIE_MARGIN, TIE_SAFETY

    with Model(tiny["target"], LoadOptions(n_ctx=512, n_threads=2)) as t:
        e = Engine(t, None, Settings("ngram", draft_max=8), Sampler(0.0), CostModel())
        e.prefill(t.tokenize("The quick brown fox jumps over the lazy dog."))
        assert e.tie_margin == TIE_MARGIN  # nothing measured yet: the guard for quantized CPU kernels
        base, pad = t.n_past, e.tokens[-1]
        e.calibrate()
        gap = e.cost.kernel_gap
        assert gap is not None and gap >= 0
        one = np.array(t.eval([pad], logits="all")[0])  # an independent look at one batch size
        t.rollback(base)
        two = np.array(t.eval([pad, pad], logits="all")[0])
        t.rollback(base)
        assert gap >= float(np.max(np.abs(two - one)))
        assert e.tie_margin == pytest.approx(min(TIE_MARGIN, TIE_SAFETY * gap))
        assert Engine(t, None, Settings("ngram", tie_margin=0.25), Sampler(0.0), e.cost).tie_margin == 0.25
    # stored with the curve; a tiny model's timings can mark its calibration disturbed
    # (provisional, never stored), which is not what this checks
    e.cost.provisional = False
    store = CostStore(tmp_path / "costs.json")
    store.save("k", Learned(e.cost))
    assert store.load("k").cost.kernel_gap == pytest.approx(gap)


# --- healing -------------------------------------------------------------------------------------


def test_unverified_sizes_move_with_the_verified_ones():
    cost = CostModel({b: v * 8 if b >= 6 else v for b, v in CPU.items()})  # every size >= 6 stored 8x too dear
    for _ in range(3):
        cost.observe_verify(1, 1.0)
        cost.observe_verify(16, CPU[16])  # one size in use shows the truth
    assert cost.verify_cost(16) == pytest.approx(CPU[16], rel=0.15)
    assert cost.verify_cost(24) == pytest.approx(CPU[24], rel=0.15)  # never verified: moved with 16
    assert cost.verify_cost(32) == pytest.approx(CPU[32], rel=0.15)


def test_an_estimate_is_the_mean_of_its_rounds_either_way_and_an_outlier_moves_it_a_bounded_step():
    cost = CostModel(dict(CPU))
    cost.observe_verify(8, 100.0)  # a page fault on the first round of 8: bounded, not 25x
    assert CPU[8] < cost.verify_cost(8) < 5 * CPU[8]
    for stored in (CostModel({b: 2 * v for b, v in CPU.items()}), CostModel({b: v / 2 for b, v in CPU.items()})):
        # a stored curve too cheap (calibrated on a quicker day) heals as fast as one too dear
        stored.observe_verify(8, CPU[8])
        assert stored.verify_cost(8) == pytest.approx(CPU[8])  # the first round in this process replaces the stored value
    cost = CostModel(dict(CPU))
    for t in (5.0, 3.0, 5.0, 3.0):
        cost.observe_verify(8, t)
    assert cost.verify_cost(8) == pytest.approx(4.0)  # the mean of its rounds, not the quickest
    cost.observe_verify(8, 1000.0)
    assert cost.verify_cost(8) < 2.0 * 4.0  # a later outlier: at most a factor of two, weighted


def test_a_cost_draw_stays_between_a_smaller_verified_batch_and_b_single_steps():
    cost = CostModel({b: v * 8 if b >= 6 else v for b, v in CPU.items()})  # stored far too dear, up to 32
    for _ in range(3):
        cost.observe_verify(4, CPU[4])
    assert cost.verify_cost(48) == pytest.approx(48.0)  # never dearer than 48 single steps
    rng = np.random.default_rng(0)
    draws = np.array([cost.drawn(rng, 48) for _ in range(500)])
    assert draws[:, 47].min() >= CPU[4] and draws[:, 47].max() <= 48.0
    assert np.mean(draws[:, 47] < 24) > 0.1  # longer than anything measured: now and then as cheap as it may be
    assert cost.drawn(None, 48)[47] == cost.verify_cost(48)  # without a random stream: the estimate
    sure = [cost.drawn(rng, 48)[3] for _ in range(200)]  # verified in this process: nearly certain
    assert np.std(sure) < 0.3 * np.std(draws[:, 47])


def test_how_surely_a_size_is_drawn_follows_what_measured_it():
    """A new process starts from a stored curve (sizes up to 32) and verifies a few sizes: a size
    between them is interpolated from them, so it is drawn about as surely as they are; one the
    stored curve measured is doubted as one round of it; one longer than anything measured
    (48) is as uncertain as a guess. So a draw seldom prices a stored size far from what it was
    measured at, and tries what nothing measured now and then."""
    cost = CostModel(dict(CPU))
    for _ in range(4):
        cost.observe_verify(1, CPU[1])
        cost.observe_verify(12, CPU[12])
    rng = np.random.default_rng(0)
    draws = np.array([cost.drawn(rng, 48) for _ in range(400)])
    log_sd = np.log(draws).std(axis=0)
    assert log_sd[7] < 2 * log_sd[11]  # c(8), between 1 and 12, about as sure as c(12) itself
    assert log_sd[11] < log_sd[19] < 0.5 * log_sd[47]  # c(20), stored, less sure; c(48), never measured, far less


def test_how_far_one_round_strays_is_measured_and_kept_for_the_next_run():
    """The calibration's repeats measure it, each process's rounds refine it, and the next run
    starts from it as a few rounds' worth, so a machine that grew noisier soon says so."""
    rng = np.random.default_rng(0)
    quiet = calibrate(lambda b: 1e-3 * CPU[b] * float(np.exp(0.02 * rng.standard_normal())), SIZES)
    assert not quiet.provisional and quiet.round_noise < 0.08  # the prior alone says 0.2
    cost = CostModel()
    cost.adopt(quiet)
    for _ in range(20):
        cost.observe_verify(8, 1e-3 * CPU[8] * float(np.exp(0.02 * rng.standard_normal())))
    assert cost.round_noise < 0.06
    later = CostModel.from_json(json.loads(json.dumps(cost.to_json())))
    assert later.round_noise == pytest.approx(cost.round_noise, rel=0.01)
    for _ in range(10):  # a busier day
        later.observe_verify(8, 1e-3 * CPU[8] * float(np.exp(0.3 * rng.standard_normal())))
    assert later.round_noise > 0.15
    shown = Console(width=200, record=True)
    shown.print(costs_table(Path("costs.json"), {"pair": {"cost": later.to_json()}}))
    assert f"about {100 * np.expm1(later.round_noise):.0f}%" in shown.export_text()


def cycling_prompt(t: Model) -> list[int]:
    """Token ids after which the tiny target's greedy output repeats itself forever: its own
    output from a seed prompt, once that has fallen into a cycle (found, not assumed)."""
    seed = t.tokenize("-> for")
    t.reset()
    logits, out = t.eval(seed, logits="last"), []
    while len(out) < 600:
        out.append(int(np.argmax(logits[-1])))
        logits = t.eval([out[-1]], logits="last")
    t.reset()
    tail = out[-120:]
    period = next((q for q in range(1, 60) if tail[q:] == tail[:-q]), None)
    assert period, "the tiny target's output from '-> for' no longer cycles: pick another seed prompt"
    return seed + out[: len(out) - 60]


def test_healing_through_the_engine_on_the_tiny_models(tiny, tmp_path):
    """An inflated stored curve (every size >= 6 at 8x): within one copy-friendly run the
    chooser drafts at least as long as it does on a fresh curve, and the entry is corrected."""
    with Model(tiny["target"], LoadOptions(n_ctx=1024, n_threads=2)) as t:
        prompt = cycling_prompt(t)

        def run(cost: CostModel):
            e = Engine(t, None, Settings("ngram", draft_max=16), Sampler(0.0), cost)
            e.reset()
            e.prefill(prompt)
            if not cost.verify:
                e.calibrate()
            stats = list(stream_generate(e, prompt, 160))[-1].stats
            return e, stats

        fresh_engine, fresh = run(CostModel())
        truth = fresh_engine.cost.curve()
        store = CostStore(tmp_path / "costs.json")
        store.save("pair", Learned(CostModel({b: v * 8 if b >= 6 else v for b, v in truth.items()})))
        poisoned = store.load("pair").cost
        assert poisoned.verify_cost(16) == pytest.approx(min(8 * truth[16], 16 * truth[1]))  # (never dearer than 16 steps)
        engine, stats = run(poisoned)
        # (how far it drafts depends on sub-millisecond timings of the tiny models, too noisy to
        # assert on; test_chooser's test_a_poisoned_curve_heals_within_a_long_run checks that, timing-free)
        assert stats.n_generated > 0
        store.save("pair", engine.learned())
        healed = store.load("pair").cost.verify
        assert healed != {b: v * 8 if b >= 6 else v for b, v in truth.items()}  # the entry was rewritten from the run
        assert set(healed) >= set(engine.cost.seen)  # with every size the run measured


# --- persistence ---------------------------------------------------------------------------------


def test_what_the_sources_learned_round_trips_as_a_prior_and_damage_is_a_cold_start(tmp_path):
    s = NgramSource()
    for _ in range(200):
        s.copy.bins[copy_bin(32)].add(True)
    store = CostStore(tmp_path / "costs.json")
    store.save("k", Learned(CostModel(dict(CPU)), {"ngram": s.to_json()}, 0.2))
    back = NgramSource()
    back.load(store.load("k").sources["ngram"])
    (taught, _), (untaught, _) = back.kinds  # the reply joined the first kind (both foretold it alike)
    assert taught.bins[copy_bin(32)].n == pytest.approx(PRIOR_WEIGHT)  # a prior, not the whole story
    assert all(r.n == 0 for r in untaught.bins)
    assert s.copy.bins[copy_bin(32)].n > 3 * PRIOR_WEIGHT
    assert NgramSource().rates()[0][copy_bin(32)] + 0.2 < back.rates()[0][copy_bin(32)] <= s.rates()[0][copy_bin(32)]
    older = {"bins": s.to_json()["bins"], **s.copy.to_json(), "line": [3.0, 4.0]}  # an older specrun's pooled rates
    fresh = NgramSource()
    fresh.load(older)
    assert fresh.rates()[0] == back.rates()[0] and fresh.kinds[0][1].n == pytest.approx(PRIOR_WEIGHT)
    kinds = s.to_json()["kinds"]
    for bad in (
        {"bins": [1, 2]},
        {"bins": "x"},
        {},
        {"bins": s.to_json()["bins"], "hits": [5.0] * 12, "n": [1.0] * 12},
        {"bins": s.to_json()["bins"], "kinds": [{"hits": [5.0] * 12, "n": [1.0] * 12, "line": [5.0, 1.0]}, "x"]},
        {"bins": s.to_json()["bins"], "kinds": "x", "hits": [1.0], "n": []},
    ):
        fresh = NgramSource()
        fresh.load(bad)
        assert all(r.n == 0 for table, line in fresh.kinds for r in [*table.bins, line])
    assert len(kinds) == 2 and kinds[1]["n"] == [0.0] * 12
    (tmp_path / "costs.json").write_text('{"version": 2, "entries": {"k": {}}}')  # an older specrun's file
    assert store.load("k") is None


def cli(args, cache, tmp_path):
    env = {"SPECRUN_CACHE_DIR": str(cache), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    return subprocess.run([str(SPECRUN), *args], capture_output=True, text=True, timeout=120, env=env)


def test_a_second_process_starts_with_the_first_ones_statistics(tiny, tmp_path):
    cache = tmp_path / "cache"
    args = ["generate", "-m", str(tiny["target"]), "-t", "1", "--draft", "ngram", "-n", "48", "-p", "one two three one two three one two"]
    first = cli(args, cache, tmp_path)
    assert first.returncode == 0, first.stderr
    stored = CostStore(cache / "costs.json").entries()
    ((key, entry),) = stored.items()
    assert (
        sum(sum(k["n"]) for k in entry["sources"]["ngram"]["kinds"]) > 0
    )  # (its curve is stored too, unless the machine was busy: see above)
    # a second process on the same pair: open_engine starts from those statistics
    from specrun.run.session import PairConfig, open_engine, open_pair

    pair = open_pair(tiny["target"], None, PairConfig(n_ctx=4096, threads=1))
    try:
        assert pair.cost_key == key
        e = open_engine(pair, Settings("ngram"), Sampler(0.0), CostStore(cache / "costs.json"))
        ngram = e.sources["ngram"]
        for (table, _), k in zip(ngram.kinds, entry["sources"]["ngram"]["kinds"]):
            assert [r.n for r in table.bins] == pytest.approx([min(t, PRIOR_WEIGHT) for t in k["n"]])
        assert ngram.rates() != NgramSource().rates()
    finally:
        pair.close()


def test_a_draft_step_stored_on_a_busy_day_is_timed_again_at_the_first_prompt_where_drafting_happens(tiny, tmp_path):
    """A stored draft cost is only a prior: one from a busy day would price the draft model out,
    and a draft never tried is never timed again. The first prompt in a process times the step
    afresh, past the prompt's first tokens (a step into a nearly empty cache is far slower), but
    not past the whole of a long prompt, which the draft model need not hold before the first
    token; what was stored with it (a round's first draft, a catch-up) moves by the same factor."""
    from specrun.run.session import PairConfig, open_engine, open_pair

    store = CostStore(tmp_path / "costs.json")
    busy = {"per_token": 10.0, "first_s": 30.0, "catch_up_per_token": 5.0}  # seconds: no tiny draft is this slow
    pair = open_pair(tiny["target"], tiny["draft-small"], PairConfig(n_ctx=1024, threads=1))
    try:
        store.save(pair.cost_key, Learned(CostModel({b: 0.05 for b in SIZES}), {"model": busy}))
        engine = open_engine(pair, Settings("model"), Sampler(0.0), store)
        src = engine.sources["model"]
        cached_at_timing = []
        measure = src.measure_token_cost
        src.measure_token_cost = lambda token: cached_at_timing.append(src.model.n_past) or measure(token)
        prompt = pair.target.tokenize("the quick brown fox jumps over the lazy dog " * 4)
        for _ in range(2):
            engine.prefill(prompt)
        assert src.per_token < 1.0  # timed now, not the stored 10 s
        assert src.first_s == pytest.approx(3 * src.per_token) and src.catch_up_per_token == pytest.approx(src.per_token / 2)
        assert len(prompt) - 1 > CALIBRATION_SIZES[-1]
        assert cached_at_timing == [CALIBRATION_SIZES[-1]]  # once in the process, past as much of the prompt
    finally:
        pair.close()


def test_a_draft_step_is_timed_once_a_process_not_once_an_engine(tiny, tmp_path):
    """A server's slots and every request's settings each have an engine, all drafting from the
    same draft model: the first to see a prompt times its step, and the others take that time
    rather than making their own first request wait to time it again."""
    from specrun.run.session import PairConfig, open_engine, open_pair

    store = CostStore(tmp_path / "costs.json")
    pair = open_pair(tiny["target"], tiny["draft-small"], PairConfig(n_ctx=1024, threads=1))
    try:
        first, second = (open_engine(pair, Settings("model"), Sampler(0.0), store) for _ in range(2))
        assert first.sources["model"] is not second.sources["model"]
        timings: list[int] = []
        for engine in (first, second):
            src = engine.sources["model"]
            measure = src.measure_token_cost
            src.measure_token_cost = lambda token, measure=measure: timings.append(token) or measure(token)
        prompt = pair.target.tokenize("the quick brown fox jumps over the lazy dog " * 4)
        first.prefill(prompt)
        pair.draft.reset()
        second.prefill(prompt)
        assert len(timings) == 1
        assert second.sources["model"].per_token == first.sources["model"].per_token
    finally:
        pair.close()


def test_a_warmed_up_engine_times_nothing_at_its_first_prompt_and_holds_nothing_after_it(tiny, tmp_path):
    """A server warms its engine up before it listens: the draft step is timed then, and the
    first client's prompt finds empty caches and waits for no timing."""
    from specrun.run.session import PairConfig, open_engine, open_pair

    pair = open_pair(tiny["target"], tiny["draft-small"], PairConfig(n_ctx=1024, threads=1))
    try:
        engine = open_engine(pair, Settings("model"), Sampler(0.0), CostStore(tmp_path / "costs.json"))
        src = engine.sources["model"]
        timings: list[int] = []
        measure = src.measure_token_cost
        src.measure_token_cost = lambda token: timings.append(token) or measure(token)
        engine.warm_up(pair.target.tokenize("def f(x):\n    return x + 1\n" * 8))
        assert len(timings) == 1
        assert pair.target.n_past == pair.draft.n_past == 0 and engine.tokens == []
        prompt = pair.target.tokenize("the quick brown fox jumps over the lazy dog " * 4)
        engine.prefill(prompt)
        assert len(timings) == 1 and src.per_token is not None
        assert pair.target.tokens == prompt[:-1]
    finally:
        pair.close()


def test_a_corrupted_store_is_a_cold_start_with_no_error(tiny, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "costs.json").write_bytes(b"\x00\xff{{ not json")
    p = cli(["generate", "-m", str(tiny["target"]), "-t", "1", "--draft", "ngram", "-n", "8", "-p", "hello hello"], cache, tmp_path)
    assert p.returncode == 0 and "error" not in p.stderr.lower(), p.stderr
    assert CostStore(cache / "costs.json").entries()  # and it stored a fresh entry


def test_costs_command_shows_and_resets(tiny, tmp_path):
    cache = tmp_path / "cache"
    assert (
        cli(["generate", "-m", str(tiny["target"]), "-t", "1", "--draft", "ngram", "-n", "8", "-p", "hi hi hi"], cache, tmp_path).returncode
        == 0
    )
    shown = cli(["costs", "--json"], cache, tmp_path)
    data = json.loads(shown.stdout)
    assert len(data["entries"]) == 1 and "target.gguf" in next(iter(data["entries"]))
    kinds = next(iter(data["entries"].values()))["sources"]["ngram"]["kinds"]
    table = cli(["costs"], cache, tmp_path).stdout  # one reply has taught one kind: only its row shows
    assert sum(any(k["n"]) for k in kinds) == 1 and "kind 1" in table and "kind 2" not in table
    assert cli(["costs", "--reset", "--key", "nope"], cache, tmp_path).returncode == 0
    assert len(CostStore(cache / "costs.json").entries()) == 1
    assert cli(["costs", "--reset"], cache, tmp_path).returncode == 0
    assert CostStore(cache / "costs.json").entries() == {}


def test_only_measurements_are_stored_not_what_was_worked_out_from_them():
    """One slow round at a size moves the estimates of the sizes near it in this process, but
    what is stored for those sizes is still their reference: the next run does not start from
    one round's disturbance everywhere."""
    cost = CostModel(dict(CPU))
    cost.observe_verify(2, 1.3 * CPU[2])  # one slow round (a busy moment)
    assert cost.verify_cost(3) > CPU[3]  # in this process, its neighbours move with it
    stored = CostModel.from_json(cost.to_json())
    assert stored.verify_cost(2) == pytest.approx(1.3 * CPU[2])  # what was measured is kept
    assert stored.verify_cost(3) == pytest.approx(CPU[3])  # the rest is as it was


def test_a_reference_dear_at_some_sizes_only_is_doubted_and_heals_between_the_sizes_verified():
    """A curve stored on a busy machine is dear at some sizes only. Once the sizes verified in
    this process moved from it each its own way, a size between two of them costs no more than
    the straight line between them, and every size not verified is drawn less surely, so it gets
    tried. A curve that drifted as a whole (a slower day) is not doubted: the same sizes move
    together and keep its shape."""
    sick = CostModel({b: v * 8 if b >= 6 else v for b, v in CPU.items()})
    drifted = CostModel({b: v / 1.2 for b, v in CPU.items()})
    for cost in (sick, drifted):
        for _ in range(3):
            for b in (1, 2, 3, 4, 5, 16):
                cost.observe_verify(b, CPU[b])
    assert sick.shape_doubt() > 0.5 and drifted.shape_doubt() == 0.0
    assert sick.verify_cost(8) == pytest.approx(CPU[8], rel=0.3)  # not 8x, nor ~6x from the ratios' slope
    assert drifted.verify_cost(8) == pytest.approx(CPU[8], rel=0.05)  # the reference's shape, moved as a whole
    rng = np.random.default_rng(1)
    spread = {id(c): np.log(np.array([c.drawn(rng, 32) for _ in range(300)]))[:, 23].std() for c in (sick, drifted)}
    assert spread[id(sick)] > 2 * spread[id(drifted)]  # c(24), never verified: doubted where the shape was off


def test_a_reference_found_too_dear_is_stored_as_healed_and_one_slow_round_moves_nothing_else():
    sick = CostModel({b: v * 8 if b >= 6 else v for b, v in CPU.items()})
    for _ in range(3):
        sick.observe_verify(1, CPU[1])
        sick.observe_verify(12, CPU[12])
    stored = CostModel.from_json(sick.to_json())
    assert stored.verify_cost(24) == pytest.approx(CPU[24], rel=0.15)  # never verified, stored healed
    assert stored.verify_cost(32) == pytest.approx(CPU[32], rel=0.15)
    slow = CostModel(dict(CPU))
    slow.observe_verify(12, 1.3 * CPU[12])  # one slow round: the sizes near it are not stored dearer
    stored = CostModel.from_json(slow.to_json())
    assert stored.verify_cost(16) == pytest.approx(CPU[16]) and stored.verify_cost(8) == pytest.approx(CPU[8])
