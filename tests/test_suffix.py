"""The suffix source: its index on hand-made token lists (continuations, counts, removal), and
the source in the engine on the tiny models (the output is plain decoding's)."""

from __future__ import annotations

import pytest

from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.sampling import Sampler
from specrun.decode.sources.suffix import BYTES_PER_TOKEN, SuffixIndex
from specrun.llama import LoadOptions, Model

FLAT = {b: 0.001 * (1 + 0.01 * b) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)}  # verifying is nearly free: draft


def test_the_continuation_is_what_most_places_went_on_with_and_says_how_many():
    index = SuffixIndex()
    for rest in ([7, 8, 9], [7, 8, 5], [7, 6, 1]):
        index.add([1, 2, 3, 4, *rest])
    out, counts = index.continuation([0, 1, 2, 3, 4], 5)
    assert out == [7, 8, 5] and counts == [(3, 3), (2, 3), (1, 2)]  # (a tie between 9 and 5: the smaller id)
    assert index.continuation([1, 2, 3], 5) == ([], [])  # shorter than N
    assert index.continuation([9, 9, 9, 9], 5) == ([], [])  # never seen


def test_the_places_matching_furthest_back_are_the_evidence():
    index = SuffixIndex()
    index.add([20, 21, 1, 2, 3, 4, 50, 51])
    index.add([30, 31, 1, 2, 3, 4, 60, 61])
    index.add([30, 31, 1, 2, 3, 4, 60, 62])
    assert index.continuation([20, 21, 1, 2, 3, 4], 2) == ([50, 51], [(1, 1), (1, 1)])
    assert index.continuation([31, 1, 2, 3, 4], 2) == ([60, 61], [(2, 2), (1, 2)])


def test_a_replys_context_is_matched_never_offered():
    """A reply kept after its prompt's last tokens: a sequence that ends as that prompt did is
    offered the reply from its first token; the prompt's own tokens are never offered."""
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5, 6, 7, 8, 9], start=6)  # prompt ... 1 2 3 4 5 6, then the reply 7 8 9
    assert index.continuation([0, 3, 4, 5, 6], 5) == ([7, 8, 9], [(1, 1), (1, 1), (1, 1)])
    assert index.continuation([0, 1, 2, 3, 4], 5) == ([], [])  # 5 6 follow there, but in the prompt


def test_a_removed_text_leaves_no_place_behind():
    index = SuffixIndex()
    first = index.add([1, 2, 3, 4, 5, 6])
    index.add([1, 2, 3, 4, 7, 8])
    index.remove(first)
    assert index.continuation([1, 2, 3, 4], 3) == ([7, 8], [(1, 1), (1, 1)])
    assert index.tokens == 6 and index.bytes == 6 * BYTES_PER_TOKEN
    index.remove(first)  # (again: nothing)
    assert all(p >> 32 != first for places in index.places.values() for p in places)


# --- in the engine -------------------------------------------------------------------------------

PROMPT = "The quick brown fox"
N_TOKENS = 60


@pytest.fixture(scope="module")
def target(tiny):
    with Model(tiny["target"], LoadOptions(n_ctx=512, n_threads=1)) as m:
        yield m


def run(target, settings: Settings, history=None) -> tuple[list[int], object]:
    e = Engine(target, None, settings, Sampler(0.0), CostModel(dict(FLAT)))
    out, stats = [], None
    for step in e.generate(target.tokenize(PROMPT, add_special=True), N_TOKENS, history=history):
        out.extend(step.tokens)
        stats = step.stats
    return out, stats


def test_a_reply_seen_before_is_drafted_from_and_the_output_is_plain_decodings(target):
    plain, _ = run(target, Settings("none"))
    index = SuffixIndex()
    index.add(plain)
    out, stats = run(target, Settings("ngram"), index)
    assert out == plain
    assert stats.by_source["suffix"][2] > N_TOKENS / 2  # most of it from the earlier reply
    other = SuffixIndex()
    other.add([(7 * i) % 600 for i in range(200)])
    out, stats = run(target, Settings("ngram"), other)
    assert out == plain and stats.by_source.get("suffix", [0, 0, 0])[2] == 0


def test_without_earlier_replies_there_is_no_such_source(target):
    e = Engine(target, None, Settings("ngram"), Sampler(0.0), CostModel(dict(FLAT)))
    list(e.generate(target.tokenize(PROMPT, add_special=True), 8))
    assert list(e.sources) == ["ngram"]
