"""The prediction source (OpenAI's Predicted Outputs) in the engine, on the tiny models: the
output is plain decoding's whatever the prediction, its copies are drafted, and what the reply
followed of it is counted once per prediction token."""

from __future__ import annotations

import pytest

from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.learned import Learned
from specrun.decode.sampling import Sampler
from specrun.llama import LoadOptions, Model

PROMPT = "The quick brown fox"
N = 80
FLAT = {b: 0.001 * (1 + 0.01 * b) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)}  # verifying is nearly free: draft


@pytest.fixture(scope="module")
def loaded(tiny):
    opts = LoadOptions(n_ctx=512, n_threads=1)
    models = {name: Model(tiny[name], opts) for name in ("target", "draft-perturbed")}
    yield models
    for m in models.values():
        m.close()


def generate(loaded, settings: Settings, prediction=(), draft=None, sampler=None):
    target = loaded["target"]
    e = Engine(target, draft, settings, sampler or Sampler(0.0), learned=Learned(CostModel(dict(FLAT)), {"model": {"per_token": 0.0001}}))
    out, stats = [], None
    for step in e.generate(target.tokenize(PROMPT, add_special=True), N, prediction=prediction):
        out.extend(step.tokens)
        stats = step.stats
    return out, stats


@pytest.fixture(scope="module")
def plain(loaded):
    return generate(loaded, Settings("none"))[0]


def predictions(plain: list[int]) -> dict[str, list[int]]:
    return {
        "correct": list(plain),
        "partly wrong": plain[:20] + plain[25:50] + [300, 301, 302] + plain[50:],  # 5 deleted, 3 inserted
        "entirely wrong": [100 + (7 * i) % 400 for i in range(N)],
    }


@pytest.mark.parametrize("mode, fixed", [("ngram", False), ("hybrid", False), ("ngram", True)])
def test_greedy_output_is_plain_decodings_whatever_the_prediction(loaded, plain, mode, fixed):
    draft = loaded["draft-perturbed"] if mode == "hybrid" else None
    for name, prediction in predictions(plain).items():
        out, stats = generate(loaded, Settings(mode, fixed=fixed), prediction, draft)
        assert out == plain, name
        assert stats.n_predicted == len(prediction)
        assert 0 <= stats.n_prediction_followed <= min(len(prediction), stats.n_generated), name
        if name == "correct":
            assert stats.n_prediction_followed == len(prediction)  # every token, the budget's last included
            assert stats.by_source["prediction"][2] > N / 2  # most of it came from the prediction's drafts
        if name == "partly wrong":
            # all but the 3 inserted, and a few written before the copy found its place again
            assert stats.n_prediction_followed >= len(prediction) - 3 - 12, stats.n_prediction_followed
        if name == "entirely wrong":
            assert stats.n_prediction_followed <= 4
            assert stats.by_source.get("prediction", [0, 0, 0])[2] == 0


def test_without_a_prediction_there_is_no_such_source(loaded, plain):
    target = loaded["target"]
    e = Engine(target, None, Settings("ngram"), Sampler(0.0), CostModel(dict(FLAT)))
    stats = list(e.generate(target.tokenize(PROMPT, add_special=True), N))[-1].stats
    assert list(e.sources) == ["ngram"]  # (nor in what the chooser explains of an idle stretch)
    assert stats.n_predicted == stats.n_prediction_followed == 0


def test_the_next_reply_forgets_the_last_ones_prediction(loaded, plain):
    target = loaded["target"]
    e = Engine(target, None, Settings("ngram"), Sampler(0.0), CostModel(dict(FLAT)))
    prompt = target.tokenize(PROMPT, add_special=True)
    first = list(e.generate(prompt, N, prediction=plain))[-1].stats
    assert list(e.sources) == ["ngram", "prediction"]  # joined at the first reply with a prediction
    second = list(e.generate(prompt, N))[-1].stats
    assert first.n_prediction_followed == N and first.by_source["prediction"][2] > 0
    assert second.n_predicted == second.n_prediction_followed == 0 and "prediction" not in second.by_source


def test_the_prediction_starts_from_what_an_earlier_run_stored(loaded, plain):
    """The kinds of prediction copies a run learned are the next run's prior, as the n-gram
    source's are."""
    target = loaded["target"]
    prompt = target.tokenize(PROMPT, add_special=True)
    e = Engine(target, None, Settings("ngram"), Sampler(0.0), CostModel(dict(FLAT)))
    list(e.generate(prompt, N, prediction=plain))
    list(e.generate(prompt, N, prediction=plain))  # the first reply's copies join a kind at the second's begin
    stored = e.learned()
    assert any(stored.sources["prediction"]["kinds"][0]["n"])
    again = Engine(target, None, Settings("ngram"), Sampler(0.0), CostModel(dict(FLAT)), learned=stored)
    list(again.generate(prompt, 4, prediction=plain))
    assert again.sources["prediction"].learned_kinds()[0]


def test_draft_none_uses_no_prediction(loaded, plain):
    out, stats = generate(loaded, Settings("none"), plain)
    assert out == plain and stats.n_drafted == 0
    assert stats.n_predicted == N and stats.n_prediction_followed == 0  # nothing drafted or looked up: all of it counts as rejected
