"""Draft heads beside a target's context: the built-in MTP heads, Gemma 4's assistant, an EAGLE-3 head."""

from __future__ import annotations

import ctypes
import time
from dataclasses import replace
from pathlib import Path

import llama_cpp as ll
import numpy as np
from llama_cpp import llama_cpp_ext as ll_ext

from specrun.errors import BackendError, UsageError
from specrun.llama.ffi import _ensure_init, _Log
from specrun.llama.model import LoadOptions, Model, _model_params


class DraftHead:
    """A draft head's context beside the target's, kept in step with its sequence: what the
    built-in MTP heads (:class:`MtpHeads`) and an EAGLE-3 head (:class:`Eagle3Head`) share.

    Such a head is fed, for the token at position p, something the target computed at p - 1
    (its *state* there), and guesses the token at p + 1. So:

    * **in step**: the head accounts for every position the target's cache holds (``n_past``
      equal). After each target decode the target calls :meth:`process`: each of its tokens,
      paired with the state before it (the first with the state the previous batch left, the
      others with this batch's rows), is queued for the head's cache;
    * **catching up lazily**: the queue is fed with the next draft step, in the same
      ``llama_process`` (or on its own once it fills a batch). A verify's rejected tokens are
      rolled back before that, so they are never fed at all: one head decode per drafting
      round instead of llama.cpp's two (a catch-up, then the first draft step). Chained MTP
      heads feed it on its own, to every head (:class:`MtpHeads`);
    * **drafting** (:meth:`draft_step`): the target's pending token at position ``n_past``
      with its last state gives the first guess; each guess, fed back with the head's own
      output state, gives the next. :meth:`end_draft` forgets those positions again;
    * **rollback** follows the target's (``Model.rollback``): the same prefix, queued or fed,
      and the state before it (the last accepted row of the verify batch).

    A subclass says what a state is (:meth:`_target_states`), how queued pairs go into a batch
    (:meth:`_put`) and where the pair for position p sits in its own cache: at ``p - shift``. A
    head without a cache of its own (``own_cache`` False: it attends over the target's, shared
    through ``ctx_other``) has nothing to queue, feed or roll back, and feeds every guess at the
    pending position (the target's cache holds nothing past it).
    """

    shift = 0
    own_cache = True
    what = "heads"  # for messages
    max_draft: int | None = None  # the longest draft it can make (None: no bound)

    def _follow(self, target: Model, ctx, n_state: int, n_embd: int) -> None:
        """Take over ``ctx`` (made by the subclass) as the head's context, and follow ``target``
        from position 0 (a target that decoded something already decodes it again)."""
        self.target = target
        self.n_ctx = target.n_ctx
        self.n_state = n_state  # the width of a target state
        self.n_embd = n_embd  # the width of the head's own input and output states
        self._ctx = ctx
        self._mem = ll.llama_get_memory(ctx)
        self._batch = ll.llama_batch_ext_init(ctx)
        self.n_batch = max(1, int(ll.llama_n_batch(ctx)))
        self._pos = (ll.llama_pos * 4)()  # one position per text token (the rest unused)
        self.process_s = 0.0  # seconds spent queueing and feeding the target's batches
        self.fed = 0  # tokens fed to the head's cache
        self.draft_s = 0.0  # seconds spent in draft steps (a first step's catch-up included)
        self.decodes = 0  # llama_process calls on the head's context
        self.reset()
        if target.n_past:  # attached after the target decoded something: start over with it
            tokens = list(target.tokens)
            target.reset()
            self._attach(True)
            target.eval(tokens, logits="none")
        self._attach(True)

    def _attach(self, on: bool) -> None:
        raise NotImplementedError

    # --- what a subclass provides ----------------------------------------------------

    def _target_states(self, n: int) -> np.ndarray:
        """The target's states for the n tokens of its last decode, (n, n_state)."""
        raise NotImplementedError

    def _put(self, entries: list[tuple[int, int, np.ndarray]], seed: tuple[int, int, np.ndarray] | None) -> int:
        """Put queued ``entries`` (token, position, state before it) into the batch, then the
        ``seed`` if given (a draft's first step, its logits wanted); the seed's batch index."""
        raise NotImplementedError

    # --- the target's states and the queue ------------------------------------------------

    def has_state_before(self, pos: int) -> bool:
        """Is the target's state at ``pos - 1`` at hand?"""
        return self._lo <= pos - 1 < self._lo + len(self._states)

    def state_before(self, pos: int) -> np.ndarray:
        return self._states[pos - 1 - self._lo]

    @property
    def cached(self) -> int:
        """Positions in the head's KV cache (llama.cpp's own count): ``n_past`` less the queue."""
        if not self.own_cache:
            return self.n_past
        return min(self.n_past, int(ll.llama_memory_seq_pos_max(self._mem, 0)) + 1 + self.shift)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def process(self, tokens: list[int], pos0: int) -> None:
        """The target just decoded ``tokens`` at ``pos0``...: keep its states, and queue every
        position the head lacks, each token with the state before it."""
        t0 = time.perf_counter()
        n = len(tokens)
        rows = self._target_states(n)
        before = self.state_before(pos0) if self.has_state_before(pos0) else None
        if pos0 > self.n_past or (before is None and self.n_past <= pos0):  # pragma: no cover - Model keeps them in step
            raise BackendError(f"the {self.what} lost step with the target (at {self.n_past}, batch at {pos0})", "use another {mode}")
        self._states = np.concatenate([before[None] if before is not None else np.zeros((0, self.n_state), np.float32), rows])
        self._lo = pos0 - (before is not None)
        # a batch re-decoding positions the head holds (a replay after a rollback, perhaps in
        # several decodes) keeps their entries, and those past it; a head with no pair for
        # position 0 (shift 1) counts it as held from the start
        for p in range(max(self.n_past, pos0, self.shift), pos0 + n) if self.own_cache else ():
            self._queue.append((tokens[p - pos0], p, self.state_before(p)))
        self.n_past = max(self.n_past, pos0 + n)
        if len(self._queue) >= self.n_batch:  # a batch's worth: feed it in one decode (keeping n_batch - 1 fed one a token)
            self._feed()
        self.process_s += time.perf_counter() - t0

    def _add(self, token: int, pos: int, h: np.ndarray, output: bool) -> int:
        """One row of the head's batch: ``token`` at its cache position ``pos``, with state ``h``."""
        b = self._batch
        idx = ll.llama_batch_ext_add_token(b, 0, token)
        if idx < 0:  # pragma: no cover - callers stay within n_batch
            raise BackendError(f"the {self.what}' batch refused token {token} (code {idx})")
        self._pos[0] = pos
        ll.llama_batch_ext_set_pos(b, idx, self._pos)
        row = np.ascontiguousarray(h, dtype=np.float32)
        embd = ll.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.size)
        if not ll.llama_batch_ext_set_embd_token(b, idx, embd):  # copies the row
            raise BackendError(f"the {self.what}' batch refused a state (its width differs from the model's)")
        if output:
            ll.llama_batch_ext_set_output_logits(b, idx, True)
        return idx

    def _take(self, limit: int) -> list[tuple[int, int, np.ndarray]]:
        """Up to ``limit`` queued entries, oldest first, out of the queue."""
        take = self._queue[:limit]
        del self._queue[: len(take)]
        self.fed += len(take)
        return take

    def _run(self, what: str, kind: int | None = None) -> None:
        self.decodes += 1
        rc = ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_DECODE if kind is None else kind, self._batch)
        ll.llama_batch_ext_clear(self._batch)
        if rc != 0:
            raise BackendError(f"the {self.what} failed to {what} (llama_process code {rc})", "use another {mode}")

    def _feed(self, keep: int = 0) -> None:
        """Feed the queue to the head's cache, leaving at most ``keep`` entries queued."""
        while len(self._queue) > keep:
            self._catch_up(self._take(min(self.n_batch, len(self._queue) - keep)))

    def _catch_up(self, entries: list[tuple[int, int, np.ndarray]]) -> None:
        """Decode queued ``entries`` (at most a batch) into the head's cache."""
        self._put(entries, None)
        self._run("catch up")

    # --- drafting -------------------------------------------------------------------

    def draft_step(self, token: int) -> np.ndarray:
        """Feed ``token`` at the next draft position (the first: the target's pending token at
        ``n_past``, with the target's last state, behind whatever is queued; then each guess
        with the head's own state); the head's logits for the position after it (a view,
        valid until the next step)."""
        t0 = time.perf_counter()
        if self._draft_pos is None and self.n_past < self.shift:
            raise BackendError(f"the {self.what} draft from the target's layers, and it has decoded nothing yet")
        idx, pos = self._draft_batch(token)
        self._run("draft")
        self._draft_pos = pos + 1
        self._draft_h = np.ctypeslib.as_array(ll_ext.llama_get_embeddings_nextn_ith(self._ctx, idx), shape=(self.n_embd,)).copy()
        logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, idx), shape=(self.target.n_vocab,))
        self.draft_s += time.perf_counter() - t0
        return logits

    def _draft_batch(self, token: int) -> tuple[int, int]:
        """Put a draft step's rows into the batch: (the batch index of the row whose logits
        are read, the draft position of ``token``)."""
        if self._draft_pos is None:
            self._feed(self.n_batch - 1)
            pos = self.n_past
            return self._put(self._take(self.n_batch - 1), (token, pos, self.state_before(pos))), pos
        assert self._draft_h is not None
        pos = self._draft_pos
        return self._add(token, pos - self.shift if self.own_cache else self.n_past, self._draft_h, True), pos

    def end_draft(self) -> None:
        """Forget the positions the draft steps wrote (the target's verify decode writes them again)."""
        if self._draft_pos is not None and self.own_cache:
            ll.llama_memory_seq_rm(self._mem, 0, self.n_past - self.shift, -1)
        self._draft_pos, self._draft_h = None, None

    # --- following the target -------------------------------------------------------

    def rollback(self, n_past: int) -> None:
        """Keep the first ``n_past`` positions, queued or fed (the head's cache is plain
        attention: any prefix)."""
        self.end_draft()
        if n_past <= 0:
            self.reset()
            return
        if n_past < self.n_past:
            self._queue = [e for e in self._queue if e[1] < n_past]
            if self.own_cache:
                ll.llama_memory_seq_rm(self._mem, 0, n_past - self.shift, -1)
            self.n_past = n_past

    def reset(self) -> None:
        self._draft_pos: int | None = None  # the next draft position while drafting
        self._draft_h: np.ndarray | None = None
        if self.own_cache:  # (a shared cache is the target's: clearing it would clear the target's cells)
            ll.llama_memory_clear(self._mem, True)
        self.n_past = 0  # positions accounted for: in the head's cache, or queued for it
        self._queue: list[tuple[int, int, np.ndarray]] = []  # (token, position, state before it), oldest first
        # the target's states for positions [_lo, _lo + len(_states)): its last batch and the one before
        self._states = np.zeros((1, self.n_state), np.float32)
        self._lo = -1  # the state "before position 0" is zeros, as in llama.cpp

    def close(self) -> None:
        _free_context(self)
        self._attach(False)


class MtpHeads(DraftHead):
    """A target's built-in MTP heads, run in llama.cpp's MTP context beside the target's.

    llama.cpp's MTP graph (``LLAMA_CONTEXT_TYPE_MTP``, a second context on the same model, its
    own KV cache holding only the head blocks) reads, for the token at position p, the
    target's hidden state at p - 1 (its post-norm output, ``embeddings_nextn``), and predicts
    the token at p + 1, at position p of its cache. The rest is :class:`DraftHead`'s.

    Several heads (``nextn_predict_layers`` > 1; step35, mimo2 and hy-v3 ship several) run as a
    chain, as llama.cpp's ``draft-mtp`` runs them (common/speculative.cpp, ``chain_heads``):
    head i makes a draft's guess i, so a draft is at most as long as the heads are many
    (``max_draft``). Each head is a block of its own, with its own layer of the MTP context's
    KV cache, and ``llama_set_nextn_layer_offset`` says which one a decode runs. So:

    * a catch-up decodes its batch of queued pairs once per head, each time after forgetting
      those positions (the decode before wrote them; the cells come back to the next head,
      whose layer of them it writes);
    * draft step i forgets the draft positions and decodes the whole draft so far under head
      i: the pending token with the target's last state, then each guess t < i with the state
      head t gave it; only the last row's logits are read.

    That is n head decodes per catch-up, and i + 1 rows in step i. The queue goes in when a
    draft begins, to every head (one head's goes in with its first step): a head whose step
    does not come this round must hold it all the same.
    """

    what = "MTP heads"
    chain = False  # several heads, one per draft position

    def __init__(self, target: Model):
        if target.n_nextn <= 0:
            raise UsageError(f"{target.path.name} has no MTP heads", "use another {mode}", "mode")
        if not target.opts.load_mtp:  # pragma: no cover - a programming error
            raise ValueError("load the target with LoadOptions(load_mtp=True) first")
        log = _ensure_init()
        log.mark()
        self.n_heads = target.n_nextn
        self.chain = self.n_heads > 1
        self.max_draft = self.n_heads if self.chain else None
        self._rows: list[tuple[int, int, np.ndarray]] = []  # chain: the draft so far, (token, position, state)
        ctx = _head_context(target._model, target, log, f"the MTP context for {target.path.name}", mtp=True)
        ll_ext.llama_set_embeddings_nextn(target._ctx, True, False)  # a state row for every token
        ll_ext.llama_set_embeddings_nextn(ctx, True, True)  # and for the heads' output rows
        n_embd = int(ll.llama_model_n_embd_out(target._model))
        self._follow(target, ctx, n_embd, n_embd)

    def _attach(self, on: bool) -> None:
        if on:
            self.target.heads = self
        elif self.target.heads is self:
            self.target.heads = None

    def _target_states(self, n: int) -> np.ndarray:
        return np.ctypeslib.as_array(ll_ext.llama_get_embeddings_nextn(self.target._ctx), shape=(n, self.n_state))

    def _put(self, entries, seed) -> int:
        idx = -1
        for token, pos, h in entries:
            self._add(token, pos, h, False)
        if seed is not None:
            idx = self._add(*seed, True)
        return idx

    # --- chained heads ----------------------------------------------------------------

    def _head(self, i: int) -> None:
        """The next decodes run head ``i``."""
        ll_ext.llama_set_nextn_layer_offset(self._ctx, i)

    def _catch_up(self, entries) -> None:
        if not self.chain:
            return super()._catch_up(entries)
        for i in range(self.n_heads):
            ll.llama_memory_seq_rm(self._mem, 0, entries[0][1], -1)  # as the head before left them
            self._head(i)
            super()._catch_up(entries)
        self._head(0)

    def _draft_batch(self, token: int) -> tuple[int, int]:
        if not self.chain:
            return super()._draft_batch(token)
        if self._draft_pos is None:
            self._feed()
            self._rows = [(token, self.n_past, self.state_before(self.n_past))]
        else:
            assert self._draft_h is not None
            self._rows.append((token, self._draft_pos, self._draft_h))
        step = len(self._rows) - 1
        if step >= self.n_heads:  # pragma: no cover - the source drafts at most max_draft
            raise ValueError(f"{self.n_heads} chained heads make {self.n_heads} guesses, and this would be guess {step + 1}")
        ll.llama_memory_seq_rm(self._mem, 0, self.n_past, -1)  # the draft so far, as the step before left it
        self._head(step)
        return self._put(self._rows[:-1], self._rows[-1]), self._rows[-1][1]

    def end_draft(self) -> None:
        if self.chain and self._draft_pos is not None:
            self._head(0)
        super().end_draft()


def _free_context(head) -> None:
    """Free a head's batch and context (each once: ``close`` may run again from ``__del__``)."""
    if head._batch is not None:
        ll.llama_batch_ext_free(head._batch)
        head._batch = None
    if head._ctx:
        ll.llama_free(head._ctx)
        head._ctx = None


def _head_context(
    model, target: Model, log: _Log, name: str, mtp: bool, n_batch: int | None = None, sampled: bool = False
):  # fmt: skip
    """A context for draft heads on ``model``, beside ``target``'s (its ``ctx_other``), with the
    target's size and threads: an MTP context (``mtp``: one output row, as a draft step reads
    one and catching up none; no recurrent snapshots), else a plain one. ``n_batch`` (default
    the target's) is also its ubatch; ``sampled``: a backend sampler may read every row of a
    batch (llama.cpp's default is one output per sequence). ``name`` says what failed."""
    cp = ll.llama_context_default_params()
    cp.n_ctx = target.n_ctx
    cp.n_batch = cp.n_ubatch = n_batch or target.n_batch
    if sampled:
        cp.n_outputs_max_per_seq = cp.n_batch
    cp.n_threads = cp.n_threads_batch = target.opts.n_threads
    if mtp:
        cp.n_outputs_max = 1
        cp.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
        cp.n_rs_seq = 0
    cp.ctx_other = target._ctx
    cp.no_perf = True
    ctx = ll.llama_init_from_model(model, cp)
    if not ctx:
        why = "; ".join(log.errors) or "out of memory?"
        raise BackendError(f"cannot create {name}: {why}", "lower {n_ctx} or use another {mode}")
    return ctx


def _load_head(path: Path, opts: LoadOptions, log: _Log):
    """A draft head's own model (an EAGLE-3 head, Gemma 4's assistant), placed by ``opts``."""
    log.mark()
    mp, keep = _model_params(replace(opts, load_mtp=False))
    model = ll.llama_model_load_from_file(str(path).encode(), mp)
    del keep  # llama.cpp read the placement arrays while loading
    if not model:
        why = "; ".join(log.errors) or "llama.cpp could not load it"
        raise BackendError(f"cannot load {path.name}: {why}", "run `specrun inspect` on it")
    return model


class Gemma4Assistant(MtpHeads):
    """Gemma 4's MTP drafter, a file of its own (arch ``gemma4-assistant``, ``mtp-*.gguf``),
    beside its Gemma 4 target: MTP heads that come in another file.

    Its blocks have queries only: they attend over the target's KV cache (its last
    sliding-window and its last full-attention layer), which its context shares through
    ``ctx_other``, and it borrows the target's token embeddings. Fed a token and the target's
    final state before it (``embeddings_nextn``, as the built-in heads are), it guesses the
    next token; each guess is fed back with its own state at the *same* position, as llama.cpp
    (common/speculative.cpp, ``is_mem_shared``) and the transformers reference do. With no cache
    of its own (``own_cache`` False) it has nothing to catch up or roll back: it follows the
    target's states only. It runs all its blocks in one graph, so its draft is not bounded.
    """

    own_cache = False
    what = "Gemma 4 assistant"

    def __init__(self, target: Model, path: str | Path, opts: LoadOptions | None = None):
        """``opts``: where the assistant's own weights go (by default where the target's did)."""
        log = _ensure_init()
        self.path = Path(path)
        self._model = _load_head(self.path, opts or target.opts, log)
        self._ctx = None
        n_embd = int(ll.llama_model_n_embd_out(self._model))  # the backbone's width: the target's state
        try:
            if n_embd != int(ll.llama_model_n_embd_out(target._model)):
                raise UsageError(
                    f"{self.path.name} reads {n_embd}-wide states, and {target.path.name}'s are "
                    f"{int(ll.llama_model_n_embd_out(target._model))} wide",
                    "give the assistant made for this target",
                    "draft_model",
                )
            log.mark()
            ctx = _head_context(self._model, target, log, f"a context for {self.path.name}", mtp=True)
        except BaseException:
            ll.llama_model_free(self._model)
            self._model = None
            raise
        self.n_heads = int(ll.llama_model_n_layer_nextn(self._model))
        self.max_draft = None
        ll_ext.llama_set_embeddings_nextn(target._ctx, True, False)  # a state row for every token
        ll_ext.llama_set_embeddings_nextn(ctx, True, True)  # and for the assistant's output rows
        self._follow(target, ctx, n_embd, n_embd)

    def close(self) -> None:
        super().close()
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None


# llama.cpp's calls for EAGLE-3, declared in src/llama-ext.h and src/llama-model.h without
# extern "C", so exported under C++-mangled (Itanium) names, and not bound by llama-cpp-python:
# name -> (mangled name, result, arguments)
_EAGLE3_FNS = {
    "llama_set_embeddings_layer_inp": (
        "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
        None,
        [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool],
    ),
    "llama_get_embeddings_layer_inp": (
        "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
        ctypes.POINTER(ctypes.c_float),
        [ctypes.c_void_p, ctypes.c_uint32],
    ),
    "llama_model_target_layer_ids": ("_Z28llama_model_target_layer_idsPK11llama_model", ctypes.POINTER(ctypes.c_int32), [ctypes.c_void_p]),
    "llama_model_target_layer_ids_n": ("_Z30llama_model_target_layer_ids_nPK11llama_model", ctypes.c_uint32, [ctypes.c_void_p]),
}
_eagle3_fns: dict[str, ctypes._CFuncPtr] = {}
# rows of one encode or decode of an EAGLE-3 head: llama.cpp gives a model with an encoder an
# output row per batch row, so its logits buffer holds n_vocab x this many floats (20 MB at 80k)
EAGLE3_BATCH = 64


def _eagle3_fn(name: str) -> ctypes._CFuncPtr:
    """One of _EAGLE3_FNS: by its plain name if this build exports one, else its mangled name."""
    if name not in _eagle3_fns:
        mangled, restype, argtypes = _EAGLE3_FNS[name]
        fn = getattr(ll.llama_cpp._lib, name, None) or getattr(ll.llama_cpp._lib, mangled, None)
        if fn is None:
            raise BackendError(f"this llama.cpp exports no {name}, which an EAGLE-3 head needs", "reinstall with scripts/install.sh")
        fn.restype, fn.argtypes = restype, argtypes
        _eagle3_fns[name] = fn
    return _eagle3_fns[name]


def read_layer_inputs(target: Model, reader: object, layers: tuple[int, ...], on: bool) -> None:
    """``reader`` starts (``on``) or stops reading these layers' inputs from ``target``. A layer
    is handed out from its first reader on and turned off only when its last reader stops, so
    closing one head never blinds another that reads the same layer; stopping twice, or without
    having started, changes nothing."""
    for lid in sorted(set(layers)):
        readers = target.layer_readers.setdefault(lid, set())
        was = bool(readers)
        if on:
            readers.add(id(reader))
        else:
            readers.discard(id(reader))
        if not readers:
            del target.layer_readers[lid]
        if target._ctx and was != bool(readers):
            _eagle3_fn("llama_set_embeddings_layer_inp")(target._ctx, lid, bool(readers))


class Eagle3Head(DraftHead):
    """An EAGLE-3 head (a GGUF of arch ``eagle3``) beside its target.

    The head is a model of its own: an encoder (``fc``) that fuses three of the target's layer
    inputs at one position (``eagle3.target_layers``; llama.cpp hands them out once
    ``llama_set_embeddings_layer_inp`` is on) into a state ``g``, and a one-block decoder that
    is fed (token at p + 1, ``g`` at p) at position p of its own cache and guesses the token at
    p + 2. Its context names the target's as ``ctx_other``, whose token embeddings and output
    head it borrows where it has none of its own. So, in :class:`DraftHead`'s terms, the state
    before position p is the target's three layer inputs at p - 1, the pair for p sits at p - 1
    of the head's cache (``shift`` 1; position 0 has none), and putting queued pairs into a
    batch encodes their states first (one ``LLAMA_PROCESS_TYPE_ENCODE``, then the decode). A
    guess fed back comes with the decoder's own output state, as llama.cpp's loop does
    (common/speculative.cpp, ``common_speculative_impl_draft_eagle3``).
    """

    shift = 1
    what = "EAGLE-3 head"

    def __init__(self, target: Model, path: str | Path, opts: LoadOptions | None = None):
        """``opts``: where the head's own weights go (by default where the target's did)."""
        log = _ensure_init()
        self.path = Path(path)
        self._model = _load_head(self.path, opts or target.opts, log)
        self._ctx = None
        try:
            n = int(_eagle3_fn("llama_model_target_layer_ids_n")(self._model))
            ids = _eagle3_fn("llama_model_target_layer_ids")(self._model)
            self.layers = tuple(int(ids[i]) for i in range(n)) if ids else ()
            n_layer = int(ll.llama_model_n_layer(target._model))
            if len(self.layers) != 3 or not all(0 <= i < n_layer for i in self.layers):
                raise UsageError(
                    f"{self.path.name} reads the target's layers {list(self.layers)}, and {target.path.name} has {n_layer}",
                    "give the EAGLE-3 head trained for this target",
                    "draft_model",
                )
            # the encoder takes a batch in one ubatch
            ctx = _head_context(
                self._model, target, log, f"a context for {self.path.name}", mtp=False, n_batch=min(target.n_batch, EAGLE3_BATCH)
            )
        except BaseException:
            ll.llama_model_free(self._model)
            self._model = None
            raise
        read_layer_inputs(target, self, self.layers, True)  # the target hands out these layers' inputs from now on
        ll_ext.llama_set_embeddings_nextn(ctx, True, True)  # the encoder's g rows and the decoder's output states
        self.n_embd_target = int(ll.llama_model_n_embd(target._model))
        self._follow(target, ctx, len(self.layers) * self.n_embd_target, int(ll.llama_model_n_embd(self._model)))

    def _attach(self, on: bool) -> None:
        if on:
            self.target.eagle3 = self
        elif self.target.eagle3 is self:
            self.target.eagle3 = None

    def _target_states(self, n: int) -> np.ndarray:
        get = _eagle3_fn("llama_get_embeddings_layer_inp")
        ctx = self.target._ctx
        return np.concatenate([np.ctypeslib.as_array(get(ctx, lid), shape=(n, self.n_embd_target)) for lid in self.layers], axis=1)

    def _encode(self, states: list[np.ndarray]) -> np.ndarray:
        """The encoder's g for each target state (in one ENCODE: the batch is at most n_batch)."""
        b = self._batch
        # the encoder reads no positions, but llama.cpp checks that a batch's go on from the cache's
        top = int(ll.llama_memory_seq_pos_max(self._mem, 0))
        for i, h in enumerate(states):
            row = np.ascontiguousarray(h, dtype=np.float32)
            idx = ll.llama_batch_ext_add_embd(b, 0, ll.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.size))
            if idx < 0:  # pragma: no cover - callers stay within n_batch
                raise BackendError(f"the EAGLE-3 encoder's batch refused a state (code {idx})")
            self._pos[0] = top + 1 + i
            ll.llama_batch_ext_set_pos(b, idx, self._pos)
        self._run("encode", ll.LLAMA_PROCESS_TYPE_ENCODE)
        return np.ctypeslib.as_array(ll_ext.llama_get_embeddings_nextn(self._ctx), shape=(len(states), self.n_embd)).copy()

    def _put(self, entries, seed) -> int:
        rows = [*entries, seed] if seed is not None else entries
        if not rows:
            return -1
        g = self._encode([h for _, _, h in rows])
        idx = -1
        for i, (token, pos, _) in enumerate(rows):
            # with a seed, every row an output: llama.cpp's eagle3 decoder graph keeps every
            # row to its end, and a decode hands out its first n_outputs rows as the outputs
            idx = self._add(token, pos - 1, g[i], seed is not None)
        return idx

    def close(self) -> None:
        super().close()
        read_layer_inputs(self.target, self, self.layers, False)
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None
