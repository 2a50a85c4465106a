"""One generation with a target's draft heads attached (MTP heads, Gemma 4's assistant, an
EAGLE-3 head, a block drafter), and the checks every kind of head passes, shared by the heads' tests."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.sampling import Sampler
from specrun.llama import Model

# every head's exactness runs: 64 tokens of each of three prompts (prose, code, Japanese)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The",
    "def fibonacci(n: int) -> int:\n    if n < 2:",
    "今日はとても良い天気です。私は",
]
N_TOKENS = 64


def run(target: Model, settings: Settings, prompt: list[int], n: int, sampler: Sampler | None = None, on_step=None, cost=None):
    """One generation from a clean cache, with whatever heads ``target`` has attached; the
    tokens and the run's stats. ``on_step(engine, step)`` sees every round."""
    target.reset()
    e = Engine(
        target, None, settings, sampler or Sampler(0.0), cost or CostModel(), heads=target.heads, eagle3=target.eagle3, dflash=target.dflash
    )
    out, stats = [], None
    for step in e.generate(prompt, n):
        out += step.tokens
        stats = step.stats
        if on_step is not None:
            on_step(e, step)
    return out, stats


# --- the checks every kind of draft head passes (each test module binds its own target, the
# fresh copy its in-step check compares with, and the source's name) ---------------------------

FLAT = {b: 0.01 for b in range(1, 34)}  # a dear verify, as on a large target: drafting pays


def exact_and_in_step(target: Model, settings: Settings, prompt: list[int], want: list[int], check) -> None:
    """Greedy drafts from the heads alone come out as plain decoding's (``want``), some kept and
    some not, and after every round ``check(sequence)`` holds (the heads are in step)."""
    seen = Counter()

    def on_step(e: Engine, step) -> None:
        seen["accept"] += step.round.accepted > 0
        seen["reject"] += step.round.accepted < step.round.drafted
        check(e.tokens)

    out, stats = run(target, settings, prompt, N_TOKENS, on_step=on_step)
    assert out == want
    assert stats.by_source[settings.mode][2] > 0 and seen["accept"] and seen["reject"]


def near_ties_in_step(target: Model, settings: Settings, prompt: list[int], want: list[int], check) -> None:
    """A wide tie margin makes most rounds stop at a near-tie (a deferred position): still the
    plain output, still in step."""
    ties = []

    def on_step(e: Engine, step) -> None:
        ties.append(step.round.ties)
        check(e.tokens)

    out, _ = run(target, dataclasses.replace(settings, tie_margin=3.0), prompt, N_TOKENS, on_step=on_step)
    assert out == want and sum(ties) >= 5


def long_prompt_in_step(target: Model, settings: Settings, check) -> None:
    """A prompt over three times the batch size: the target prefills it in chunks, and the heads
    catch up chunk by chunk (never more than a batch queued); exact and in step."""
    prompt = target.tokenize(" ".join(PROMPTS) * 4)
    assert len(prompt) > 3 * target.n_batch
    out, _ = run(target, settings, prompt, 24, on_step=lambda e, step: check(e.tokens))
    assert out == run(target, Settings("none"), prompt, 24)[0]


def hybrid_weighs_the_heads(target: Model, name: str, k: int, plain: dict[str, list[int]]) -> None:
    """The default mode with heads and no draft model: the n-gram lookup and the heads, chosen
    by the chooser; exact either way, and where verifying is dear the heads draft."""
    used: Counter = Counter()
    for prompt in PROMPTS:
        engines: list[Engine] = []
        out, stats = run(
            target, Settings("hybrid", draft_max=k), target.tokenize(prompt), N_TOKENS,
            cost=CostModel(dict(FLAT)), on_step=lambda e, step, engines=engines: engines.append(e),
        )  # fmt: skip
        assert out == plain[prompt]
        assert list(engines[0].sources) == ["ngram", name]
        assert set(stats.by_source) <= {name, "ngram", "none"}
        used.update({s: v[0] for s, v in stats.by_source.items()})
    assert used[name] > 0, used


def chat_turns_in_step(target: Model, settings: Settings, check) -> None:
    """A second turn extends the sequence (the cache keeps the first), a third goes back into
    the first prompt (the cache keeps a prefix, and the heads the same one): the heads stay in
    step, and every turn matches plain decoding's."""
    user = target.tokenize("\nWhat is the capital of France?\n", add_special=False)

    def turns(settings: Settings, check) -> list[list[int]]:
        target.reset()
        e = Engine(target, None, settings, Sampler(0.0), CostModel(), heads=target.heads, eagle3=target.eagle3, dflash=target.dflash)
        out = []
        first = target.tokenize(PROMPTS[0])
        for prompt in (first, None, first[:-3] + user):
            got = []
            for step in e.generate(prompt or e.tokens + user, 24):
                got += step.tokens
                check(e.tokens)
            out.append(got)
        return out

    assert turns(settings, check) == turns(Settings("none"), lambda seq: None)


def sampling_follows_the_target(target: Model, name: str, kept: float) -> None:
    """At temperature 1.5, unfiltered, the first token drawn with the heads' drafts (a guess
    accepted with probability min(1, p/q), or a draw from the residual) follows the target's own
    law: 600 seeded runs, binned into the target's 8 likeliest tokens and the rest, against what
    600 draws from the exact law score (total variation distance). ``kept``: the least share of
    runs whose guess was kept, so that the drafts mattered."""
    tv, limit, accepted = sampling_law(target, name)
    assert accepted > kept
    assert tv <= limit, (tv, limit)


def sampling_law(target: Model, name: str, n: int = 600) -> tuple[float, float, float]:
    """(the total variation distance of the first token drawn with source ``name``'s drafts from
    the target's exact law, binned as above; the 99.5% quantile of that distance for ``n`` draws
    from the exact law itself; the share of runs whose first guess was kept)."""
    prompt = target.tokenize(PROMPTS[0])
    sampler = Sampler(1.5, top_k=0, top_p=1.0, min_p=0.0)
    target.reset()
    first = sampler.dist(target.eval(prompt, logits="last")[0].copy())
    top = [int(x) for x in first.ids[np.argsort(-first.probs)[:8]]]
    p = np.array([first.prob(x) for x in top] + [0.0])
    p[-1] = 1.0 - p.sum()
    counts = np.zeros(len(p))
    accepted = 0
    settings = Settings(name, draft_max=3, p_min=0.0, fixed=True)
    for seed in range(n):
        out, stats = run(target, settings, prompt, 2, sampler=dataclasses.replace(sampler, seed=seed))
        counts[top.index(out[0]) if out[0] in top else -1] += 1
        accepted += stats.n_accepted
    tv = 0.5 * np.abs(counts / n - p).sum()
    noise = 0.5 * np.abs(np.random.default_rng(0).multinomial(n, p, size=500) / n - p).sum(axis=1)
    return float(tv), float(np.quantile(noise, 0.995)), accepted / n


def same_rows(got, want) -> None:
    """Two blocks' rows agree, to a cache's rounding: the logits where both have them (each has its
    row's top k where the rows were sampled; a near-tie at the k-th may differ)."""
    if got.logits is None and got.candidates is None:  # pragma: no cover - a block has one or the other
        raise AssertionError("a block without rows")
    for i in range(len(got)):
        a, b = got.row(i), want.row(i)
        both = np.isfinite(a) & np.isfinite(b)
        assert both.sum() >= min(np.isfinite(a).sum(), np.isfinite(b).sum()) - 1
        np.testing.assert_allclose(a[both], b[both], atol=2e-3)
