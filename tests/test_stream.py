"""The stream layer on the real llama.cpp: text, stop strings, UTF-8, from-draft flags; and an
exactness check that does not go through the engine at all."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import SPLIT_CHAR

from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.learned import Learned
from specrun.decode.sampling import Sampler
from specrun.llama import LoadOptions, Model
from specrun.run.stream import Detokenizer, stop_scan, stream_generate

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef fib",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "こんにちは、世界。今日はいい天気ですね。こんにちは",
]
FLAT = {b: 0.001 * (1 + 0.01 * b) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}  # verifying is nearly free


@pytest.fixture(scope="module")
def models(tiny):
    opts = LoadOptions(n_ctx=512, n_threads=2)
    loaded = {name: Model(tiny[name], opts) for name in ("target", "draft-copy", "draft-perturbed")}
    yield loaded
    for m in loaded.values():
        m.close()


def greedy_loop(model: Model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding written directly over Model.eval, one token at a time, sharing no
    code with the engine: the independent reference."""
    model.reset()
    logits = model.eval(prompt, logits="last")
    out: list[int] = []
    while len(out) < n:
        t = int(np.argmax(logits[-1]))
        out.append(t)
        if model.is_eog(t):
            break
        logits = model.eval([t], logits="last")
    model.reset()
    return out


def run(models, settings: Settings, prompt: list[int], n: int, draft: str | None = None, stop=(), sampler=None):
    e = Engine(
        models["target"],
        models[draft] if draft else None,
        settings,
        sampler or Sampler(0.0),
        learned=Learned(CostModel(dict(FLAT)), {"model": {"per_token": 1e-4}}),
    )
    e.reset()
    events = list(stream_generate(e, prompt, n, stop=stop))
    return events


@pytest.mark.parametrize("prompt", PROMPTS)
def test_plain_decoding_equals_a_greedy_loop_written_over_eval(models, prompt):
    t = models["target"]
    toks = t.tokenize(prompt, add_special=True)
    want = greedy_loop(t, toks, 64)
    got = [x for ev in run(models, Settings("none"), toks, 64) for x in ev.tokens]
    assert got == want


@pytest.mark.parametrize("draft", ["draft-copy", "draft-perturbed"])
def test_speculation_equals_the_independent_greedy_loop(models, draft):
    t = models["target"]
    for prompt in PROMPTS:
        toks = t.tokenize(prompt, add_special=True)
        want = greedy_loop(t, toks, 64)
        got = [x for ev in run(models, Settings("model", draft_max=4, p_min=0.0, fixed=True), toks, 64, draft) for x in ev.tokens]
        assert got == want, prompt


def test_text_is_the_decoded_tokens_and_the_last_event_has_the_reason(models):
    t = models["target"]
    toks = t.tokenize(PROMPTS[2], add_special=True)
    events = run(models, Settings("none"), toks, 80)
    tokens = [x for ev in events for x in ev.tokens]
    text = "".join(ev.text for ev in events)
    assert text == b"".join(t.piece(x) for x in tokens if not t.is_eog(x)).decode("utf-8", errors="replace")
    assert [ev.finish_reason for ev in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1].finish_reason in ("stop", "length")
    assert events[-1].stats.n_generated == len(tokens)
    # snapshots: an early event's stats are not changed by later rounds
    assert events[0].stats.n_generated < events[-1].stats.n_generated


def test_a_stop_string_spanning_two_rounds_is_caught(models):
    t = models["target"]
    toks = t.tokenize(PROMPTS[0], add_special=True)
    plain = run(models, Settings("none"), toks, 60)  # one token per round
    pieces = [ev.text for ev in plain[:-1]]
    # a stop string made of the end of one round's text and the start of the next one's
    i = next(i for i in range(5, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    full = "".join(pieces)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    assert stop not in "".join(pieces[: i + 1])  # it only appears once both rounds are in
    events = run(models, Settings("none"), toks, 60, stop=[stop])
    text = "".join(ev.text for ev in events)
    assert text == full[: full.index(stop)]
    assert events[-1].finish_reason == "stop_string"
    assert events[-1].stats.finish_reason == "stop_string"
    # nothing of the stop string was shown before it was known to be one
    shown = ""
    for ev in events:
        shown += ev.text
        assert stop[:1] not in shown[full.index(stop) :]


def test_a_stop_string_in_speculative_rounds_cuts_the_same_text(models):
    t = models["target"]
    toks = t.tokenize(PROMPTS[1], add_special=True)
    plain = "".join(ev.text for ev in run(models, Settings("none"), toks, 60))
    stop = plain[20:24]
    spec = run(models, Settings("model", draft_max=6, p_min=0.0, fixed=True), toks, 60, "draft-copy", stop=[stop, "never appears"])
    assert "".join(ev.text for ev in spec) == plain[: plain.index(stop)]
    assert spec[-1].finish_reason == "stop_string"


def test_a_character_split_across_rounds_is_held_back_whole(models):
    t = models["target"]
    ids = t.tokenize(f"a{SPLIT_CHAR}b", add_special=False)
    assert len(ids) >= 4  # the character is two tokens
    d = Detokenizer(t.piece, t.is_eog)
    shown = []
    for x in ids:  # one token per round
        out, hit = d.feed([x], [None])
        assert not hit
        shown.append("".join(s for s, _ in out))
    shown.append("".join(s for s, _ in d.finish()[0]))
    assert "".join(shown) == f"a{SPLIT_CHAR}b"
    assert all("\ufffd" not in s for s in shown)
    assert "" in shown  # the round that held only the first half showed nothing


def test_stop_scan_holds_back_a_possible_start():
    assert stop_scan("hello wor", ["world"]) == (6, False)
    assert stop_scan("hello world!", ["world"]) == (6, True)
    assert stop_scan("abc", []) == (3, False)
    assert stop_scan("xxab", ["abc", "bz"]) == (2, False)


def test_from_draft_flags_match_the_stats(models):
    t = models["target"]
    for prompt in PROMPTS:
        toks = t.tokenize(prompt, add_special=True)
        events = run(models, Settings("model", draft_max=4, p_min=0.0, fixed=True), toks, 64, "draft-perturbed")
        flags = [f for ev in events for f in ev.from_draft]
        assert len(flags) == sum(len(ev.tokens) for ev in events)
        assert sum(flags) == events[-1].stats.n_accepted
        assert 0 < sum(flags) < len(flags)
        for ev in events:  # accepted drafts come first in a round, then the target's own token
            assert list(ev.from_draft) == sorted(ev.from_draft, reverse=True)
        # the text's from-draft runs add up to the text
        assert all("".join(s for s, _, _ in ev.segments) == ev.text for ev in events)
        assert not any(branch for ev in events for _, _, branch in ev.segments)  # chains: no branch


def test_plain_decoding_has_no_draft_tokens(models):
    t = models["target"]
    toks = t.tokenize(PROMPTS[0], add_special=True)
    events = run(models, Settings("none"), toks, 32)
    assert not any(f for ev in events for f in ev.from_draft)
    assert all(src is None and not branch for ev in events for _, src, branch in ev.segments)
