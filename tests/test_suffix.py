"""The suffix source: its index on hand-made token lists (continuations, counts, removal, the bytes
it counts against what CPython really takes), the server's per-tenant store with its cap, and
the source in the engine on the tiny models (the output is plain decoding's)."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.sampling import Sampler
from specrun.decode.sources.suffix import BYTES_PER_TOKEN, SuffixIndex
from specrun.llama import LoadOptions, Model
from specrun.server.suffixes import Suffixes, tenant

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


def test_the_bytes_counted_are_at_least_what_the_index_takes():
    """Random text (every N-gram new: the most an index holds per token), added and evicted as the
    server does until the count has been at the cap many times over: what tracemalloc sees the
    index take stays under what it counts, the cap."""
    rng = random.Random(0)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        store = Suffixes(cap=200 * 500 * BYTES_PER_TOKEN // 4)  # a quarter of what is added
        for i in range(200):
            store.add(tenant(None, f"user {i % 3}"), [rng.randrange(150_000) for _ in range(500)])
            assert store.held <= store.cap
        taken = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert store.evicted > 0 and taken <= store.cap, (taken, store.cap)


def test_tenants_never_see_each_others_replies_and_the_oldest_go_first():
    a, b = tenant("key", "alice"), tenant("key", "bob")
    assert len({a, b, tenant("other", "alice"), tenant(None, None)}) == 4 and "alice" not in a
    store = Suffixes(cap=3 * 10 * BYTES_PER_TOKEN)  # three replies of ten tokens
    store.add(a, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert store.index(b) is None
    store.add(b, [1, 2, 3, 4, 15, 16, 17, 18, 19, 20])
    assert store.index(a).continuation([1, 2, 3, 4], 3)[0] == [5, 6, 7]
    assert store.index(b).continuation([1, 2, 3, 4], 3)[0] == [15, 16, 17]
    store.add(b, list(range(30, 40)))
    store.add(b, list(range(40, 50)))  # over the cap: alice's, the oldest, goes
    assert store.index(a) is None and len(store) == 3 and store.evicted == 1 and store.held == store.cap
    store.add(b, [1, 2, 3])  # too short to look up: not kept
    assert len(store) == 3
    store.add(a, [5, 6, 7, 8, 9], prompt=list(range(100, 130)))  # kept after the prompt's last 16 tokens
    assert store.index(a).continuation([1, *range(114, 130)], 3)[0] == [5, 6, 7]
    assert store.order[-1][2] == (16 + 5) * BYTES_PER_TOKEN


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
