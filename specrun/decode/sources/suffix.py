"""The suffix source: what earlier replies went on with after the sequence's tail, and how often.

An agent sends the same kinds of request again and again (a tool call's JSON, a diff's header, a
test run's summary), and its replies repeat each other more than they repeat their own prompt.
The server keeps earlier replies' tokens in an index (``SuffixIndex``, one per tenant, bounded:
``server/suffixes.py``); each round this source looks the sequence's tail up in it. A corpus of
the operator's files, shared by every tenant, is an index of the same kind, looked up by a
source of its own (``CorpusSource``). Of the
places where an earlier reply holds the tail's last ``N`` tokens, those whose context matches
the tail furthest back are the evidence: it offers, token by token, what most of them went on
with (SuffixDecoding, Oliaro et al. 2024, with an n-gram index for the suffix tree).

Its acceptance is stated from those counts: of the ``c`` places that reached position j, ``h``
went on with the token offered there, so ``a_j`` is the mean of a Beta posterior with ``h`` hits
in ``c`` trials. Its prior is how often this source's offers have gone on lately *after a
context as long*: the places' context matched the tail ``m`` tokens back, so position j follows
``m + j - 1`` tokens that agree, and the rate is learned by that length, in the n-gram source's
copy-length bins (a ``RateTable``, learned every round from the offer on the table, drafted or
not, as the n-gram source learns its copies). An agent's request that asks again for code an
earlier reply wrote finds that reply's place after dozens of agreeing tokens, where a chance
match of four goes on far less often; one rate for both would draft neither at length. A
continuation seen once leans on that record; one seen forty times in forty places speaks for
itself. The chooser weighs it like any other source.
"""

from __future__ import annotations

import itertools
import threading
from array import array
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from specrun.decode.round import Continuations, History, Proposal, Round
from specrun.decode.sampling import Dist
from specrun.decode.sources.base import PRIOR_WEIGHT, RateTable
from specrun.decode.sources.ngram import COPY_BINS, MIN_MATCH, OCCURRENCES, copy_bin

N = MIN_MATCH  # tail tokens looked up: fewer may match by chance (ngram.py, with OCCURRENCES)
MATCH_CAP = 32  # how far back a place's context is compared with the tail's: the places that match
# this far are the evidence (trades: more places to count, against places less like this context)
BYTES_PER_TOKEN = 256  # what the index holds per stored token in CPython, counted high: the token, its
# N-gram's entry and place take 180 bytes on random text (the worst case: every N-gram new), and a dict
# does not shrink as texts are removed (tests/test_suffix.py measures it with tracemalloc)
_SHIFT = 20  # bits per token in an N-gram's key (vocabularies under a million tokens)


def _key(tokens: Sequence[int]) -> int:
    key = 0
    for t in tokens:
        key = key << _SHIFT | t
    return key


class SuffixIndex:
    """Texts (earlier replies' tokens), and where each N tokens of them occur; thread-safe (the
    server adds a finished reply while other requests look theirs up)."""

    def __init__(self) -> None:
        self.texts: dict[int, array] = {}
        self.places: dict[int, array] = {}  # N-gram key -> (text id << 32 | the offset after it), latest last
        self.tokens = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        """What the index holds, as counted: BYTES_PER_TOKEN a stored token."""
        return self.tokens * BYTES_PER_TOKEN

    def add(self, tokens: Sequence[int], start: int = 0) -> int:
        """Store a text; returns its id (for ``remove``). Its tokens before ``start`` are context
        only (the prompt's tail before a reply): matched, never offered, so the start of a
        reply to a prompt that ends alike is offered too."""
        with self._lock:
            i = next(self._ids)
            text = self.texts[i] = array("i", tokens)
            self.tokens += len(text)
            for end in range(max(N, start), len(text)):
                key, place = _key(text[end - N : end]), i << 32 | end
                seen = self.places.get(key)
                if seen is None:
                    self.places[key] = array("q", (place,))
                else:
                    seen.append(place)
                    if len(seen) > OCCURRENCES:
                        del seen[0]
            return i

    def remove(self, i: int) -> None:
        """Forget a text and its places."""
        with self._lock:
            text = self.texts.pop(i, None)
            if text is None:
                return
            self.tokens -= len(text)
            for end in range(N, len(text)):
                key = _key(text[end - N : end])
                seen = self.places.get(key)
                if seen is None:
                    continue
                kept = array("q", (p for p in seen if p >> 32 != i))
                if kept:
                    self.places[key] = kept
                else:
                    del self.places[key]

    def continuation(self, tail: Sequence[int], most: int) -> tuple[list[int], list[tuple[int, int]], int]:
        """What the places matching ``tail`` furthest back went on with, up to ``most`` tokens:
        each token the one most of them wrote next, with (how many wrote it, how many reached it);
        and how far back those places match the tail (N to MATCH_CAP; 0: no place)."""
        places: list[tuple[array, int]]
        if len(tail) < N or most <= 0:
            return [], [], 0
        with self._lock:
            seen = self.places.get(_key(tail[-N:]))
            if not seen:
                return [], [], 0
            best, places = 0, []  # the longest match back, and the places that have it
            for p in seen:
                text, at = self.texts[p >> 32], p & 0xFFFFFFFF
                m = N
                while m < MATCH_CAP and m < at and m < len(tail) and text[at - 1 - m] == tail[-1 - m]:
                    m += 1
                if m > best:
                    best, places = m, []
                if m == best:
                    places.append((text, at))
            out: list[int] = []
            counts: list[tuple[int, int]] = []
            while places and len(out) < most:
                nxt = Counter(text[at] for text, at in places if at < len(text))
                if not nxt:
                    break
                token, hits = max(nxt.items(), key=lambda kv: (kv[1], -kv[0]))  # (a tie: the smaller id, for the same answer every time)
                out.append(token)
                counts.append((hits, len(places)))
                places = [(text, at + 1) for text, at in places if at < len(text) and text[at] == token]
            return out, counts, best


class SuffixSource:
    """The chooser's view of an index of earlier replies: the continuation on offer and its counts."""

    name = "suffix"

    def __init__(self, history: History, ends_turn: Callable[[int], bool] | None = None):
        """``history``: the engine's record of this reply's index (read at each ``begin``);
        ``ends_turn(token)``: does the target stop at it? (an offer ends there)"""
        self.history = history
        self.ends_turn = ends_turn if ends_turn is not None else (lambda t: False)
        self.index: Continuations | None = None
        self.offer: list[int] = []
        self.counts: list[tuple[int, int]] = []
        self.match = 0  # how far back the offer's places matched the tail
        self.rates = RateTable(len(COPY_BINS))  # how often an offered token has gone on (decayed), by
        # the length of the context that agreed before it: the prior of the counts

    def looked_up(self) -> Continuations | None:
        """Where this source looks (read at each ``begin``): the tenant's earlier replies."""
        return self.history.index

    def begin(self, prompt: list[int], may_draft: Callable[[], bool]) -> None:
        self.index, self.offer, self.counts, self.match = self.looked_up(), [], [], 0

    def prepare(self, tokens: list[int], room: int, left: int) -> int:
        self.offer, self.counts, self.match = self.index.continuation(tokens, room) if self.index is not None else ([], [], 0)
        end = next((i + 1 for i, t in enumerate(self.offer) if self.ends_turn(t)), len(self.offer))
        self.offer, self.counts = self.offer[:end], self.counts[:end]
        return len(self.offer)

    def acceptance(self, k: int, rng: np.random.Generator | None) -> list[float]:
        """The means, never a draw: every round scores the offer, drafted or not (as the n-gram
        source's copies)."""
        rates = self.rates.means()
        return [(h + PRIOR_WEIGHT * rates[copy_bin(self.match + j)]) / (c + PRIOR_WEIGHT) for j, (h, c) in enumerate(self.counts[:k])]

    def cost(self, k: int | np.ndarray) -> float:
        return 0.0

    def propose(
        self, tokens: list[int], k: int, worth: float, offered: int = 0, verify: Sequence[float] = (),
        rival: Callable[[list[int]], float] | None = None,
    ) -> Proposal:  # fmt: skip
        run = self.offer[:k]
        return Proposal(run, [Dist.one_hot(t) for t in run])

    def peek(self, seq: list[int], room: int) -> list[float]:
        return []  # a lookup per drafted token of another source would cost more than it tells

    def observe(self, outcome: Round) -> None:
        """Score the offer (used or not) against what was written, up to its first miss."""
        self.rates.decay()
        for j, (x, y) in enumerate(zip(self.offer, outcome.emitted)):
            self.rates.bins[copy_bin(self.match + j)].add(x == y)
            if x != y:
                break

    def rollback(self, keep: int) -> None:
        pass

    def to_json(self) -> dict:
        return {"bins": list(COPY_BINS), **self.rates.to_json()}

    def load(self, d: dict) -> None:
        """Stored rates by context length, as a prior (an older store's one rate, or other bins:
        left out)."""
        if isinstance(d, dict) and list(d.get("bins", ())) == list(COPY_BINS):
            self.rates.load(d)


class CorpusSource(SuffixSource):
    """The same lookup in a corpus of files every tenant shares (``serve --suffix-corpus``): a
    source of its own, so that its record is learned apart from the replies' (a repository's
    files and an agent's replies go on alike at different rates) and what each drafted and had
    accepted is counted apart."""

    name = "corpus"

    def looked_up(self) -> Continuations | None:
        return self.history.corpus
