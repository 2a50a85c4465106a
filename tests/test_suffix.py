"""The suffix source: its index on hand-made token lists (continuations, counts, removal, the bytes
it counts against what CPython really takes), the server's per-tenant store with its cap, and
the source in the engine on the tiny models (the output is plain decoding's)."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.round import History, Proposal, Round
from specrun.decode.sampling import Sampler
from specrun.decode.sources.suffix import BYTES_PER_TOKEN, MATCH_CAP, N, SuffixIndex, SuffixSource
from specrun.decode.stats import RoundStats
from specrun.errors import InputError
from specrun.llama import LoadOptions, Model
from specrun.server import corpus
from specrun.server.suffixes import CACHE_FILE, SAVE_EVERY, SuffixCache, Suffixes, tenant

FLAT = {b: 0.001 * (1 + 0.01 * b) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)}  # verifying is nearly free: draft


def test_the_continuation_is_what_most_places_went_on_with_and_says_how_many():
    index = SuffixIndex()
    for rest in ([7, 8, 9], [7, 8, 5], [7, 6, 1]):
        index.add([1, 2, 3, 4, *rest])
    out, counts, match = index.continuation([0, 1, 2, 3, 4], 5)
    assert out == [7, 8, 5] and counts == [(3, 3), (2, 3), (1, 2)]  # (a tie between 9 and 5: the smaller id)
    assert match == 4  # the places' 1 2 3 4, preceded by nothing
    assert index.continuation([1, 2, 3], 5) == ([], [], 0)  # shorter than N
    assert index.continuation([9, 9, 9, 9], 5) == ([], [], 0)  # never seen


def test_the_places_matching_furthest_back_are_the_evidence():
    index = SuffixIndex()
    index.add([20, 21, 1, 2, 3, 4, 50, 51])
    index.add([30, 31, 1, 2, 3, 4, 60, 61])
    index.add([30, 31, 1, 2, 3, 4, 60, 62])
    assert index.continuation([20, 21, 1, 2, 3, 4], 2) == ([50, 51], [(1, 1), (1, 1)], 6)
    assert index.continuation([31, 1, 2, 3, 4], 2) == ([60, 61], [(2, 2), (1, 2)], 5)


def test_a_replys_context_is_matched_never_offered():
    """A reply kept after its prompt's last tokens: a sequence that ends as that prompt did is
    offered the reply from its first token; the prompt's own tokens are never offered."""
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5, 6, 7, 8, 9], start=6)  # prompt ... 1 2 3 4 5 6, then the reply 7 8 9
    assert index.continuation([0, 3, 4, 5, 6], 5) == ([7, 8, 9], [(1, 1), (1, 1), (1, 1)], 4)
    assert index.continuation([0, 1, 2, 3, 4], 5) == ([], [], 0)  # 5 6 follow there, but in the prompt


def test_a_removed_text_leaves_no_place_behind():
    index = SuffixIndex()
    first = index.add([1, 2, 3, 4, 5, 6])
    index.add([1, 2, 3, 4, 7, 8])
    index.remove(first)
    assert index.continuation([1, 2, 3, 4], 3) == ([7, 8], [(1, 1), (1, 1)], 4)
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


def test_an_offer_after_a_long_agreeing_context_is_trusted_as_far_as_such_offers_went_on():
    """An earlier reply found again after dozens of agreeing tokens (an agent asking for code a
    reply already wrote) goes on far more often than one found by a chance four-token match:
    the source learns its rate by the context's length, and states each offer's by its own."""
    earlier = list(range(100, 200))
    index = SuffixIndex()
    index.add(earlier)
    src = SuffixSource(History(index))
    src.begin([], lambda: True)
    long_tail, short_tail = earlier[:60], [7, 8, *earlier[20:24]]  # matched 32 (MATCH_CAP) back, and 4
    rs = RoundStats("none", 0, 0, 1, 0.0, 0.0, 0.0)
    for _ in range(12):  # what the target wrote: the earlier reply after the long context, else not
        assert src.prepare(long_tail, 8, 100) == 8 and src.match == MATCH_CAP
        src.observe(Round("none", Proposal(), 0, earlier[60:68], False, rs))
        assert src.prepare(short_tail, 8, 100) == 8 and src.match == N
        src.observe(Round("none", Proposal(), 0, [999], False, rs))
    src.prepare(long_tail, 8, 100)
    after_long = src.acceptance(8, None)
    src.prepare(short_tail, 8, 100)
    after_short = src.acceptance(8, None)
    assert min(after_long) > 0.85 and after_short[0] < 0.5, (after_long, after_short)
    again = SuffixSource(History(index))  # what a later run starts from: the same lesson
    again.load(src.to_json())
    again.begin([], lambda: True)
    again.prepare(short_tail, 8, 100)
    short_again = again.acceptance(1, None)[0]
    again.prepare(long_tail, 8, 100)
    assert again.acceptance(1, None)[0] > short_again + 0.3


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


# --- the shared corpus and the cache across restarts ---------------------------------------------


def test_the_corpus_is_shared_read_only_and_takes_at_most_half_the_cap():
    store = Suffixes(cap=4 * 10 * BYTES_PER_TOKEN)  # four texts of ten tokens
    assert store.add_corpus(list(range(100, 110))) and store.add_corpus(list(range(200, 210)))
    assert not store.add_corpus(list(range(300, 310)))  # a third would pass half the cap: not kept
    assert store.corpus.continuation([100, 101, 102, 103], 2)[0] == [104, 105] and store.corpus_files == 2
    a = tenant("key", "alice")
    for i in range(3):
        store.add(a, list(range(10 * i, 10 * i + 10)))
    assert len(store) == 2 and store.evicted == 1 and store.held == store.cap  # replies go, the corpus stays
    assert store.corpus.continuation([200, 201, 202, 203], 1)[0] == [204]
    store.add(a, list(range(500, 530)))  # more than the half the corpus leaves: not kept, nothing evicted
    assert len(store) == 2 and store.evicted == 1


def test_restored_replies_are_the_newest_that_fit_oldest_first():
    a, b = tenant("k", "a"), tenant("k", "b")
    first = Suffixes(cap=10 * 10 * BYTES_PER_TOKEN)
    for i in range(5):
        first.add(a if i % 2 else b, list(range(10 * i, 10 * i + 10)), prompt=[900 + i])
    saved = first.replies()
    assert [(who, start, len(t)) for who, start, t in saved][:2] == [(b, 1, 11), (a, 1, 11)]
    smaller = Suffixes(cap=3 * 11 * BYTES_PER_TOKEN)
    assert smaller.restore(saved) == 2  # the two oldest do not fit
    assert smaller.replies() == saved[2:] and smaller.held == smaller.cap and smaller.evicted == 0
    assert smaller.index(a).continuation([901, 10, 11, 12, 13], 1)[0] == []  # (the oldest of a's: gone)
    assert smaller.index(a).continuation([903, 30, 31, 32, 33], 2)[0] == [34, 35]


def cache_in(folder, vocabulary="v1", n_vocab=1000):
    said: list[str] = []
    return SuffixCache(folder, vocabulary, n_vocab, said.append), said


def test_the_cache_round_trips_atomically_and_never_stores_a_key(tmp_path):
    store = Suffixes(cap=10**6)
    store.add(tenant("secret-key", "alice"), list(range(20)), prompt=[7, 8])
    cache, said = cache_in(tmp_path)
    cache.keep_saving(store)
    cache.close()
    assert said == [f"suffix cache: 1 reply saved to {tmp_path / CACHE_FILE}"]
    assert [p.name for p in tmp_path.iterdir()] == [CACHE_FILE]  # no temporary file left behind
    text = (tmp_path / CACHE_FILE).read_text()
    assert "secret-key" not in text and "alice" not in text and tenant("secret-key", "alice") in text
    again = Suffixes(cap=10**6)
    line = cache_in(tmp_path)[0].load(again)
    assert line == f"suffix cache: 1 earlier reply from {tmp_path / CACHE_FILE}" and again.replies() == store.replies()


def test_a_cache_for_another_vocabulary_or_corrupt_is_one_warning_and_an_empty_start(tmp_path):
    store = Suffixes(cap=10**6)
    store.add(tenant(None, None), list(range(20)))
    cache_in(tmp_path, "v1")[0].save(store)
    assert "another vocabulary" in cache_in(tmp_path, "v2")[0].load(Suffixes(cap=10**6))
    assert "none yet" in cache_in(tmp_path / "empty")[0].load(Suffixes(cap=10**6))
    good = (tmp_path / CACHE_FILE).read_text()
    for bad, why in (
        (good[: len(good) // 2], "is not JSON"),
        ("\xff\xfe", "is not JSON"),
        ('{"format": "specrun-suffixes", "version": 99}', "is not a specrun-suffixes file"),
        (good.replace('"replies":[[', '"replies":[["not a digest",0,[1,2,3,4,5]],['), "corrupt"),
        (good.replace(",19]]", ",5000]]"), "corrupt"),  # a token outside the vocabulary
        (good.replace('"replies":[', '"replies":{"a":').replace("]]}", "]}}"), "corrupt"),
    ):
        (tmp_path / CACHE_FILE).write_text(bad, encoding="latin-1")
        fresh = Suffixes(cap=10**6)
        line = cache_in(tmp_path)[0].load(fresh)
        assert line.startswith(f"warning: suffix cache {tmp_path / CACHE_FILE} ") and why in line and "\n" not in line, line
        assert len(fresh) == 0


@pytest.mark.parametrize("replies, saves", [(SAVE_EVERY - 1, 1), (SAVE_EVERY, 2)])  # (two due at once may make one save)
def test_the_cache_is_saved_every_so_many_replies_and_at_the_stop(tmp_path, replies, saves):
    store = Suffixes(cap=10**6)
    cache, _ = cache_in(tmp_path)
    cache.keep_saving(store)
    for i in range(replies):
        store.add(tenant(None, None), list(range(i, i + 10)))
    cache.close()  # (a save that came due before it is made before it)
    assert cache.saves == saves and len(cache_in(tmp_path)[0]._read(store.cap)) == replies


def test_an_unwritable_cache_warns_once_and_keeps_serving(tmp_path):
    store = Suffixes(cap=10**6)
    cache, said = cache_in(tmp_path / "gone")
    cache.keep_saving(store)
    for i in range(2 * SAVE_EVERY):
        store.add(tenant(None, None), list(range(i, i + 10)))
    cache.close()  # the folder never existed: every save fails
    assert len(said) == 1 and said[0].startswith("warning: cannot save the suffix cache"), said


def test_the_corpus_reads_text_files_in_path_order_and_skips_the_rest(tmp_path):
    (tmp_path / "b.py").write_text("print('b')\n")
    (tmp_path / "a.md").write_text("# a\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("c\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: x\n")
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "node_modules" / "m.js").write_text("m\n")
    (tmp_path / ".hidden.txt").write_text("h\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "big.txt").write_text("x" * (corpus.MAX_FILE + 1))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "link.py").symlink_to(tmp_path / "b.py")
    assert [p.relative_to(tmp_path).as_posix() for p, _ in corpus.texts(tmp_path)] == ["a.md", "b.py", "sub/c.txt"]


def test_the_corpus_stops_at_half_the_cap_and_says_so(tmp_path):
    for i in range(5):
        (tmp_path / f"{i}.txt").write_text(" ".join(str(j) for j in range(10 * i, 10 * i + 10)))
    store = Suffixes(cap=4 * 10 * BYTES_PER_TOKEN)
    line = corpus.load(store, tmp_path, lambda text: [int(w) for w in text.split()])
    assert store.corpus_files == 2 and line.startswith(f"suffix corpus: 2 files, 20 tokens from {tmp_path}") and "stopped at 2.txt" in line


def only_hidden(p):
    (p / ".git").mkdir()
    (p / ".git" / "x").write_text("x")
    return p


def a_file(p):
    (p / "f.txt").write_text("x")
    return p / "f.txt"


@pytest.mark.parametrize(
    "make, says", [(lambda p: p / "missing", "no such folder"), (a_file, "not a folder"), (only_hidden, "no text file in it")]
)
def test_a_bad_corpus_folder_is_one_line_naming_the_fix(tmp_path, make, says):
    with pytest.raises(InputError) as e:
        corpus.check(make(tmp_path))
    assert says in str(e.value) and "give the folder" in str(e.value) and e.value.exit_code == 3
