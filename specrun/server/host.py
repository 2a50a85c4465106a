"""The engine host: ``parallel`` slots serve requests from a bounded queue, in arrival order.

With one slot (``parallel`` 1), one thread owns the loaded pair and serves one request at a
time. With N, the pair was loaded with N sequences in one context (``LoadOptions.n_seq_max``):
slot i is sequence i of the target (and of the draft), each with a thread and engines of its
own, and their decodes meet in one :class:`specrun.llama.Gate`, which runs each step's rows
of every active sequence as one batch. A new request goes to the free slot whose last request
shares the longest prefix with it, so its cached tokens are reused.

A request is a :class:`Job`. The HTTP side submits it (refused at once when the queue is full
or the server is stopping) and reads what the engine thread posts back, in order:

* ``("start", Start)`` once the prompt is tokenized and fits (the stream's headers can go out);
* ``("event", Event)`` per round, from :func:`specrun.stream.stream_generate` (the last one
  carries the finish reason); a job that does not stream gets only the last event, with the
  whole text;
* or ``("error", exc)`` instead, at any point.

A streaming job's reader calls ``Job.delivered()`` once it has sent an event on, and the engine
waits for that (up to ``ACK_WAIT_S``) before its next round: the HTTP side's work then happens
while the engine is idle, not while llama.cpp's threads decode. On a machine whose cores all
decode, a thread that wakes up mid-decode stalls the whole decode by a scheduler time slice;
handing over between rounds costs a fraction of a millisecond instead.

Setting ``Job.cancel`` (the client went away, the server is stopping) ends the generation
within one round, and frees its slot; a job cancelled while it waits is dropped when its turn
comes.

The KV cache is kept across requests. The engine's prefill already reuses the longest common
prefix of token ids; on top of that the host remembers the last request's text and tokens
(the reply as generated, not re-tokenized), so a request whose text extends the previous one
(the next chat turn, a completion that continues the last) keeps those tokens and tokenizes
only what is new, as `specrun chat` does. One engine serves each distinct combination of
drafting and sampling settings: they share the loaded models, the caches and the measured
costs, and each keeps its own chooser learning across the requests that use it.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from os.path import commonprefix
from typing import TYPE_CHECKING, Any, Protocol

from specrun.decode.batched import BatchCost
from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.round import common_prefix
from specrun.decode.sampling import Sampler
from specrun.decode.stats import RunStats
from specrun.errors import SpecrunError
from specrun.run.session import OpenPair
from specrun.run.stream import Event, stream_generate
from specrun.server.schemas import ApiError
from specrun.server.suffixes import Suffixes

if TYPE_CHECKING:
    from specrun.llama import Gate, Model, Sequence

__all__ = ["Busy", "Host", "Job", "Observer", "Request", "ShuttingDown", "Start"]

MAX_ENGINES = 8  # distinct per-request settings kept warm (each has its own chooser)
LONG_TEXT_CHARS = 32_768  # a prompt text longer than this is counted in pieces before it is tokenized whole
ACK_WAIT_S = 0.05  # longest wait for a streaming reader to send an event on (a slow client is not waited for)


@dataclass(frozen=True)
class Request:
    """A validated request, as the engine thread needs it."""

    kind: str  # "chat" | "completion"
    settings: Settings
    sampler: Sampler  # the request's own seed included (None: the engine's stream goes on)
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None  # None: up to the context
    limit_field: str = "max_tokens"  # how the request named the limit
    prompt_text: str | None = None  # the prompt as text (a chat's is its rendered template)
    prompt_ids: tuple[int, ...] = ()  # or a completion's prompt as token ids
    add_special: bool = True  # let the tokenizer add BOS (not when a template wrote it)
    prompt_field: str = "messages"
    prediction: str | None = None  # the text the reply is expected to mostly be (OpenAI's Predicted Outputs)
    tenant: str | None = None  # who sent it (see suffixes.tenant): its own earlier replies are drafted from


@dataclass(frozen=True)
class Start:
    n_prompt: int  # prompt tokens, cached ones included
    max_tokens: int  # the limit in force (capped at the context)
    notices: tuple[str, ...] = ()


@dataclass
class Job:
    request: Request
    post: Callable[[tuple[str, Any]], None]  # thread-safe: hands a message to the HTTP side
    label: str = ""  # for the terminal: "#3 chat 127.0.0.1"
    stream: bool = True  # False: only the last event is posted, with the whole text
    cancel: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued | running | done | cancelled | error
    stats: RunStats | None = None
    queued_at: float = field(default_factory=time.monotonic)
    # the reply's last event, posted once its slot is free: a client that sends its next turn as
    # soon as it reads this one finds the slot that holds the conversation free to take it
    last: tuple[str, Any] | None = None
    _sent: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0), repr=False)

    def delivered(self) -> None:
        """The reader has sent an event on (see ACK_WAIT_S)."""
        self._sent.release()


class Observer(Protocol):
    """The terminal's view of the host (called from the engine thread)."""

    def started(self, job: Job) -> None: ...
    def progress(self, job: Job) -> None: ...
    def finished(self, job: Job) -> None: ...
    def notice(self, text: str) -> None: ...


class Busy(Exception):
    """The queue is full."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server is busy: {waiting} requests are waiting (--max-queue)")
        self.waiting, self.retry_after = waiting, retry_after


class ShuttingDown(Exception):
    """The server is stopping and takes no new work."""


class _Quiet:
    def started(self, job: Job) -> None: ...
    def progress(self, job: Job) -> None: ...
    def finished(self, job: Job) -> None: ...
    def notice(self, text: str) -> None: ...


@dataclass(frozen=True)
class _Past:
    """The last request's text and the tokens that produced it (the reply as generated)."""

    text: str
    tokens: tuple[int, ...]
    prompt: int = 0  # how much of ``text`` was the request's own (the rest, its reply)


def _too_long(size: str, n_ctx: int, where: str, what: str = "prompt") -> ApiError:
    why = "with no room for a reply" if what == "prompt" else "longer than any reply could be"
    return ApiError(
        400,
        f"the {what} has {size} but the context holds {n_ctx}, {why}: shorten the {what}, or restart the server with a larger --ctx",
        where,
        "context_length_exceeded",
    )


@dataclass
class _Slot:
    """One sequence of the context, with what it serves: its models' views, its engines (one
    per settings, as Host.engines was), the last request's text and tokens per kind."""

    index: int
    target: Model | Sequence
    draft: Model | Sequence | None
    engines: OrderedDict[tuple[Settings, Sampler], Engine] = field(default_factory=OrderedDict)
    past: dict[str, _Past] = field(default_factory=dict)
    job: Job | None = None
    used: int = 0  # when it last took a job (a count): the least recently used is given away first


def _engine_key(settings: Settings, sampler: Sampler) -> tuple[Settings, Sampler]:
    return settings, dataclasses.replace(sampler, seed=None)


class Host:
    def __init__(
        self,
        pair: OpenPair,
        engine: Engine,
        *,
        max_queue: int = 16,
        observer: Observer | None = None,
        on_finish: Callable[[RunStats], None] | None = None,
        parallel: int = 1,
        gate: Gate | None = None,
        suffixes: Suffixes | None = None,
    ):
        """``parallel`` > 1 needs the pair loaded with that many sequences and the ``gate``
        their decodes meet in; ``engine`` (on the pair itself) then lends its learned state to
        each slot's first engine. ``suffixes``: where each tenant's replies are kept, to draft
        the next ones from, with the corpus every tenant drafts from (None: nowhere)."""
        self.pair = pair
        self.cost = engine.cost
        self.base_key = _engine_key(engine.settings, engine.sampler)
        self.gate = gate if parallel > 1 else None
        self.cost_lock = threading.RLock()  # the slots' threads share the verify curve
        if parallel > 1:
            assert gate is not None, "parallel slots need the gate their decodes meet in"
            from specrun.llama import Sequence

            self.slots = [
                _Slot(i, Sequence(pair.target, i, gate), Sequence(pair.draft, i, gate) if pair.draft is not None else None)
                for i in range(parallel)
            ]
            learned = engine.learned()
            for slot in self.slots:
                slot.engines[self.base_key] = Engine(
                    slot.target,  # type: ignore[arg-type]  # a Sequence is the Model surface the engine uses
                    slot.draft,  # type: ignore[arg-type]
                    engine.settings,
                    engine.sampler,
                    self._cost(slot),
                    learned=learned,
                )
        else:
            self.slots = [_Slot(0, pair.target, pair.draft)]
            self.slots[0].engines[self.base_key] = engine
        self.max_queue = max_queue
        self.suffixes = suffixes
        self.observer: Observer = observer or _Quiet()
        self.on_finish = on_finish
        self.cond = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.stopping = False
        self.durations: deque[float] = deque(maxlen=16)  # recent requests' seconds, for Retry-After
        self.ids = itertools.count(1)
        self.ids_used = itertools.count(1)
        self.count_lock = threading.Lock()  # ... and the counters of finished requests
        self.warned: set[str] = set()
        self.threads = [
            threading.Thread(target=self._run, args=(slot,), name=f"specrun-engine{slot.index or ''}", daemon=True) for slot in self.slots
        ]

    @property
    def engine(self) -> Engine:
        """The server's own settings' engine (slot 0's): what it learned is stored at the end."""
        return self.slots[0].engines[self.base_key]

    @property
    def running(self) -> list[Job]:
        return [s.job for s in self.slots if s.job is not None]

    # --- the HTTP side --------------------------------------------------------------------

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` in arrival order; raise Busy or ShuttingDown instead of queueing."""
        with self.cond:
            if self.stopping:
                raise ShuttingDown()
            busy = all(s.job is not None for s in self.slots) or bool(self.waiting)
            if busy and len(self.waiting) >= self.max_queue:
                raise Busy(len(self.waiting), self.retry_after())
            self.waiting.append(job)
            self._dispatch()

    def _dispatch(self) -> None:
        """Hand waiting jobs to free slots, each to the one whose last request shares the
        longest prefix with it (under self.cond)."""
        while self.waiting:
            free = [s for s in self.slots if s.job is None]
            if not free:
                return
            job = self.waiting.popleft()
            if job.cancel.is_set():  # its client left while it waited
                job.state = "cancelled"
                continue
            slot = max(free, key=lambda s: (_reuse(s, job.request), -s.used))
            slot.job, slot.used = job, next(self.ids_used)
            self.cond.notify_all()

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the queue ahead times a recent request's time."""
        typical = sorted(self.durations)[len(self.durations) // 2] if self.durations else 5.0
        return max(1, min(600, round(typical * (len(self.waiting) // len(self.slots) + 1))))

    def queue_length(self) -> int:
        return len(self.waiting)

    def busy(self) -> bool:
        return any(s.job is not None for s in self.slots)

    def stop(self) -> None:
        """Take no new work, end the running generation within a round, refuse the waiting."""
        with self.cond:
            self.stopping = True
            for job in self.running:
                job.cancel.set()
            dropped = list(self.waiting)
            self.waiting.clear()
            self.cond.notify_all()
        for job in dropped:
            job.state = "cancelled"
            job.post(("error", ShuttingDown()))

    def join(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            if t.is_alive():
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    # --- the engine thread ----------------------------------------------------------------

    def _run(self, slot: _Slot) -> None:
        while True:
            with self.cond:
                while slot.job is None and not self.stopping:
                    self.cond.wait()
                job = slot.job
                if job is None:
                    return
            t0 = time.monotonic()
            try:
                self._serve(slot, job)
            finally:
                with self.cond:
                    slot.job = None
                    self._dispatch()
                if job.last is not None:
                    job.post(job.last)
                self.durations.append(time.monotonic() - t0)

    def _serve(self, slot: _Slot, job: Job) -> None:
        req = job.request
        job.state = "running"
        self.observer.started(job)
        stats: RunStats | None = None
        joined = False
        try:
            engine = self._engine(slot, req.settings, req.sampler)
            tokens, text = self._prompt(slot, req)
            n_ctx = self.pair.target.n_ctx
            if len(tokens) >= n_ctx:
                raise _too_long(f"{len(tokens)} tokens", n_ctx, req.prompt_field)
            self._share_prefix(slot, tokens)
            room = n_ctx - len(tokens)
            limit = room if req.max_tokens is None else min(req.max_tokens, room)
            notices: tuple[str, ...] = ()
            if req.max_tokens is not None and req.max_tokens > room:
                notices = (
                    f"{req.limit_field} {req.max_tokens} capped at {room}: the prompt takes {len(tokens)} of the {n_ctx}-token context",
                )
            predicted = self._predicted(req)
            who, kept = req.tenant, self.suffixes
            history = kept.index(who) if kept is not None and who is not None else None  # the tenant's earlier replies
            corpus = kept.corpus if kept is not None else None  # ... and the files every tenant shares
            if req.sampler.seed is not None:
                engine.reseed(req.sampler.seed)
            job.post(("start", Start(len(tokens), limit, notices)))
            out: list[int] = []
            said: list[str] = []
            event: Event | None = None
            if self.gate is not None:  # from here on, the other slots' decodes wait for this one's
                self.gate.join()
                joined = True
            for event in stream_generate(
                engine, tokens, limit, stop=req.stop, cancel=job.cancel, prediction=predicted, history=history, corpus=corpus
            ):
                stats = job.stats = event.stats
                out.extend(event.tokens)
                said.append(event.text)
                if event.finish_reason is not None:  # counted before the client hears of it
                    self._count(stats)
                    stats = None
                if event.finish_reason is not None:  # posted once the slot is free (see Job.last)
                    job.last = ("event", event if job.stream else dataclasses.replace(event, text="".join(said), segments=()))
                elif job.stream:
                    job.post(("event", event))
                    job._sent.acquire(timeout=ACK_WAIT_S)
                self.observer.progress(job)
            reason = event.finish_reason if event is not None else "interrupted"
            job.state = "cancelled" if reason == "interrupted" else "done"
            if kept is not None and who is not None:
                kept.add(who, out, tokens)
            self._remember(slot, req, text, tokens, out, "".join(said), reason)
        except (SpecrunError, ApiError) as e:
            job.state = "error"
            job.post(("error", e))
        except Exception as e:  # a bug: the client gets a 500, the server goes on
            job.state = "error"
            job.post(("error", e))
            self.observer.notice(f"internal error in {job.label}: {type(e).__name__}: {e}")
        finally:
            if joined:
                self.gate.leave()  # type: ignore[union-attr]
            if stats is not None:  # ended by an error: count what was done
                self._count(stats)
            self.observer.finished(job)

    def _count(self, stats: RunStats) -> None:
        if self.on_finish is not None:
            with self.count_lock:
                self.on_finish(stats)

    def _engine(self, slot: _Slot, settings: Settings, sampler: Sampler) -> Engine:
        """The slot's engine for these settings (made on first use, sharing the models and costs)."""
        settings = self.pair.settings_for(settings)
        key = _engine_key(settings, sampler)
        engines = slot.engines
        engine = engines.get(key)
        if engine is None:
            engine = Engine(
                slot.target,  # type: ignore[arg-type]
                slot.draft,  # type: ignore[arg-type]
                settings,
                dataclasses.replace(sampler, seed=None),
                self._cost(slot),
                heads=self.pair.heads,
                eagle3=self.pair.eagle3,
                dflash=self.pair.dflash,
            )
            if settings.sources and not settings.fixed and not self.cost.verify:
                self.observer.notice("measuring this machine's verify costs once (cached for next time)...")
                engine.calibrate()
            engines[key] = engine
            while len(engines) > MAX_ENGINES:  # the least recently used, never the server's own
                old = next(k for k in engines if k != self.base_key)
                del engines[old]
        engines.move_to_end(key)
        return engine

    def _cost(self, slot: _Slot) -> CostModel:
        """The shared verify curve, as the slot's engines price a verify: alone, the curve
        itself; in a batch, what its rows add to the batch (see specrun.batched)."""
        if self.gate is None:
            return self.cost
        return BatchCost(self.cost, slot.target, self.cost_lock)  # type: ignore[arg-type,return-value]  # Sequence has the rows; a CostModel's surface

    def warn(self, msg: str) -> None:
        """A template's fallback and the like, once each, on the terminal."""
        if msg not in self.warned:
            self.warned.add(msg)
            self.observer.notice(f"warning: {msg}")

    def _share_prefix(self, slot: _Slot, tokens: list[int]) -> None:
        """Where an idle slot holds more of ``tokens``' start than this one (an agent's next
        request: the same system prompt and file, a new question), take that prefix from it,
        target and draft alike: the cells are shared, not decoded again, and the other slot keeps
        its conversation for a request that goes on with it."""
        if self.gate is None:  # one sequence: nothing to share
            return
        limit = len(tokens) - 1  # the last token is evaluated by the first round
        with self.cond:  # no job is handed to the idle slots meanwhile (this slot is not idle)
            idle = [o for o in self.slots if o.job is None]
            if not idle:
                return
            for view in ("target", "draft"):
                mine: Sequence | None = getattr(slot, view)
                if mine is None:
                    continue
                held = [(common_prefix(getattr(o, view).tokens, tokens, limit=limit), getattr(o, view)) for o in idle]
                n, source = max(held, key=lambda h: h[0])
                if n > common_prefix(mine.tokens, tokens, limit=limit):
                    mine.take_prefix(source, n)

    def _prompt(self, slot: _Slot, req: Request) -> tuple[list[int], str | None]:
        """The request's token ids, and its text (None when it came as token ids)."""
        target = self.pair.target
        if req.prompt_text is None:
            bad = [t for t in req.prompt_ids if not 0 <= t < target.n_vocab]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{target.n_vocab - 1})", "prompt")
            return list(req.prompt_ids), None
        text = req.prompt_text
        past = slot.past.get(req.kind)
        if past is not None and len(text) > len(past.text) and text.startswith(past.text):
            # the previous request's text, extended: keep its tokens, tokenize only the new text
            self._check_length(text[len(past.text) :], len(past.tokens), req.prompt_field)
            return list(past.tokens) + target.tokenize(text[len(past.text) :], add_special=False, parse_special=True), text
        self._check_length(text, 0, req.prompt_field)
        tokens = target.tokenize(text, add_special=req.add_special, parse_special=True)
        if not tokens:
            raise ApiError(400, "the prompt is empty", req.prompt_field)
        return tokens, text

    def _predicted(self, req: Request) -> list[int]:
        """The prediction's token ids ([]: none), read as the model's own text is (its special
        tokens included); one longer than the context is refused, since no reply could follow
        it to its end."""
        if req.prediction is None:
            return []
        self._check_length(req.prediction, 0, "prediction", "prediction")
        tokens = self.pair.target.tokenize(req.prediction, add_special=False, parse_special=True)
        n_ctx = self.pair.target.n_ctx
        if len(tokens) > n_ctx:
            raise _too_long(f"{len(tokens)} tokens", n_ctx, "prediction", "prediction")
        return tokens

    def _check_length(self, text: str, n_before: int, where: str, what: str = "prompt") -> None:
        """Refuse a text far too long for the context before tokenizing it whole: llama.cpp's
        tokenizer splits the text at every special token it holds, copying the rest each time,
        so a few MB of ``<|im_start|>`` turns would take minutes. The text is counted in
        pieces cut at line ends, stopping once the count is surely past the context (a cut
        adds at most a token or two to the count)."""
        if len(text) <= LONG_TEXT_CHARS:
            return
        n_ctx, tokenize = self.pair.target.n_ctx, self.pair.target.tokenize
        n, pos, pieces = n_before, 0, 0
        while pos < len(text):
            end = min(len(text), pos + LONG_TEXT_CHARS)
            if end < len(text):
                cut = text.rfind("\n", pos + 1, end)
                end = cut if cut > pos else end
            n += len(tokenize(text[pos:end], add_special=False, parse_special=True))
            pieces += 1
            pos = end
            if n > n_ctx + 4 * pieces:
                raise _too_long(f"over {n - 4 * pieces} tokens", n_ctx, where, what)

    def _remember(
        self, slot: _Slot, req: Request, text: str | None, tokens: list[int], out: list[int], reply: str, reason: str | None
    ) -> None:
        past = slot.past
        if text is None:
            past.pop(req.kind, None)
            return
        if reason == "stop_string":  # tokens past the stop string are not in the text: keep the prompt only
            past[req.kind] = _Past(text, tuple(tokens), len(text))
            return
        eog = self.pair.target.is_eog
        past[req.kind] = _Past(text + reply, tuple(tokens) + tuple(t for t in out if not eog(t)), len(text))

    def next_id(self) -> int:
        return next(self.ids)


def _reuse(slot: _Slot, req: Request) -> int:
    """How much of what the slot holds ``req`` would reuse (characters of text, or token ids of
    a prompt given as ids), or -1 if it would throw away more than half of it: a request that
    shares only a chat template's opening with a conversation does not evict it, but goes to
    an empty slot or, failing that, the least recently used one. A request that holds the
    slot's last request whole (a regenerate, or its last reply edited) reuses it whatever it
    throws away: it replaces that reply, and its prompt then comes from the same cache, so its
    greedy text is the one the same prompt got there before."""
    if req.prompt_text is not None:
        past = slot.past.get(req.kind)
        held = len(past.text) if past is not None else 0
        keep = len(commonprefix([past.text, req.prompt_text])) if past is not None else 0
        if past is not None and past.prompt and keep >= past.prompt:
            return keep
    else:
        held = slot.target.n_past
        keep = common_prefix(slot.target.tokens, list(req.prompt_ids))
    return keep if 2 * keep >= held else -1
