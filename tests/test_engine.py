"""The engine on the real llama.cpp: exactness, sampling, rollback, context limits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specrun.decode.chooser import Plan
from specrun.decode.costs import CALIBRATION_SIZES, EWMA, CostModel
from specrun.decode.engine import Engine, Settings, speculative_round
from specrun.decode.learned import Learned
from specrun.decode.sampling import Sampler
from specrun.errors import PromptTooLong, UsageError
from specrun.llama import LoadOptions, Model

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef fib",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "こんにちは、世界。今日はいい天気ですね。こんにちは",
]
# a cost model that makes the adaptive chooser draft: verifying is nearly free
FLAT = {b: 0.001 * (1 + 0.01 * b) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}
# a draft model's stored acceptance by position: every draft of 8 earlier rounds kept
ACCEPTED = {"hits": [8.0] * 8, "n": [8.0] * 8}
# a verify as flat as FLAT, of a target so slow that a measured tiny draft step is cheap beside it,
# however busy the machine
SLOW = {b: 1.0 + 0.01 * b for b in FLAT}


@pytest.fixture(scope="module")
def loaded(tiny):
    opts = LoadOptions(n_ctx=512, n_threads=2)
    models = {name: Model(tiny[name], opts) for name in ("target", "draft-copy", "draft-perturbed", "draft-unrelated")}
    yield models
    for m in models.values():
        m.close()


def generate(target, draft, settings, prompt, n=48, sampler=None, cost=None):
    sampler = sampler or Sampler(0.0)
    e = Engine(target, draft, settings, sampler, learned=Learned(CostModel(dict(cost or FLAT)), {"model": {"per_token": 0.0001}}))
    toks = target.tokenize(prompt, add_special=True)
    out, stats = [], None
    for step in e.generate(toks, n):
        out.extend(step.tokens)
        stats = step.stats
    return out, stats


@pytest.fixture(scope="module")
def plain(loaded):
    return {p: generate(loaded["target"], None, Settings("none"), p)[0] for p in PROMPTS}


# every drafter, K from 1 to 8, fixed and adaptive; the n-gram drafter ignores the draft model
COMBOS = [
    (draft, mode, fixed, k)
    for k in range(1, 9)
    for fixed in (True, False)
    for mode in ("model", "ngram", "hybrid")
    for draft in (["draft-copy"] if mode == "ngram" else ["draft-copy", "draft-perturbed", "draft-unrelated"])
]


@pytest.mark.parametrize("draft, mode, fixed, k", COMBOS)
def test_greedy_speculation_is_token_identical_to_plain(loaded, plain, draft, mode, fixed, k):
    settings = Settings(mode, draft_max=k, draft_min=1, p_min=0.0, fixed=fixed)
    for p in PROMPTS:
        out, stats = generate(loaded["target"], loaded[draft], settings, p)
        assert out == plain[p], (p, stats.to_json())
        if fixed and mode == "model":
            assert stats.n_drafted > 0


def test_copy_draft_is_always_accepted_and_unrelated_rarely(loaded):
    s = Settings("model", draft_max=4, p_min=0.0, fixed=True, tie_margin=0.0)
    _, copy = generate(loaded["target"], loaded["draft-copy"], s, PROMPTS[0])
    _, unrel = generate(loaded["target"], loaded["draft-unrelated"], s, PROMPTS[0])
    assert copy.acceptance_rate == 1.0
    assert unrel.acceptance_rate < 0.5
    assert copy.mean_accept_len == pytest.approx(4.0, abs=0.5)


def test_temperature_with_draft_equal_target_accepts_nearly_all(loaded):
    s = Settings("model", draft_max=4, p_min=0.0, fixed=True)
    drafted = accepted = 0
    for seed in range(40):
        if drafted >= 300:
            break
        _, stats = generate(loaded["target"], loaded["draft-copy"], s, PROMPTS[seed % 3], n=100, sampler=Sampler(0.9, seed=seed))
        drafted += stats.n_drafted
        accepted += stats.n_accepted
    assert drafted >= 300
    assert accepted / drafted > 0.97


def test_sampling_is_reproducible_with_a_seed(loaded):
    s = Settings("model", draft_max=3, p_min=0.0, fixed=True)
    a, _ = generate(loaded["target"], loaded["draft-perturbed"], s, PROMPTS[0], sampler=Sampler(0.8, seed=11))
    b, _ = generate(loaded["target"], loaded["draft-perturbed"], s, PROMPTS[0], sampler=Sampler(0.8, seed=11))
    c, _ = generate(loaded["target"], loaded["draft-perturbed"], s, PROMPTS[0], sampler=Sampler(0.8, seed=12))
    assert a == b and a != c


def test_rollback_leaves_the_cache_as_a_fresh_decode(loaded, tiny):
    """After random accepts and rejects, the target's next logits equal a fresh decode."""
    target = loaded["target"]
    s = Settings("model", draft_max=6, p_min=0.0, fixed=True)
    e = Engine(target, loaded["draft-perturbed"], s, Sampler(1.0, seed=5), CostModel(dict(FLAT)))
    prompt = target.tokenize(PROMPTS[0])
    stats = None
    for step in e.generate(prompt, 120):
        stats = step.stats
    assert 0 < stats.n_accepted < stats.n_drafted  # a real mix of accepts and rejects
    seq = e.tokens
    assert target.n_past == len(seq) - 1 and target.tokens == seq[:-1]
    got = target.eval([seq[-1]], logits="last")[0].copy()
    # the fresh decode: the prompt as one batch (as prefill does), then one token at a time.
    # (A single 136-token batch differs from any incremental path by ~2e-2 on this model's
    # large logits: a different kernel, not a cache problem.)
    with Model(tiny["target"], LoadOptions(n_ctx=512, n_threads=2)) as fresh:
        fresh.eval(prompt[:-1], logits="none")
        for t in seq[len(prompt) - 1 :]:
            want = fresh.eval([t], logits="last")[0].copy()
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_near_ties_are_left_to_a_plain_step(loaded, plain):
    """With a huge tie margin every position is a near-tie: no draft is ever accepted, every
    round defers to a plain one-token step, and the output is still the plain output."""
    s = Settings("model", draft_max=4, p_min=0.0, fixed=True, tie_margin=1e9)
    out, stats = generate(loaded["target"], loaded["draft-copy"], s, PROMPTS[0])
    assert out == plain[PROMPTS[0]]
    assert stats.n_accepted == 0 and stats.by_source["none"][0] >= 48


def test_one_round_follows_the_paper(loaded):
    """A copy draft: all K accepted plus the bonus token; the cache holds the accepted ones."""
    target, draft = loaded["target"], loaded["draft-copy"]
    e = Engine(target, draft, Settings("model", draft_max=4, p_min=0.0, fixed=True), Sampler(0.0))
    prompt = target.tokenize(PROMPTS[1])
    e.prefill(prompt)
    r = speculative_round(target, e.sources["model"], prompt, Plan("model", 4), Sampler(0.0), e.rng)
    assert r.stats.drafted == 4 and r.accepted == 4 and len(r.emitted) == 5 and not r.deferred
    assert r.emitted[:4] == r.proposal.tokens
    assert target.n_past == len(prompt) + 4


def test_context_full_is_a_finish_reason(tiny):
    # llama.cpp's smallest context is 256 cells: a 250-token prompt leaves room for a few more
    opts = LoadOptions(n_ctx=256, n_threads=2)
    with Model(tiny["target"], opts) as t, Model(tiny["draft-copy"], opts) as d:
        prompt = t.tokenize(PROMPTS[1] * 20)[:250]
        for mode, draft in (("none", None), ("model", d), ("hybrid", d)):
            e = Engine(
                t,
                draft,
                Settings(mode, draft_max=8, p_min=0.0),
                Sampler(0.0),
                learned=Learned(CostModel(dict(FLAT)), {"model": {"per_token": 1e-4}}),
            )
            out, stats = [], None
            for step in e.generate(prompt, 1000):
                out.extend(step.tokens)
                stats = step.stats
            assert t.n_ctx == 256
            assert stats.finish_reason == "context", stats.finish_reason
            assert len(prompt) + len(out) == 257  # every position, plus the pending token


def test_prompt_longer_than_context_and_empty_prompt(tiny):
    with Model(tiny["target"], LoadOptions(n_ctx=256, n_threads=2)) as t:
        e = Engine(t, None, Settings("none"), Sampler(0.0))
        with pytest.raises(PromptTooLong, match=r"300 tokens but the context holds 256; raise n_ctx to 1024"):
            list(e.generate(list(range(10, 310)), 5))
        with pytest.raises(UsageError):
            list(e.generate([], 5))


def test_stop_event_interrupts_within_a_round(loaded):
    import threading

    stop = threading.Event()
    e = Engine(loaded["target"], None, Settings("none"), Sampler(0.0))
    got = 0
    stats = None
    for step in e.generate(loaded["target"].tokenize(PROMPTS[0]), 100, stop):
        got += 1
        stats = step.stats
        if got == 3:
            stop.set()
    assert got == 3 and stats.finish_reason == "interrupted"


def test_adaptive_mode_drafts_when_verify_is_cheap_and_stops_when_dear(loaded):
    s = Settings("model", draft_max=8, p_min=0.0)
    _, cheap = generate(loaded["target"], loaded["draft-copy"], s, PROMPTS[0], n=64, cost=FLAT)
    dear = {b: 0.03 * b for b in FLAT}  # verifying b tokens costs b single steps
    _, costly = generate(loaded["target"], loaded["draft-copy"], s, PROMPTS[0], n=64, cost=dear)
    # (the online cost updates soon see that the tiny draft costs as much as the target, so
    # even the cheap run drafts only in its first rounds: once the true costs are seen, not even
    # a perfect draft of a model as large as the target could pay)
    assert cheap.n_drafted >= 1
    assert costly.n_drafted == 0  # verifying b tokens at b steps: no draft could ever pay, so none is tried


def test_a_draft_max_over_the_rows_a_verify_can_return_is_cut_to_them(tiny):
    """A target loaded to return at most 8 rows of logits a decode verifies at most 7 drafts,
    whatever --draft-max says (it used to stop the run with an internal error)."""
    with Model(tiny["target"], LoadOptions(n_ctx=512, n_threads=2, n_outputs_max=8)) as t:
        e = Engine(t, None, Settings("ngram", draft_max=32, fixed=True), Sampler(0.0), CostModel(dict(FLAT)))
        steps = list(e.generate(t.tokenize(PROMPTS[0] * 6, add_special=True), 64))
        assert steps[-1].stats.finish_reason == "length"
        assert max(s.round.drafted for s in steps) == 7


def test_a_draft_cache_catch_up_is_not_counted_per_token(loaded):
    from specrun.decode.sources import ModelSource

    t = loaded["target"]
    d = ModelSource(loaded["draft-copy"], Sampler(0.0), np.random.default_rng(0), t.n_vocab, CostModel(), 8)
    d.model.reset()
    toks = t.tokenize(PROMPTS[0] * 3, add_special=True)
    first = d.propose(toks, 2, 0.0)  # the draft has seen nothing yet: this proposal first evaluates everything
    assert first.sync_s > 0
    later = d.propose(toks + d.model.tokens[len(toks) : len(toks) + 1], 2, 0.0)  # one more token: a normal round
    assert later.sync_s == 0.0


def test_the_draft_models_stop_rule_drafts_long_on_a_flat_verify_and_short_on_a_steep_one(loaded):
    """The stop rule on the real draft, with costs given (no timing): a confident draft that its
    posteriors say is accepted goes on while one more token pays for its verify width; on a
    verify as dear as plain steps, it stops at one."""
    from specrun.decode.round import Round
    from specrun.decode.sources import ModelSource
    from specrun.decode.stats import RoundStats

    target, draft = loaded["target"], loaded["draft-copy"]
    prompt = target.tokenize(PROMPTS[0])

    def source(curve):
        src = ModelSource(draft, Sampler(0.0), np.random.default_rng(0), target.n_vocab, CostModel(dict(curve)), 16)
        src.per_token = 1e-5
        return src

    flat = source(FLAT)
    for _ in range(40):  # it has been accepted at every position it drafted
        p = flat.propose(prompt, 16, 0.0)
        flat.observe(
            Round(
                "model",
                stated(p, flat),
                len(p.tokens),
                p.tokens,
                False,
                RoundStats("model", len(p.tokens), len(p.tokens), 0, 0.0, 0.0, 0.0),
            )
        )
    assert flat.positions.means()[0] > 0.9 and sum(r.n for r in flat.by_conf) > 0
    worth = 1.5 / FLAT[1]  # the round's planned rate: 1.5x plain
    assert len(flat.propose(prompt, 16, worth).tokens) >= 8
    steep = source({b: 0.001 * b for b in FLAT})  # verifying b tokens costs b steps
    steep.positions, steep.by_conf, steep.after = flat.positions, flat.by_conf, flat.after
    assert len(steep.propose(prompt, 16, 1.0 / 0.001).tokens) == 1
    # rejected at once, round after round: the first position's rate falls
    for _ in range(40):
        p = flat.propose(prompt, 4, 0.0)
        flat.observe(Round("model", stated(p, flat), 0, [p.tokens[0] + 1], False, RoundStats("model", len(p.tokens), 0, 1, 0.0, 0.0, 0.0)))
    assert flat.positions.means()[0] < 0.5


def stated(p, src):
    """``p`` as if each of its drafts took the ``per_token`` the test gave ``src``: the test states
    the costs, and this machine's draft timings (slower under load) must not move them."""
    return dataclasses.replace(p, first_s=src.per_token, step_s=src.per_token if len(p.tokens) > 1 else 0.0)


def taught(loaded, kept):
    """A draft model source (a draft step 0.3 of a target step, on a flat verify) whose 16-token
    drafts on PROMPTS[0] had their first ``kept(n)`` accepted, 40 rounds; and that prompt."""
    from specrun.decode.round import Round
    from specrun.decode.sources import ModelSource
    from specrun.decode.stats import RoundStats

    target, draft = loaded["target"], loaded["draft-copy"]
    prompt = target.tokenize(PROMPTS[0])
    src = ModelSource(draft, Sampler(0.0), np.random.default_rng(0), target.n_vocab, CostModel(dict(FLAT)), 16)
    src.per_token = 0.3 * FLAT[1]
    for _ in range(40):
        p = src.propose(prompt, 16, 0.0)
        n = kept(len(p.tokens))
        src.observe(Round("model", stated(p, src), n, p.tokens[:n] + [0], False, RoundStats("model", len(p.tokens), n, 1, 0.0, 0.0, 0.0)))
    return src, prompt


def test_the_stop_rule_drafts_as_far_as_the_drafts_confidence_has_foretold(loaded):
    """How far a round drafts is decided as the drafts come, up to what the source offered, not
    at the chooser's K: where a draft as confident as the last has been followed by an accepted
    one (a copied file), it drafts on past K; where such drafts have been followed by rejections
    (prose), it stops."""
    worth = 1.5 / FLAT[1]  # the round's planned rate: 1.5x plain
    followed, prompt = taught(loaded, lambda n: n)  # every draft it made was accepted
    assert len(followed.propose(prompt, 2, worth, 16).tokens) >= 8  # planned on 2, offered 16
    assert len(followed.propose(prompt, 2, worth).tokens) <= 2  # offered 2
    broken, _ = taught(loaded, lambda n: 1)  # the first draft kept, the next rejected, every time
    assert len(broken.propose(prompt, 2, worth, 16).tokens) <= 1


def test_a_draft_stops_where_another_source_would_make_more_of_the_next_tokens(loaded):
    """Each further draft is weighed against the round's planned rate, or against what the other
    sources could make of a round from there (``rival``: a copy of the context, free to draft)
    where that is more: a draft that would run on stops where a much faster rival appears, and
    runs on past a slower one."""
    src, prompt = taught(loaded, lambda n: n)
    worth = 1.5 / FLAT[1]

    def after(n: int, rate: float):  # a rival that appears once n tokens are drafted
        return lambda seq: rate if len(seq) >= len(prompt) + n else 0.0

    assert len(src.propose(prompt, 2, worth, 16, rival=after(3, 2.0 / FLAT[1])).tokens) >= 8
    assert len(src.propose(prompt, 2, worth, 16, rival=after(3, 50.0 / FLAT[1])).tokens) == 3


def test_the_stop_rule_prices_its_verify_on_the_curve_the_round_was_planned_on(loaded):
    """The chooser plans a round on a draw of the verify curve too: where the stored curve says
    long batches are dear (a poisoned calibration, or sizes never verified) and the draw hoped
    otherwise, the stop rule drafts on at the drawn prices, so that the long batch is verified
    and its cost learned; on the stored curve it stops short."""
    from specrun.decode.round import Round
    from specrun.decode.sources import ModelSource
    from specrun.decode.stats import RoundStats

    target, draft = loaded["target"], loaded["draft-copy"]
    prompt = target.tokenize(PROMPTS[0])
    steep = {b: FLAT[1] * b for b in FLAT}  # verifying b tokens costs b plain steps
    src = ModelSource(draft, Sampler(0.0), np.random.default_rng(0), target.n_vocab, CostModel(dict(steep)), 16)
    src.per_token = 1e-5
    for _ in range(40):  # every position it drafts is accepted
        p = src.propose(prompt, 16, 0.0)
        src.observe(
            Round(
                "model", stated(p, src), len(p.tokens), p.tokens, False, RoundStats("model", len(p.tokens), len(p.tokens), 0, 0.0, 0.0, 0.0)
            )
        )
    worth = 1.5 / FLAT[1]
    drawn = CostModel(dict(FLAT)).table(17)
    on_stored = len(src.propose(prompt, 16, worth).tokens)
    on_draw = len(src.propose(prompt, 16, worth, verify=tuple(drawn)).tokens)
    assert on_stored <= 1 and on_draw >= 8


def test_the_stop_rule_looks_past_a_step_in_the_verify_curve(loaded):
    """A verify curve with a step (as the demo target's on this CPU: 8 tokens cost as much as
    16): a confident, well-accepted draft goes on to the far side of the step instead of stopping
    where the next token alone does not pay; where the step never flattens, it stops short."""
    from specrun.decode.round import Round
    from specrun.decode.sources import ModelSource
    from specrun.decode.stats import RoundStats

    target, draft = loaded["target"], loaded["draft-copy"]
    prompt = target.tokenize(PROMPTS[0])
    step = {1: 1.0, 2: 1.8, 3: 2.6, 4: 3.4, 5: 4.2, 6: 5.0, 7: 5.8, 8: 6.6, 12: 6.6, 16: 6.6, 24: 9.0, 32: 12.0}  # x one step
    steep = {b: float(b) for b in step}  # every token a whole step, never flattening

    def source(curve):
        src = ModelSource(
            draft, Sampler(0.0), np.random.default_rng(0), target.n_vocab, CostModel({b: 0.01 * v for b, v in curve.items()}), 16
        )
        src.per_token = 1e-5
        for _ in range(40):  # every position it drafts is accepted
            p = src.propose(prompt, 16, 0.0)
            src.observe(
                Round(
                    "model",
                    stated(p, src),
                    len(p.tokens),
                    p.tokens,
                    False,
                    RoundStats("model", len(p.tokens), len(p.tokens), 0, 0.0, 0.0, 0.0),
                )
            )
        return src

    worth = 1.2 / 0.01  # the round's planned rate: 1.2x plain
    assert len(source(step).propose(prompt, 16, worth).tokens) >= 12
    assert len(source(steep).propose(prompt, 16, worth).tokens) <= 2


def test_a_drafted_tokens_cost_is_learned_from_its_steps_not_from_a_catch_up(loaded):
    """Drafting K tokens costs one first draft (which also feeds what the last round added)
    and K - 1 steps, each learned from the source's own timings. The first draft after a
    catch-up comes out of the catch-up's decode: that round teaches nothing of a first draft."""
    from specrun.decode.round import Round
    from specrun.decode.sources import ModelSource
    from specrun.decode.stats import RoundStats

    target, draft = loaded["target"], loaded["draft-copy"]
    src = ModelSource(draft, Sampler(0.0), np.random.default_rng(0), target.n_vocab, CostModel(dict(FLAT)), 8)
    src.per_token = 0.02
    draft.reset()
    tokens = target.tokenize(PROMPTS[0] * 4)
    p = src.propose(tokens, 1, 0.0)  # a catch-up of the whole prompt, and one draft out of it
    assert p.sync_s > 0 and len(p.tokens) == 1 and p.step_s == 0
    src.observe(Round("model", p, 1, p.tokens, False, RoundStats("model", 1, 1, 0, p.sync_s, 0.0, 0.0)))
    assert src.per_token == 0.02 and src.first_s is None  # nothing learned: no step, and no first draft of its own
    p = src.propose(tokens + p.tokens, 3, 0.0)  # a normal round: one or two new tokens, then steps
    assert p.sync_s == 0 and len(p.tokens) == 3 and p.first_s > 0 and p.step_s > 0
    src.observe(Round("model", p, 3, p.tokens, False, RoundStats("model", 3, 3, 0, p.first_s + 2 * p.step_s, 0.0, 0.0)))
    assert src.first_s == p.first_s
    assert src.per_token == pytest.approx(0.02 + EWMA * (p.step_s - 0.02))
    assert src.cost(1) == pytest.approx(src.first_s)
    assert src.cost(5) - src.cost(1) == pytest.approx(4 * src.per_token)


def test_a_draft_stops_at_a_token_that_ends_the_targets_turn(loaded):
    """The target stops generating at an end-of-generation token, so no draft past one could
    be kept: a token-by-token draft ends with it (here a token the draft really writes is
    declared one)."""
    from specrun.decode.sources import ModelSource

    target, draft = loaded["target"], loaded["draft-copy"]
    tokens = target.tokenize(PROMPTS[0] * 4)

    def drafts(ends_turn) -> list[int]:
        src = ModelSource(draft, Sampler(0.0), np.random.default_rng(0), target.n_vocab, CostModel(dict(FLAT)), 8, ends_turn)
        draft.reset()
        return src.propose(tokens, 8, 0.0).tokens

    free = drafts(None)
    assert len(free) == 8
    stopped = drafts(lambda t: t == free[2])
    assert stopped == free[: free.index(free[2]) + 1]


def test_a_lagging_draft_cache_costs_its_share_of_the_run_not_a_lock_out(loaded):
    """After a stretch of n-gram or plain rounds the draft's cache lags; catching it up is paid
    once for every round after it, so a long run bears a small share per round (else the lag
    grows, the draft is priced out for good, and it never drafts again), and a run's last
    tokens bear it whole."""
    from specrun.decode.sources import ModelSource

    target, draft = loaded["target"], loaded["draft-copy"]
    src = ModelSource(draft, Sampler(0.0), np.random.default_rng(0), target.n_vocab, CostModel(dict(FLAT)), 8)
    src.per_token, src.catch_up_per_token = 1e-3, 1e-3
    draft.reset()
    tokens = target.tokenize(PROMPTS[0] * 8)
    src.prepare(tokens, 8, 10_000)
    assert src.lag == len(tokens) > 100
    assert src.cost(4) < 4e-3 + 0.01 * len(tokens) * 1e-3  # a share, not the whole catch-up
    src.prepare(tokens, 8, 5)
    assert src.cost(4) == pytest.approx(4e-3 + len(tokens) * 1e-3)  # nothing after it to share it with


def test_a_catch_up_not_timed_yet_is_priced_as_the_targets_curve_prices_a_batch_and_lengths_price_at_once(loaded):
    """Before its first catch-up is timed, a lagging draft's catch-up costs a draft step scaled
    as the target's verify curve scales a batch: nearly free per token where a batch is (a GPU,
    a memory-bound target), nearly a step per token where it is not. The chooser prices every
    length in one call; each is what pricing it alone gives."""
    from specrun.decode.sources import ModelSource
    from specrun.decode.sources.model import Autoregressive

    target, draft = loaded["target"], loaded["draft-copy"]
    tokens = target.tokenize(PROMPTS[0] * 8)
    steep = {b: 0.001 * b for b in (1, 2, 4, 8, 16, 32, 64)}
    catch_up = {}
    for name, curve in (("flat", SLOW), ("steep", steep)):
        src = ModelSource(draft, Sampler(0.0), np.random.default_rng(0), target.n_vocab, CostModel(dict(curve)), 8)
        src.per_token = 1e-3
        draft.reset()
        src.prepare(tokens, 8, 5)  # nothing after it to share the catch-up with: this round bears it whole
        assert src.catch_up_per_token is None and src.lag > 2
        catch_up[name] = (src.cost(4) - Autoregressive.cost(src, 4)) / src.lag
        ks = np.arange(1, 9)
        assert np.zeros(8) + src.cost(ks) == pytest.approx([src.cost(int(k)) for k in ks])
    assert catch_up["flat"] < 0.1 * src.per_token  # a batch nearly free: so is a token of it
    assert catch_up["steep"] == pytest.approx(src.per_token, rel=0.01)  # a batch of b costs b steps


def test_a_draft_that_falls_behind_after_every_short_stretch_pays_each_catch_up_in_full(loaded):
    """Where the n-gram lookup takes most rounds, the draft's cache falls behind again a few
    rounds after each catch-up: a catch-up buys that stretch of rounds, not the rest of the run.
    Once its stretches have been short, a long run ahead no longer hides what one costs."""
    from specrun.decode.round import Round
    from specrun.decode.sources import ModelSource
    from specrun.decode.sources.model import Autoregressive
    from specrun.decode.stats import RoundStats

    target, draft = loaded["target"], loaded["draft-copy"]
    tokens = target.tokenize(PROMPTS[0] * 4)
    copied = target.tokenize(PROMPTS[1] * 6)  # what the n-gram lookup wrote while the draft waited

    def source() -> ModelSource:
        src = ModelSource(draft, Sampler(0.0), np.random.default_rng(0), target.n_vocab, CostModel(dict(FLAT)), 8)
        src.per_token, src.catch_up_per_token = 1e-3, 1e-3
        draft.reset()
        return src

    fresh = source()
    fresh.prepare(tokens + copied, 8, 10_000)
    catch_up = fresh.cost(4) - Autoregressive.cost(fresh, 4)
    assert 0 < catch_up < 0.01 * fresh.lag * 1e-3  # no stretch seen yet: a share of the run
    src = source()
    for _ in range(2):  # twice: it catches up, brings 4 tokens, and falls behind again
        p = src.propose(tokens, 3, 0.0)
        assert p.caught_up > 2
        src.observe(Round("model", p, 3, [*p.tokens, 0], False, RoundStats("model", 3, 3, 4, p.sync_s, 0.0, 0.0)))
        draft.reset()
    src.prepare(tokens + copied, 8, 10_000)
    assert src.lag == fresh.lag
    assert src.cost(4) - Autoregressive.cost(src, 4) == pytest.approx(src.lag * src.catch_up_per_token)  # the whole catch-up


def test_a_new_prompt_is_prefilled_into_the_draft_cache_whatever_the_last_run_left_behind(loaded):
    """A run whose last rounds were the n-gram's or plain ones leaves the draft's cache behind,
    owing a catch-up. That is no cost of the next prompt, which is prefilled into the draft's
    cache wherever the draft pays (else its first draft catches the whole prompt up, at a
    price shared over a run that may not be there to share it)."""
    target, draft = loaded["target"], loaded["draft-copy"]
    learned = Learned(CostModel(dict(SLOW)), {"model": {"per_token": 1e-4, "catch_up_per_token": 1e-3, "positions": ACCEPTED}})
    e = Engine(target, draft, Settings("hybrid"), Sampler(0.0), learned=learned)
    first = target.tokenize(PROMPTS[0], add_special=True)
    e.prefill(first)
    ended = first + target.tokenize(PROMPTS[1] * 6)  # what the run wrote past the draft's cache
    e.sources["model"].prepare(ended, 0, 1)  # its last round: nothing left to share a catch-up with
    nxt = target.tokenize(PROMPTS[2], add_special=True)
    e.prefill(nxt)
    assert draft.tokens == nxt[:-1]


def test_a_prompt_waits_for_the_draft_models_prefill_only_where_the_draft_model_pays(loaded):
    """Where the draft model does not beat plain decoding at its means (here a verify of b tokens
    costs b steps, so no draft can), a prompt longer than the draft step's timing needs is not
    prefilled into its cache: a long prompt would wait for a model that never drafts. Where it
    pays (a flat verify), it is. The reply is the same either way."""
    target, draft = loaded["target"], loaded["draft-copy"]
    steep = {b: 1.0 * b for b in SLOW}
    text = " ".join(PROMPTS[:2]) * 3
    prompt = target.tokenize(text, add_special=True)
    assert len(prompt) > CALIBRATION_SIZES[-1] + 1  # longer than a draft step is timed past
    plain_out = generate(target, None, Settings("none"), text)[0]
    filled = {}
    for name, curve in (("flat", SLOW), ("steep", steep)):
        draft.reset()
        learned = Learned(CostModel(dict(curve)), {"model": {"per_token": 1e-4, "positions": ACCEPTED}})
        e = Engine(target, draft, Settings("hybrid"), Sampler(0.0), learned=learned)
        assert [t for step in e.generate(prompt, 48) for t in step.tokens] == plain_out
        e.prefill(prompt)
        filled[name] = draft.n_past
    assert filled["flat"] == len(prompt) - 1
    assert filled["steep"] < len(prompt) - 1
