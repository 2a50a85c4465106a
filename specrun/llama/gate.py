"""Several sequences in one context: their decodes meet in one batch at the gate."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import llama_cpp as ll
import numpy as np

from specrun.errors import BackendError
from specrun.llama.model import Ask, Model, RollbackStats

T = TypeVar("T")


def on_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread that ends when it returns (its exception re-raised here).

    For llama.cpp work done once on a thread other than the one that will decode from then on
    (the server's calibration, before its engine thread takes over). llama.cpp's CPU backend
    (an OpenMP build) keeps a team of worker threads for every thread that ever decoded, until
    that thread ends; once a process holds more of them than there are cores, libgomp stops
    spinning at the barriers between a graph's operations, and each decode pays for sleeping
    and waking at every one of them. Measured on 2 cores: a decode loop on a second thread after
    the first had decoded ran at 12.2 tok/s against 16.2 (15.5 after the first thread ended)."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001  # handed back to the caller as it was
            err.append(e)

    t = threading.Thread(target=run, name="specrun-once")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


class Gate:
    """Where the threads of several sequences meet to decode together.

    Each member (a sequence being generated, one thread each) asks for its decodes here and
    blocks. Once every member is waiting, the gate's own thread runs a pass: per model with
    asks, ONE ``llama_decode`` holding every waiting sequence's rows (as many as fit
    ``n_batch`` and ``n_outputs_max``; the rest go in the next pass), then each gets its rows'
    logits. There are no timers: a member that leaves (its request finished or was cancelled)
    no longer counts, and one that waits for the other model (a draft step while others
    verify) counts as waiting, so some pass can always run. Everything that touches the shared
    cache (a decode, a rollback) happens under the gate's lock.

    Every pass runs on that one thread (see :func:`on_own_thread`): were each member to run the
    passes it completes, every member thread would keep an OpenMP team of llama.cpp's threads,
    and past one team per core's worth, every decode runs slower."""

    def __init__(self):
        self.cond = threading.Condition()
        self.members = 0
        self.waiting = 0
        self.pending: dict[int, list[Ask]] = {}  # id(model) -> asks, oldest first
        self.passes = 0  # passes run, and the rows they carried: for tests and the bench
        self.rows = 0
        self._runner: threading.Thread | None = None  # started at the first decode

    def join(self) -> None:
        with self.cond:
            self.members += 1

    def leave(self) -> None:
        with self.cond:
            self.members -= 1
            self.cond.notify_all()  # the others may all be waiting now

    def decode(self, ask: Ask) -> Ask:
        with self.cond:
            if self._runner is None:
                self._runner = threading.Thread(target=self._run, name="specrun-gate", daemon=True)
                self._runner.start()
            self.pending.setdefault(id(ask.model), []).append(ask)
            self.waiting += 1
            self.cond.notify_all()
            try:
                while not ask.done:
                    self.cond.wait()
            finally:
                self.waiting -= 1
        return ask

    def _run(self) -> None:
        """The gate's thread: a pass whenever every member waits (and someone asked). It ends
        once nobody is a member or waits (between requests), and the next decode starts
        another: a thread that has ended holds no OpenMP team."""
        with self.cond:
            while True:
                while not (self.waiting >= self.members and any(self.pending.values())):
                    if self.members == 0 and self.waiting == 0:
                        self._runner = None
                        return
                    self.cond.wait()
                try:
                    self._pass()
                except Exception as e:  # a bug: the asks it leaves hear of it, and the gate goes on
                    for asks in self.pending.values():
                        for a in asks:
                            a.error, a.done = BackendError(f"decode failed: {type(e).__name__}: {e}"), True
                        asks.clear()
                self.cond.notify_all()

    def _pass(self) -> None:
        for asks in self.pending.values():
            if not asks:
                continue
            model = asks[0].model
            take, rows, outs = 0, 0, 0
            for a in asks:
                if take and (rows + len(a.tokens) > model.n_batch or outs + a.n_out > model.opts.n_outputs_max):
                    break
                take, rows, outs = take + 1, rows + len(a.tokens), outs + a.n_out
            batch = asks[:take]
            del asks[:take]
            model._decode_many(batch)
            self.passes += 1
            self.rows += rows


class Sequence:
    """One sequence of a Model loaded with ``n_seq_max`` > 1: what the engine and the draft
    sources use of a Model (eval, rollback, the vocabulary...), its decodes run through the
    Gate with the other sequences', its rollbacks on its own sequence id. Only attention caches
    (rollback by trimming) are shared this way."""

    rollback_method = "trim"
    draft_limit = None
    heads = eagle3 = dflash = None

    def __init__(self, model: Model, seq: int, gate: Gate):
        if not 0 <= seq < model.opts.n_seq_max:
            raise ValueError(f"sequence {seq} of a context with {model.opts.n_seq_max}")
        self.model, self.seq, self.gate = model, seq, gate
        self.tokens: list[int] = []
        self.decode_s = 0.0  # seconds in the batches this sequence rode in
        self.batch_rows = 0  # rows of the last batch it rode in, its own included
        self.own_rows = 0  # ... and how many of them were its own
        self.rollback_stats = RollbackStats()
        with gate.cond:
            ll.llama_memory_seq_rm(model._mem, seq, -1, -1)

    def __getattr__(self, name: str):  # the vocabulary, n_ctx, n_batch, n_vocab, path, opts...
        return getattr(self.model, name)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def eval(self, tokens: list[int], logits: str = "last") -> np.ndarray | None:
        """As Model.eval, for this sequence; the rows are a copy (the batch held others too)."""
        if not tokens:
            raise ValueError("eval() needs at least one token")
        m = self.model
        if self.n_past + len(tokens) > m.n_ctx:
            raise BackendError(f"context full: {self.n_past} + {len(tokens)} tokens exceed {{n_ctx}} {m.n_ctx}", "raise {n_ctx}")
        if logits == "all" and len(tokens) > min(m.n_batch, m.opts.n_outputs_max):
            raise ValueError("logits='all' is limited to n_outputs_max tokens")
        rows = None
        for start in range(0, len(tokens), m.n_batch):
            chunk = tokens[start : start + m.n_batch]
            last_chunk = start + m.n_batch >= len(tokens)
            ask = self.gate.decode(Ask(m, self.seq, chunk, self.n_past, logits if last_chunk else "none"))
            self.decode_s += ask.seconds
            self.batch_rows, self.own_rows = ask.batch_rows, len(chunk)
            if ask.error is not None:
                raise ask.error
            self.tokens.extend(chunk)
            rows = ask.rows
        return rows

    def eval_last(self, tokens: list[int]) -> np.ndarray:
        rows = self.eval(tokens, logits="last")
        assert rows is not None
        return rows[0]

    def checkpoint(self, full: bool = False) -> None:
        """Free: an attention cache rolls back by trimming."""

    def rollback(self, n_past: int) -> None:
        if n_past >= self.n_past:
            return
        t0 = time.perf_counter()
        with self.gate.cond:
            ok = ll.llama_memory_seq_rm(self.model._mem, self.seq, n_past, -1)
        if not ok:
            raise BackendError(f"llama.cpp refused to roll {self.model.path.name}'s cache back to {n_past}", "use {draft} none")
        del self.tokens[n_past:]
        self.rollback_stats.trims += 1
        self.rollback_stats.seconds += time.perf_counter() - t0

    def reset(self) -> None:
        with self.gate.cond:
            ll.llama_memory_seq_rm(self.model._mem, self.seq, -1, -1)
        self.tokens = []

    def take_prefix(self, other: Sequence, n: int) -> None:
        """Hold ``other``'s first ``n`` tokens in place of what this sequence held: their cells in
        the shared cache gain this sequence's id (no decode), so both go on from them. ``other``
        must be idle (no decode or rollback of its own meanwhile)."""
        if other.model is not self.model or not 0 < n <= other.n_past:
            raise ValueError("a prefix is taken from an idle sequence of the same context, within what it holds")
        with self.gate.cond:
            ll.llama_memory_seq_rm(self.model._mem, self.seq, -1, -1)
            ll.llama_memory_seq_cp(self.model._mem, other.seq, self.seq, 0, n)
        self.tokens = list(other.tokens[:n])
