"""The stream layer: the engine's rounds as a stream of frozen events, for every front end.

``stream_generate`` wraps ``Engine.generate`` (which yields token ids per round) and is the only
place that turns tokens into text. Each :class:`Event` carries the text the round completed
(never half a UTF-8 character, never any part of a stop string), the round's token ids,
which of them came from an accepted draft (and from which source, and whether from a token
tree's branch other than its trunk), a snapshot of the run's statistics, and on the last event
the ``finish_reason``:

* ``stop``: the model ended its turn (an end-of-generation token, left out of the text);
* ``length``: ``max_tokens`` were generated;
* ``context``: the context is full;
* ``stop_string``: one of the ``stop`` strings appeared (it and what follows are not emitted);
* ``interrupted``: the ``cancel`` event was set (a signal, a client that went away).

A stop string may span rounds: text that could be the start of one is held back until the
next round shows whether it is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

from specrun.decode.engine import Engine
from specrun.decode.round import Continuations
from specrun.decode.stats import RunStats
from specrun.run.text import Utf8Stream

__all__ = ["Detokenizer", "Event", "stream_generate", "stop_scan"]


@dataclass(frozen=True)
class Event:
    text: str  # new text
    tokens: tuple[int, ...]  # this round's token ids (an end-of-generation token included)
    from_draft: tuple[bool, ...]  # per token: was it a draft the target accepted?
    stats: RunStats  # the run so far (a snapshot: later rounds do not change it)
    finish_reason: str | None = None  # set on the last event only
    # ``text`` cut into runs of (text, the source of the accepted drafts it came from, or None
    # for the target's own tokens, whether those drafts were off a token tree's trunk: a branch
    # other than the first won), for a display that tints them
    segments: tuple[tuple[str, str | None, bool], ...] = ()


def stop_scan(text: str, stops: Sequence[str]) -> tuple[int, bool]:
    """How much of ``text`` may be emitted, and whether a stop string was found there: up to
    the first stop string, or else all but a tail that could be the start of one."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return min(hits), True
    return len(text) - max((_overlap(text, s) for s in stops), default=0), False


def _overlap(text: str, stop: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


Mark = Optional[tuple[str, bool]]  # a token's: (the draft source, off a tree's trunk), None: the target's own
Segments = list[tuple[str, Mark]]  # runs of (text, mark)


def _take(segments: Segments, n: int) -> tuple[Segments, Segments]:
    """Split runs of (text, mark) after ``n`` characters."""
    head: Segments = []
    for i, (text, flag) in enumerate(segments):
        if n <= 0:
            return head, segments[i:]
        if len(text) <= n:
            head.append((text, flag))
            n -= len(text)
        else:
            head.append((text[:n], flag))
            return head, [(text[n:], flag), *segments[i + 1 :]]
    return head, []


def _event(segments: Segments, tokens, marks: Sequence[Mark], stats: RunStats, reason: str | None = None) -> Event:
    merged: Segments = []
    for text, mark in segments:
        if merged and merged[-1][1] == mark:
            merged[-1] = (merged[-1][0] + text, mark)
        elif text:
            merged.append((text, mark))
    runs = tuple((text, mark[0], mark[1]) if mark else (text, None, False) for text, mark in merged)
    flags = tuple(m is not None for m in marks)
    return Event("".join(t for t, _ in merged), tuple(tokens), flags, stats.snapshot(), reason, runs)


class Detokenizer:
    """Token ids in, text out: never half a UTF-8 character, never any part of a stop string.

    ``feed`` takes one round's tokens (with, per token, a mark: which accepted draft it was, or
    None) and returns the runs of (text, mark) now safe to show, and whether a stop string
    ended the text."""

    def __init__(self, piece: Callable[[int], bytes], is_eog: Callable[[int], bool], stops: Sequence[str] = ()):
        self.piece, self.is_eog = piece, is_eog
        self.stops = [s for s in stops if s]
        self.utf8 = Utf8Stream()
        self.pending: Segments = []  # decoded, not yet shown: it could start a stop string

    def feed(self, tokens: Sequence[int], marks: Sequence[Mark]) -> tuple[Segments, bool]:
        for t, mark in zip(tokens, marks):
            if not self.is_eog(t):
                self.pending.append((self.utf8.feed(self.piece(t)), mark))
        return self._release()

    def finish(self) -> tuple[Segments, bool]:
        """The end of the text: whatever was held back, unless it completes a stop string."""
        self.pending.append((self.utf8.flush(), None))
        out, hit = self._release()
        if not hit:
            out, self.pending = out + self.pending, []
        return out, hit

    def _release(self) -> tuple[Segments, bool]:
        n, hit = stop_scan("".join(t for t, _ in self.pending), self.stops)
        out, self.pending = _take(self.pending, n)
        if hit:
            self.pending = []
        return out, hit


def stream_generate(
    engine: Engine,
    prompt: list[int],
    max_tokens: int,
    *,
    stop: Sequence[str] = (),
    cancel: threading.Event | None = None,
    prediction: Sequence[int] = (),
    history: Continuations | None = None,
    corpus: Continuations | None = None,
) -> Iterator[Event]:
    """Generate from ``prompt`` token ids, one event per round, then a last event with the
    finish reason (its text is whatever was held back, possibly empty). ``prediction``: token
    ids the reply is expected to mostly be; ``history``, ``corpus``: earlier replies and files to
    draft from (see ``Engine.generate``)."""
    text = Detokenizer(engine.target.piece, engine.target.is_eog, stop)
    stats = RunStats()
    gen = engine.generate(prompt, max_tokens, cancel, stats, prediction, history, corpus)
    try:
        for step in gen:
            # the accepted drafts come first; of them, the last ``on_branch`` were off a tree's trunk
            trunk = step.round.accepted - step.round.on_branch
            marks: list[Mark] = [(step.round.source, i >= trunk) if i < step.n_from_draft else None for i in range(len(step.tokens))]
            out, hit = text.feed(step.tokens, marks)
            if hit:
                stats.finish_reason = "stop_string"
                yield _event(out, step.tokens, marks, stats, "stop_string")
                return
            yield _event(out, step.tokens, marks, stats)
    finally:
        gen.close()  # the engine's own finally records its finish reason and time
    out, hit = text.finish()
    stats.finish_reason = "stop_string" if hit else stats.finish_reason or "interrupted"
    yield _event(out, (), (), stats, stats.finish_reason)
