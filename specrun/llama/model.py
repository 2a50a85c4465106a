"""The only module that touches llama_cpp: load a model, decode batches, read logits, roll back.

Everything goes through llama.cpp's batch API: one ``llama_batch`` per model, allocated once
with the capacity of ``n_batch`` and reused; per-row logits flags, so only the rows the engine
asks for produce logits (never an n_ctx x n_vocab buffer). :meth:`Model.rollback` is the one
place positions move backwards, by the method the architecture allows (``rollback_method``):

* ``trim``: an attention KV cache; ``llama_memory_seq_rm`` forgets the positions;
* ``snapshots``: a recurrent or hybrid model whose architecture keeps state snapshots
  (``n_rs_seq``): ``llama_memory_seq_rm`` restores one, once per decode, for up to that many of
  the last decode's tokens, never all of them;
* ``checkpoint``: a recurrent state without snapshots: :meth:`Model.checkpoint` copies the
  sequence's state before decodes that may be undone; a rollback restores it and replays the
  tokens kept (one decode, no logits).

A model opened with ``tree_branches`` (an attention cache only) also verifies token trees:
:meth:`Model.eval_tree` decodes a tree of tokens after its sequence in one ``llama_decode`` over a
unified KV cache, each branch (root to leaf) a sequence id of its own (1, 2, ...) that first
shares every cell of sequence 0, each token once with the ids of every branch through it, at
the position of its depth; :meth:`Model.keep_branch` then gives sequence 0 the cells of the
path kept and drops every branch id, so the cells of the others are freed.
"""

from __future__ import annotations

import ctypes
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import llama_cpp as ll
import numpy as np

from specrun.errors import BackendError, UsageError
from specrun.fit import rpc
from specrun.gguf.architecture import CHECKPOINTS_KEPT, ROLLBACK_DEPTH
from specrun.llama.devices import _device_handle, _workers, devices, supports_gpu_offload
from specrun.llama.ffi import _batches_live, _ensure_init

_OFFLOAD_RE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
PIECE_BYTES = 256  # a token piece longer than this is asked for again at its size


class Attached(Protocol):
    """A draft head whose context rides on a model's (``heads.py``, ``dflash.py``): it sees
    every batch the model decodes and moves back with it."""

    def process(self, tokens: list[int], pos0: int) -> None: ...
    def rollback(self, n_past: int) -> None: ...
    def has_state_before(self, n_past: int) -> bool: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class LoadOptions:
    n_ctx: int = 4096
    n_gpu_layers: int = -1  # -1: every layer
    n_threads: int = 2
    n_batch: int = 512
    # rows of logits one decode may return: sizes llama.cpp's output and compute buffers,
    # which would otherwise hold n_batch x n_vocab floats (311 MB for Qwen's vocabulary)
    n_outputs_max: int = 64
    # memory-map the file? None: only when layers go to a GPU. On the CPU, llama.cpp repacks
    # quantized weights into a second buffer, and the mapped originals it read stay resident
    # too: reading the file instead saved 0.6 GB of RSS on the demo pair
    mmap: bool | None = None
    # where the layers go (llama_model_params): device names, None for llama.cpp's own choice
    # and () for the CPU alone; how to split, and in what proportions (one per device)
    devices: tuple[str, ...] | None = None
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] | None = None
    verbose: bool = False
    load_mtp: bool = False  # also load the built-in MTP heads' tensors (see MtpHeads)
    # recurrent-state snapshots to ask for on an architecture that keeps them: the most draft
    # tokens one rollback may undo (the engine cuts its draft cap to it)
    rollback_depth: int = ROLLBACK_DEPTH
    # sequences that decode together in this context (``Model.sequence``): n_ctx positions each,
    # in one KV cache of n_seq_max x n_ctx cells that they share
    n_seq_max: int = 1
    # branches a token tree may have (``eval_tree``): sequence ids of their own beside sequence 0,
    # in a unified cache with room for n_outputs_max cells more; 0: no trees. Granted only to an
    # attention-only model of one sequence (``Model.tree_branches`` says what was)
    tree_branches: int = 0


SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}  # enum llama_split_mode


@dataclass(frozen=True)
class Offload:
    layers: int  # offloaded, as llama.cpp reports it
    total: int  # n_layer + 1 (the output layer counts)
    reported: bool  # False: the build never printed the line (a CPU-only build)


ROLLBACK_METHODS = ("trim", "snapshots", "checkpoint")
# a snapshot model also keeps a checkpoint this many positions back at most, for the one
# rollback snapshots cannot do (a whole decode, as when a near-tie defers the pending token)
ANCHOR_EVERY = 64


@dataclass
class RollbackStats:
    """How one model's rollbacks went (counts since load)."""

    trims: int = 0  # attention caches: positions forgotten
    snapshots: int = 0  # rollbacks through a state snapshot
    restores: int = 0  # rollbacks through a checkpoint, then a replay
    full_replays: int = 0  # no checkpoint at or before the position: the sequence replayed from 0
    replayed: int = 0  # tokens replayed after restores and full replays
    checkpoints: int = 0  # states saved
    checkpoint_bytes: int = 0  # the size of the last one
    seconds: float = 0.0  # in rollback() and checkpoint() together


@dataclass
class _Checkpoint:
    n_past: int  # the sequence's length when the state was saved
    size: int  # bytes of ``data`` in use
    data: ctypes.Array  # the sequence's recurrent state, as llama_state_seq_get_data_ext wrote it


def _placement(mp, opts: LoadOptions) -> list[ctypes.Array]:
    """Devices, split mode, main GPU and tensor split into llama_model_params; the arrays
    to keep alive while llama.cpp loads (it reads them then)."""
    keep: list[ctypes.Array] = []
    if opts.devices is not None:
        handles = [_device_handle(n) for n in opts.devices]
        keep.append((ctypes.c_void_p * (len(handles) + 1))(*handles, None))  # NULL-terminated
        mp.devices = ctypes.cast(keep[-1], ctypes.c_void_p).value
    mp.split_mode = SPLIT_MODES[opts.split_mode]
    mp.main_gpu = opts.main_gpu
    if opts.tensor_split:
        n = int(ll.llama_max_devices())
        if len(opts.tensor_split) > n:
            raise UsageError(
                f"{{tensor_split}} has {len(opts.tensor_split)} values; llama.cpp takes at most {n}", "give fewer", "tensor_split"
            )
        keep.append((ctypes.c_float * n)(*opts.tensor_split))
        mp.tensor_split = keep[-1]
    return keep


def _model_params(opts: LoadOptions):
    """llama_model_params for ``opts``, and the arrays to keep alive while loading."""
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 10_000 if opts.n_gpu_layers < 0 else opts.n_gpu_layers
    use_mmap = opts.mmap if opts.mmap is not None else (opts.n_gpu_layers != 0 and opts.devices != () and supports_gpu_offload())
    mp.load_mode = ll.LLAMA_LOAD_MODE_MMAP if use_mmap else ll.LLAMA_LOAD_MODE_NONE
    mp.load_mtp = opts.load_mtp
    return mp, _placement(mp, opts)


class Model:
    """A loaded GGUF model with one context and one sequence."""

    def __init__(self, path: str | Path, opts: LoadOptions):
        log = _ensure_init(opts.verbose)
        self.path = Path(path)
        self.opts = opts
        self._model = None
        self._ctx = None
        self._batch = None
        # the heads that follow its sequence, once attached (every decode and rollback): the
        # built-in MTP heads, an EAGLE-3 head, a block drafter (DFlash)
        self.heads: Attached | None = None
        self.eagle3: Attached | None = None
        self.dflash: Attached | None = None
        # how many attached heads read each layer's inputs (an EAGLE-3 head and a block drafter
        # may read the same layer): the target hands a layer out while anyone reads it
        self.layer_readers: dict[int, set[int]] = {}  # layer -> id() of each head reading it
        # seconds of what was timed on it in this process, by what (a draft step): shared by
        # every sequence and every engine that drafts from it, so only the first pays to time it
        # (a dict, filled in place: a Sequence forwards the read, so its writes reach this one)
        self.timed: dict[str, float] = {}
        log.mark()
        mp, self._keep = _model_params(opts)
        self._model = ll.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self._model:
            why = "; ".join(log.errors) or "llama.cpp could not load it"
            raise BackendError(f"cannot load {self.path.name}: {why}", "run `specrun inspect` on it")
        lines = log.since_mark()
        cp = ll.llama_context_default_params()
        cp.n_ctx = opts.n_ctx * opts.n_seq_max
        cp.n_batch = opts.n_batch
        cp.n_ubatch = opts.n_batch  # a verify is one ubatch: snapshots cover the last ubatch only
        self.recurrent = bool(ll.llama_model_is_recurrent(self._model) or ll.llama_model_is_hybrid(self._model))
        if opts.n_seq_max > 1:
            if self.recurrent or opts.load_mtp:
                what = "MTP heads" if opts.load_mtp else "a recurrent state"
                self.close()
                raise UsageError(
                    f"{{parallel}} {opts.n_seq_max} needs an attention-only model, and {self.path.name} has {what}",
                    "use {parallel} 1",
                    "parallel",
                )
            cp.n_seq_max = opts.n_seq_max
            cp.kv_unified = True  # one cache, its cells shared: a short sequence leaves room for a long one
        # token trees: branch ids share sequence 0's cells (one cache), and a tree's cells beyond
        # the path kept need room for as long as the verify lasts
        self.tree_branches = opts.tree_branches if opts.n_seq_max == 1 and not self.recurrent and not opts.load_mtp else 0
        if self.tree_branches:
            cp.n_seq_max = 1 + self.tree_branches
            cp.kv_unified = True
            cp.n_ctx = opts.n_ctx + opts.n_outputs_max
        if self.recurrent:  # llama.cpp grants none where the architecture has no snapshots
            cp.n_rs_seq = max(0, min(opts.rollback_depth, opts.n_batch - 2))  # its split needs n_ubatch > n_rs_seq + 1
        cp.n_threads = opts.n_threads
        cp.n_threads_batch = opts.n_threads
        cp.n_outputs_max = opts.n_outputs_max
        cp.no_perf = True
        self._ctx = ll.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            why = "; ".join(log.errors) or "out of memory?"
            raise BackendError(
                f"cannot create a {opts.n_ctx}-token context for {self.path.name}: {why}",
                "lower {n_ctx} or {gpu_layers}",
            )
        self.n_ctx = int(ll.llama_n_ctx(self._ctx)) // opts.n_seq_max  # per sequence
        if self.tree_branches:
            self.n_ctx -= opts.n_outputs_max  # the tree's room
        # llama.cpp may pad n_ctx up (to 256) and clamp n_batch down to what was asked
        self.n_batch = max(1, min(opts.n_batch, int(ll.llama_n_batch(self._ctx))))
        self._mem = ll.llama_get_memory(self._ctx)
        self.snapshots = int(ll.llama_n_rs_seq(self._ctx)) if self.recurrent else 0
        self.rollback_method = "trim" if not self.recurrent else "snapshots" if self.snapshots else "checkpoint"
        self.rollback_stats = RollbackStats()
        self._undoable = 0  # snapshot models: how many of the cache's last tokens a snapshot can undo
        self._checkpoints: list[_Checkpoint] = []  # oldest first
        self.vocab = ll.llama_model_get_vocab(self._model)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self.vocab))
        self.n_nextn = int(ll.llama_model_n_layer_nextn(self._model))  # MTP heads in the file (loaded only with load_mtp)
        self._batch = ll.llama_batch_init(self.n_batch, 0, max(1, self.tree_branches))  # a tree's root is on every branch
        self._tree: tuple[list[int], list[int], list[int]] | None = None  # the tree decoded: tokens, parents, a branch per node
        _batches_live[0] += 1
        self.decode_s = 0.0  # seconds spent inside llama_decode, for overhead profiling
        self.tokens: list[int] = []  # what the KV cache holds; changed only by eval/rollback/reset
        # a build with the RPC backend logs "offloaded" even when there is no device to offload to
        has_device = bool(opts.devices) if opts.devices is not None else any(d.kind != "cpu" for d in devices())
        self.offload = self._parse_offload(lines) if has_device else Offload(0, 0, False)
        self.load_log = log.since_mark()  # llama.cpp's lines from loading and context creation
        self._eog = {t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(self.vocab, t)}
        for ep in _workers:  # the connections now exist: have them notice a vanished worker
            rpc.watch(ep)

    @property
    def _attached(self) -> list[Attached]:
        return [f for f in (self.heads, self.eagle3, self.dflash) if f is not None]

    @staticmethod
    def _parse_offload(lines: list[str]) -> Offload:
        for s in lines:
            m = _OFFLOAD_RE.search(s)
            if m:
                return Offload(int(m.group(1)), int(m.group(2)), True)
        return Offload(0, 0, False)

    # --- vocabulary -------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        # a buffer per call: the threads of `serve --parallel` turn tokens into text through
        # one Model at once, and ctypes lets go of the GIL inside llama_token_to_piece (one
        # buffer on the Model gave a stream another token's bytes)
        buf = ctypes.create_string_buffer(PIECE_BYTES)
        n = ll.llama_token_to_piece(self.vocab, token, buf, PIECE_BYTES, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"".join(self.piece(t) for t in tokens)

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    # --- decoding ---------------------------------------------------------------------

    def eval(self, tokens: list[int], logits: str = "last") -> np.ndarray | None:
        """Append ``tokens`` to the sequence in one llama_decode per n_batch chunk.

        ``logits`` is "last" (one row), "all" (one row per token) or "none". Returns a
        (rows, n_vocab) float32 view into llama.cpp's buffer, valid until the next eval.
        """
        if not tokens:
            raise ValueError("eval() needs at least one token")
        if self.n_past + len(tokens) > self.n_ctx:
            raise BackendError(
                f"context full: {self.n_past} + {len(tokens)} tokens exceed {{n_ctx}} {self.n_ctx}",
                "raise {n_ctx}",
            )
        cap = self.n_batch
        if logits == "all" and len(tokens) > min(cap, self.opts.n_outputs_max):
            raise ValueError("logits='all' is limited to n_outputs_max tokens")
        if self.rollback_method != "trim" and logits != "all" and len(tokens) > 1 and not self._checkpoints:
            # a recurrent state's first evaluation: keep a checkpoint one token short of its end,
            # so that undoing that token (a near-tie deferring it) does not replay them all
            self._eval_chunks(tokens[:-1], "none")
            self.checkpoint(full=True)
            tokens = tokens[-1:]
        return self._eval_chunks(tokens, logits)

    def _eval_chunks(self, tokens: list[int], logits: str) -> np.ndarray | None:
        cap = self.n_batch
        for start in range(0, len(tokens), cap):
            chunk = tokens[start : start + cap]
            last_chunk = start + cap >= len(tokens)
            self._decode(chunk, logits if last_chunk else "none")
        if logits == "none":
            return None
        # flagged rows are contiguous in llama.cpp's output buffer, in batch order
        last = (len(tokens) - 1) % cap
        first = 0 if logits == "all" else last
        ptr = ll.llama_get_logits_ith(self._ctx, first)
        return np.ctypeslib.as_array(ptr, shape=(last - first + 1, self.n_vocab))

    def eval_last(self, tokens: list[int]) -> np.ndarray:
        """Append ``tokens``; the logits after the last one (a view, valid until the next eval)."""
        rows = self.eval(tokens, logits="last")
        assert rows is not None
        return rows[0]

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def _decode(self, tokens: list[int], logits: str) -> None:
        b = self._batch
        n = len(tokens)
        pos0 = self.n_past
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = logits == "all"
        if logits == "last":
            b.logits[n - 1] = True
        b.n_tokens = n
        t0 = time.perf_counter()
        rc = ll.llama_decode(self._ctx, b)
        ll.llama_synchronize(self._ctx)  # a GPU computes after llama_decode returns: time it all
        self.decode_s += time.perf_counter() - t0
        if rc != 0:
            # the cache may hold part of the batch: put it back where it was
            ll.llama_memory_seq_rm(self._mem, 0, pos0, -1)
            raise BackendError(f"llama_decode failed with code {rc} at position {pos0}", "lower {n_ctx}")
        self.tokens.extend(tokens)
        # a decode of n tokens leaves snapshots of the states after its last n - 1 tokens but one
        self._undoable = min(self.snapshots, n - 1)
        for f in self._attached:  # the heads see every batch the target decodes, with its hidden states
            f.process(tokens, pos0)

    def _decode_many(self, asks: list[Ask]) -> None:
        """One llama_decode holding every ask's rows, each on its own sequence (the Gate's pass)."""
        b = self._batch
        i = 0
        for a in asks:
            for j, t in enumerate(a.tokens):
                b.token[i] = t
                b.pos[i] = a.pos0 + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = a.seq
                b.logits[i] = a.logits == "all" or (a.logits == "last" and j == len(a.tokens) - 1)
                i += 1
        b.n_tokens = i
        t0 = time.perf_counter()
        rc = ll.llama_decode(self._ctx, b)
        ll.llama_synchronize(self._ctx)
        dt = time.perf_counter() - t0
        self.decode_s += dt
        i = 0
        for a in asks:
            a.seconds, a.batch_rows, a.done = dt, b.n_tokens, True
            if rc != 0:  # the cache may hold part of the batch: put each sequence back where it was
                ll.llama_memory_seq_rm(self._mem, a.seq, a.pos0, -1)
                a.error = BackendError(f"llama_decode failed with code {rc} at position {a.pos0}", "lower {n_ctx} or {parallel}")
            elif a.logits != "none":  # row by row: llama.cpp may keep several sequences' outputs in another order
                flagged = range(i, i + len(a.tokens)) if a.logits == "all" else [i + len(a.tokens) - 1]
                a.rows = np.empty((a.n_out, self.n_vocab), np.float32)
                for r, j in enumerate(flagged):
                    a.rows[r] = np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, j), shape=(self.n_vocab,))
            i += len(a.tokens)

    # --- token trees -------------------------------------------------------------------

    def eval_tree(self, tokens: list[int], parents: list[int]) -> np.ndarray:
        """Decode a tree of tokens after the sequence in ONE llama_decode; a row of logits per
        node, in node order (a copy). Node 0 is the root (the sequence's pending token, parent
        -1); every other node's parent is an earlier node. Until :meth:`keep_branch`, the tree's
        cells sit in the cache beside sequence 0, which does not change (``n_past`` neither)."""
        n = len(tokens)
        if not self.tree_branches or self._attached:
            raise ValueError("this model was not opened for token trees (LoadOptions.tree_branches)")
        if n != len(parents) or parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, n)):
            raise ValueError("a tree's root is node 0 and every other node's parent comes before it")
        if n > min(self.n_batch, self.opts.n_outputs_max) or self.n_past + n > self.n_ctx + self.opts.n_outputs_max:
            raise ValueError("a tree is limited to n_outputs_max nodes and the context's room")
        has_kids = [False] * n
        depth = [0] * n
        for i in range(1, n):
            has_kids[parents[i]] = True
            depth[i] = depth[parents[i]] + 1
        leaves = [i for i in range(n) if not has_kids[i]]
        if len(leaves) > self.tree_branches:
            raise ValueError(f"a tree of {len(leaves)} branches; this context has ids for {self.tree_branches}")
        seqs: list[list[int]] = [[] for _ in range(n)]  # each node's branch ids: every leaf below it
        for b, leaf in enumerate(leaves, start=1):
            node = leaf
            while node >= 0:
                seqs[node].append(b)
                node = parents[node]
        pos0 = self.n_past
        for b in range(1, len(leaves) + 1):  # every branch sees what sequence 0 holds (no copy: one cache)
            ll.llama_memory_seq_cp(self._mem, 0, b, -1, -1)
        batch = self._batch
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = pos0 + depth[i]
            batch.n_seq_id[i] = len(seqs[i])
            for j, s in enumerate(seqs[i]):
                batch.seq_id[i][j] = s
            batch.logits[i] = True
        batch.n_tokens = n
        t0 = time.perf_counter()
        rc = ll.llama_decode(self._ctx, batch)
        ll.llama_synchronize(self._ctx)
        self.decode_s += time.perf_counter() - t0
        if rc != 0:
            self._drop_branches(len(leaves))
            raise BackendError(f"llama_decode of a {n}-token tree failed with code {rc} at position {pos0}", "lower {n_ctx}")
        rows = np.empty((n, self.n_vocab), np.float32)
        for i in range(n):  # row by row: a batch of several sequences may keep its outputs in another order
            rows[i] = np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, i), shape=(self.n_vocab,))
        self._tree = (list(tokens), list(parents), [s[0] for s in seqs])
        return rows

    def keep_branch(self, path: list[int]) -> None:
        """After :meth:`eval_tree`: the nodes of ``path`` (0, a child of 0, ...) join sequence 0,
        every other node's cells are freed."""
        assert self._tree is not None, "keep_branch() follows eval_tree()"
        tokens, parents, branch = self._tree
        self._tree = None
        if path and (path[0] != 0 or any(parents[b] != a for a, b in zip(path, path[1:]))):
            self._drop_branches(max(branch))
            raise ValueError("a kept path runs from the root down the tree")
        if path:  # the positions of the path's nodes, held by any branch through its last node
            ll.llama_memory_seq_cp(self._mem, branch[path[-1]], 0, self.n_past, self.n_past + len(path))
        self._drop_branches(max(branch))
        self.tokens.extend(tokens[i] for i in path)

    def _drop_branches(self, n: int) -> None:
        for b in range(1, n + 1):
            ll.llama_memory_seq_rm(self._mem, b, -1, -1)

    # --- rollback -----------------------------------------------------------------------

    @property
    def draft_limit(self) -> int | None:
        """The most draft tokens one verify may carry so that a rollback stays cheap: the
        snapshots granted, on a snapshot model; no limit otherwise."""
        return self.snapshots if self.rollback_method == "snapshots" else None

    def checkpoint(self, full: bool = False) -> None:
        """Before decodes that may be undone, make a rollback to any position from here on
        possible. Free on an attention cache. On a snapshot model, free for one decode of which
        the first token stays (a verify's pending token), bar an anchor every ANCHOR_EVERY
        positions; ``full`` (several decodes follow, or the whole decode may go) saves a copy of
        the state there too. Without snapshots, always a copy of the recurrent state. The last
        CHECKPOINTS_KEPT copies are kept: a rollback to just before the latest (a near-tie
        deferring the pending token) restores the one before and replays a round's tokens."""
        if self.rollback_method == "trim":
            return
        kept = self._checkpoints
        latest = kept[-1].n_past if kept else None
        if latest == self.n_past:
            return  # the saved state is this position's already
        if self.rollback_method == "snapshots" and not full and latest is not None and self.n_past - latest < ANCHOR_EVERY:
            return
        t0 = time.perf_counter()
        flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(ll.llama_state_seq_get_size_ext(self._ctx, 0, flags))
        old = kept.pop(0) if len(kept) == CHECKPOINTS_KEPT else None
        buf = old.data if old is not None and len(old.data) >= size else (ctypes.c_uint8 * size)()
        got = int(ll.llama_state_seq_get_data_ext(self._ctx, buf, size, 0, flags))
        if got == 0:
            raise BackendError(f"cannot save the recurrent state of {self.path.name}", "use {mode} none")
        kept.append(_Checkpoint(self.n_past, got, buf))
        st = self.rollback_stats
        st.checkpoints += 1
        st.checkpoint_bytes = got
        st.seconds += time.perf_counter() - t0

    def rollback(self, n_past: int) -> None:
        """Forget every position >= n_past. The one place positions move backwards (the
        attached heads, MTP, EAGLE-3 or a block drafter, move with it)."""
        if n_past >= self.n_past:
            return
        heads = self._attached
        for f in heads:
            f.rollback(n_past)  # first: a replay below must not queue what the heads hold
        self._rollback(n_past)
        if n_past > 0 and not all(f.has_state_before(n_past) for f in heads):
            # the heads pair the next token with the target's state at n_past - 1, which only a
            # decode returns: decode that token again (the heads keep their entry for it)
            redo = self.tokens[n_past - 1]
            self._rollback(n_past - 1)
            self._decode([redo], "none")

    def _rollback(self, n_past: int) -> None:
        """The target's own rollback, by the architecture's method."""
        t0 = time.perf_counter()
        st = self.rollback_stats
        drop = self.n_past - n_past
        # states past the new end are of tokens that will differ
        self._checkpoints = [c for c in self._checkpoints if c.n_past <= n_past]
        if self.rollback_method == "trim" or (self.rollback_method == "snapshots" and drop <= self._undoable):
            ok = ll.llama_memory_seq_rm(self._mem, 0, n_past, -1)
            if ok or self.rollback_method == "trim":
                if not ok:
                    raise BackendError(f"llama.cpp refused to roll {self.path.name}'s cache back to {n_past}", "use {mode} none")
                del self.tokens[n_past:]
                self._undoable = 0  # a snapshot serves once: the next decode consumes it
                if self.rollback_method == "trim":
                    st.trims += 1
                else:
                    st.snapshots += 1
                st.seconds += time.perf_counter() - t0
                return
        self._restore(n_past)
        st.seconds += time.perf_counter() - t0

    def _restore(self, n_past: int) -> None:
        """Put the state back at the latest checkpoint at or before ``n_past`` (else empty it)
        and replay the tokens from there to ``n_past``."""
        st = self.rollback_stats
        keep = self.tokens[:n_past]
        if self._checkpoints:  # rollback() kept only those at or before n_past
            ck = self._checkpoints[-1]
            flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
            if int(ll.llama_state_seq_set_data_ext(self._ctx, ck.data, ck.size, 0, flags)) == 0:
                raise BackendError(f"cannot restore the recurrent state of {self.path.name}", "use {mode} none")
            ll.llama_memory_seq_rm(self._mem, 0, ck.n_past, -1)  # the attention part keeps what the state saw
            start = ck.n_past
            st.restores += 1
        else:
            ll.llama_memory_clear(self._mem, True)
            start = 0
            st.full_replays += 1
        self.tokens = keep[:start]
        self._undoable = 0
        if n_past > start:
            self.eval(keep[start:], logits="none")
            st.replayed += n_past - start

    def reset(self) -> None:
        ll.llama_memory_clear(self._mem, True)
        self.tokens = []
        self._checkpoints = []
        self._undoable = 0
        for f in self._attached:
            f.reset()

    # --- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        for f in self._attached:  # their contexts refer to this one and to the model: they go first
            f.close()
        self.heads = self.eagle3 = self.dflash = None
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
            _batches_live[0] -= 1
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


@dataclass
class Ask:
    """One sequence's decode, waiting for the batch that carries it."""

    model: Model
    seq: int
    tokens: list[int]
    pos0: int
    logits: str  # "last" | "all" | "none"
    rows: np.ndarray | None = None  # its logits, copied out of the batch's
    error: BackendError | None = None
    batch_rows: int = 0  # how many rows the whole batch had
    seconds: float = 0.0  # the batch's llama_decode
    done: bool = False

    @property
    def n_out(self) -> int:
        return len(self.tokens) if self.logits == "all" else int(self.logits == "last")
