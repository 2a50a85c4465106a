"""A block drafter beside its target: DFlash, DSpark or DFlash2 (one GGUF architecture, ``dflash``).

A block drafter is a model of its own whose context names the target's as ``ctx_other``, whose
token embeddings and output head it borrows where it has none. It reads the target's inputs to a
few of its layers (``dflash.target_layers``; llama.cpp hands them out once
``llama_set_embeddings_layer_inp`` is on) and keeps them in its own KV cache: each position's
rows, side by side, go in as an embeddings-only batch at the target's position, where its
encoder (``fc``) fuses them and each layer writes their keys and values, nothing else. Then one
non-causal decode of ``[last token, mask x n]`` at the positions after the target's, every row an
output, drafts a whole block: row i guesses the token at its own position (a DSpark drafter that
samples from the anchor, llama.cpp's default for it, guesses one further: its first row guesses
too). How each kind reads its block (common/speculative.cpp, ``common_speculative_impl_draft_dflash``):

* **DFlash**: each row's logits, their argmax the draft;
* **DSpark**: the same, its logits already biased in the graph by a Markov head chained over the
  rows' argmaxes, and with a confidence head's estimate per row where it has one;
* **DFlash2**: no logits; its selector's lattice (per row, the top-k candidates and a score for
  each pair of the previous row's pick and this one's), walked on the CPU.

Kept in step with the target (``Model`` calls :meth:`process` after every decode and
:meth:`rollback` with every rollback), lazily, as the other heads are (``heads.py``): a target
decode's layer inputs are copied into a queue, which goes in before the next block (one
injection decode, then the block's) or on its own once it holds a batch, in chunks of the
drafter's n_ubatch (a non-causal batch over it is an assert). A verify's rejected rows are
rolled back before that, so they are mostly never injected at all; those that were are removed
from the cache. After a block is read, its cells are removed again: the cache holds the target's
positions and nothing else between blocks.

A drafter for an M-RoPE target (Qwen3.5's) carries rope sections, and llama.cpp then ropes it as
M-RoPE: an embeddings row has four positions, written as llama.cpp's loop writes them (the
target's text position three times, then 0); a token row has one, which llama.cpp repeats.
llama.cpp checks such a cache's positions less than a plain one's: it refuses an embeddings row
below a position it holds, but takes one at the same position or past a gap, where a plain cache
insists on the next. So llama.cpp would not notice rows out of step: the counts here
(``n_past``, ``injected``) are kept exact, and a rollback reaches the drafter before the target
replays anything (``Model.rollback``).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as ll
import numpy as np
from llama_cpp import llama_cpp_ext as ll_ext

from specrun.errors import BackendError, BadModelFile, UsageError
from specrun.gguf.facts import model_info
from specrun.gguf.heads import HeadFile, head_file_of
from specrun.llama.devices import supports_gpu_offload
from specrun.llama.ffi import _ensure_init
from specrun.llama.heads import _eagle3_fn, _free_context, _head_context, _load_head, read_layer_inputs
from specrun.llama.model import LoadOptions, Model

# rows of one drafter decode: an injection chunk, or a block (so the longest block). A drafter
# counts as having an encoder, so llama.cpp gives it an output row of n_vocab floats per batch
# row: keep it small
DFLASH_BATCH = 64
# candidates a block's row hands back when sampled where the logits are (llama.cpp's own top-k for
# its drafts, and the top-k its p-min softmax is taken over)
BLOCK_TOP_K = 10


@dataclass(frozen=True)
class Block:
    """One block's drafts, as the drafter made them: ``tokens[i]`` is the argmax of draft row i
    (DFlash2: the selector's walk), ``stated[i]`` the confidence the drafter states for it where
    it states one (DSpark's confidence head, DFlash2's selector), and :meth:`row` the logits a
    draft is drawn from when sampling."""

    pos: int  # the last token's position
    tokens: list[int]
    stated: list[float] | None
    logits: np.ndarray | None  # (drafts, n_vocab): DFlash and DSpark, read back whole
    candidates: np.ndarray | None = None  # (drafts, k) token ids per row: sampled rows' top k, DFlash2's candidates
    # (drafts, k) logits of sampled rows' candidates; DFlash2's: (drafts, k, k), [previous row's pick, this row's candidate]
    scores: np.ndarray | None = None
    n_vocab: int = 0  # how long a row of logits is (the target's vocabulary)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def sampled(self) -> bool:
        """Were the rows sampled in llama.cpp (each row's top k, not the whole vocabulary)?"""
        return self.scores is not None and self.scores.ndim == 2

    def confidence(self, i: int) -> float:
        """A sampled row's softmax at its argmax (the draft), over its top k: what
        ``greedy_confidence`` reads off the row, without a pass over the vocabulary."""
        assert self.candidates is not None and self.scores is not None
        _, first = np.unique(self.candidates[i], return_index=True)  # (a short row's padding out)
        top = self.scores[i][first]
        return 1.0 / float(np.exp(top - top.max()).sum())

    def row(self, i: int, prev: int | None = None) -> np.ndarray:
        """Draft row i's logits over the vocabulary, given the draft before it (``prev``; only
        DFlash2's selector reads it: the pair scores from that pick, -inf off its candidates)."""
        if self.logits is not None:
            return self.logits[i]
        assert self.candidates is not None and self.scores is not None
        scores = self.scores[i]
        if scores.ndim == 2:  # DFlash2: the pair scores from the previous pick
            pick = 0
            if i > 0 and prev is not None:
                hit = np.nonzero(self.candidates[i - 1] == prev)[0]
                pick = int(hit[0]) if hit.size else 0
            scores = scores[pick]
        out = np.full(self.n_vocab, -np.inf, np.float32)
        out[self.candidates[i]] = scores
        return out


class DFlashHead:
    """A block drafter (a GGUF of arch ``dflash``) beside its target; see the module."""

    what = "DFlash drafter"  # for messages
    n_past: int  # positions accounted for: injected, or queued
    injected: int  # positions in the cache
    _queue: list[np.ndarray]  # the target's rows for positions injected.., oldest first

    def __init__(self, target: Model, path: str | Path, opts: LoadOptions | None = None, sampled: bool | None = None):
        """``opts``: where the drafter's own weights go (by default where the target's did).
        A file llama.cpp would refuse or abort on, or one for another target, is refused first,
        from the headers. ``sampled``: are a block's rows sampled where its logits are, so that
        each hands back its top ``BLOCK_TOP_K``, not the whole vocabulary? By default where the
        output head is on a GPU: on this CPU a 16-row block took 6% longer so (a top-k over each
        row in the graph, against a copy and numpy's argmax), on a GPU it saves reading back
        megabytes a round."""
        self.path = Path(path)
        info = model_info(self.path)
        head = head_file_of(info)
        if head is None or head.source != "dflash":
            raise UsageError(
                f"{self.path.name} is not a block drafter (arch dflash)", "give a DFlash, DSpark or DFlash2 file", "draft_model"
            )
        why = head.mismatch(model_info(target.path))
        if why is not None:
            error = BadModelFile if head.fault is not None else UsageError
            raise error(
                f"{self.path.name} ({head.kind}) cannot draft for {target.path.name}: {why}", "give the drafter made for this target"
            )
        self.head: HeadFile = head
        self.kind = head.variant  # dflash | dspark | dflash2
        self.what = head.kind.removeprefix("a ")  # "DSpark drafter"
        self.layers = head.target_layers
        assert head.mask_token is not None  # (a fault otherwise)
        self.mask = head.mask_token
        self.confidence_head = self.kind == "dspark" and any(t.name == "conf_proj.weight" for t in info.header.tensors)
        self.top_k = int(info.header.get("dflash.selector_top_k", 0))  # DFlash2: candidates per row
        log = _ensure_init()
        self._model = _load_head(self.path, opts or target.opts, log)
        self._ctx = None
        self._batch = None
        if sampled is None:
            sampled = _output_on_device(opts or target.opts, int(ll.llama_model_n_layer(self._model)))
        sampled = sampled and self.kind != "dflash2"  # (DFlash2 reads its lattice, never logits)
        try:
            ctx = _head_context(
                self._model, target, log, f"a context for {self.path.name}", mtp=False, n_batch=DFLASH_BATCH, sampled=sampled
            )
        except BaseException:
            ll.llama_model_free(self._model)
            self._model = None
            raise
        self.target = target
        self._ctx = ctx
        self._mem = ll.llama_get_memory(ctx)
        self._batch = ll.llama_batch_ext_init(ctx)
        self.n_batch = max(1, int(ll.llama_n_ubatch(ctx)))
        self._chain = self._sample_rows(ctx) if sampled else None
        # the most drafts a block holds: what the file was trained for, within one ubatch (a
        # non-causal batch over it is an assert)
        self.max_draft = min(head.max_draft, self.n_batch - self.rows(0))
        self.n_ctx = int(ll.llama_n_ctx(ctx))
        self.n_embd = int(ll.llama_model_n_embd(self._model))
        self.n_embd_target = int(ll.llama_model_n_embd(target._model))
        self._pos = (ll.llama_pos * 4)()
        causal = str(_meta(self._model, "dflash.attention.causal")).lower() == "true"
        ll.llama_set_causal_attn(ctx, causal)  # a block's rows see each other, unless the file says otherwise
        read_layer_inputs(target, self, self.layers, True)  # the target hands out these layers' inputs from now on
        if self.kind == "dflash2" or self.confidence_head:  # the lattice (every row's), or the confidences (the outputs')
            ll_ext.llama_set_embeddings_nextn(ctx, True, self.kind != "dflash2")
        self.inject_s = 0.0  # seconds in injection decodes (and copying the target's rows)
        self.draft_s = 0.0  # seconds in block decodes, reading the rows included
        self.read_s = 0.0  # of which reading the rows back (a copy of logits and their argmaxes, or the sampled top k)
        self.called_s = 0.0  # seconds in draft() calls: a queue's injection, the block, its rows read
        self.injected_rows = 0  # target positions injected
        self.decodes = 0  # llama_process calls on the drafter's context
        self.reset()
        if target.n_past:  # attached after the target decoded something: start over with it
            tokens = list(target.tokens)
            target.reset()
            target.dflash = self
            target.eval(tokens, logits="none")
        target.dflash = self

    def _sample_rows(self, ctx):
        """Have llama.cpp keep each block row's top ``BLOCK_TOP_K`` where the logits are (on a GPU:
        on the device), so that k ids and logits a row come back instead of a row of the whole
        vocabulary; None where this context cannot (llama.cpp then says why, and the rows come
        back whole)."""
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(BLOCK_TOP_K))
        if ll.llama_set_sampler(ctx, 0, chain):
            return chain
        ll.llama_sampler_free(chain)
        return None

    # --- following the target ------------------------------------------------------------

    def process(self, tokens: list[int], pos0: int) -> None:
        """The target just decoded ``tokens`` at ``pos0``...: queue their layer inputs for
        every position the drafter lacks (a replay of positions it holds gives the same rows)."""
        t0 = time.perf_counter()
        n = len(tokens)
        if pos0 > self.n_past:  # pragma: no cover - Model keeps them in step
            raise BackendError(f"the {self.what} lost step with the target (at {self.n_past}, batch at {pos0})", "use another {mode}")
        start = self.n_past - pos0
        if start < n:
            get = _eagle3_fn("llama_get_embeddings_layer_inp")
            rows = [np.ctypeslib.as_array(get(self.target._ctx, lid), shape=(n, self.n_embd_target))[start:] for lid in self.layers]
            self._queue.append(np.concatenate(rows, axis=1))  # a copy: the target's buffer is the next decode's
            self.n_past = pos0 + n
        if self.n_past - self.injected >= self.n_batch:  # a batch's worth: in it goes
            self._inject()
        self.inject_s += time.perf_counter() - t0

    def _inject(self) -> None:
        """Decode the queue into the cache, at the target's positions, a batch at a time."""
        if not self._queue:
            return
        rows = np.ascontiguousarray(np.concatenate(self._queue), dtype=np.float32)
        self._queue = []
        for lo in range(0, len(rows), self.n_batch):
            for i, r in enumerate(rows[lo : lo + self.n_batch]):
                embd = ll.llama_embd(r.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, r.size)
                idx = ll.llama_batch_ext_add_embd(self._batch, 0, embd)  # copies the row
                if idx < 0:  # pragma: no cover - its width is checked against the model's
                    raise BackendError(f"the {self.what}' batch refused a target row (code {idx})")
                p = self.injected + lo + i
                self._pos[0] = self._pos[1] = self._pos[2] = p  # an M-RoPE drafter reads four: text's
                self._pos[3] = 0
                ll.llama_batch_ext_set_pos(self._batch, idx, self._pos)
            self._run("take the target's layers")
        self.injected += len(rows)
        self.injected_rows += len(rows)

    def rollback(self, n_past: int) -> None:
        """Keep the first ``n_past`` positions, queued or injected (plain attention: any prefix)."""
        if n_past >= self.n_past:
            return
        if n_past < self.injected:
            ll.llama_memory_seq_rm(self._mem, 0, n_past, -1)
            self.injected = n_past
        keep, out = n_past - self.injected, []
        for chunk in self._queue:
            if keep <= 0:
                break
            out.append(chunk[:keep])
            keep -= len(out[-1])
        self._queue = out
        self.n_past = n_past

    def has_state_before(self, n_past: int) -> bool:
        return True  # a block starts from the cache alone: no state of the target's is carried over

    def reset(self) -> None:
        ll.llama_memory_clear(self._mem, True)
        self.n_past = 0
        self.injected = 0
        self._queue = []

    @property
    def cached(self) -> int:
        """Positions in the drafter's KV cache (llama.cpp's own count)."""
        return int(ll.llama_memory_seq_pos_max(self._mem, 0)) + 1

    # --- drafting --------------------------------------------------------------------------

    def rows(self, n: int) -> int:
        """Rows of a block that drafts ``n`` tokens (the last token's row drafts too where a
        DSpark drafter samples from the anchor)."""
        return n if self.head.anchor else n + 1

    def draft(self, last_token: int, pos: int, n: int) -> Block:
        """Draft ``n`` tokens (at most ``max_draft``) after ``last_token``, the target's pending
        token at ``pos`` (its ``n_past``), in one decode of ``[last_token, mask x ...]``."""
        if pos != self.n_past:
            raise BackendError(f"the {self.what} holds {self.n_past} positions, and a block at {pos} was asked for", "use another {mode}")
        if not 1 <= n <= self.max_draft:
            raise ValueError(f"a block of the {self.what} drafts 1..{self.max_draft} tokens, not {n}")
        rows = self.rows(n)
        if pos + rows > self.n_ctx:
            raise BackendError(f"context full: a block of {rows} rows at {pos} passes {{n_ctx}} {self.n_ctx}", "raise {n_ctx}")
        t0 = time.perf_counter()
        self._inject()
        self.inject_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        outputs = self.kind != "dflash2"  # DFlash2 reads its lattice, never logits
        for i in range(rows):
            idx = ll.llama_batch_ext_add_token(self._batch, 0, last_token if i == 0 else self.mask)
            if idx < 0:  # pragma: no cover - the mask token is checked from the header
                raise BackendError(f"the {self.what}' batch refused token {last_token if i == 0 else self.mask} (code {idx})")
            self._pos[0] = pos + i  # (a token row reads one position, on M-RoPE too)
            ll.llama_batch_ext_set_pos(self._batch, idx, self._pos)
            if outputs:
                ll.llama_batch_ext_set_output_logits(self._batch, idx, True)
        try:
            self._run("draft a block")
            first = rows - n  # the first draft row (0 where the anchor row drafts too)
            t2 = time.perf_counter()
            block = self._read(pos, first, n)
            self.read_s += time.perf_counter() - t2
        finally:
            ll.llama_memory_seq_rm(self._mem, 0, pos, -1)  # the block's cells: the target's verify decides what comes there
        t3 = time.perf_counter()
        self.draft_s += t3 - t1
        self.called_s += t3 - t0
        return block

    def _read(self, pos: int, first: int, n: int) -> Block:
        """The block's draft rows ``first``.. (``n`` of them), from the decode just run."""
        if self.kind == "dflash2":
            return self._walk(pos, first, n)
        stated = None
        if self.confidence_head:  # (masked: one row per output) each broadcast over an n_embd-wide row
            conf = np.ctypeslib.as_array(ll_ext.llama_get_embeddings_nextn(self._ctx), shape=(first + n, self.n_embd))
            stated = [float(c) for c in conf[first:, 0]]
        if self._chain is not None:
            ids, top = self._sampled(first, n)
            return Block(pos, [int(r[j]) for r, j in zip(ids, np.argmax(top, axis=1))], stated, None, ids, top, self.target.n_vocab)
        logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, 0), shape=(first + n, self.target.n_vocab))[first:].copy()
        return Block(pos, [int(x) for x in np.argmax(logits, axis=1)], stated, logits, n_vocab=self.target.n_vocab)

    def _sampled(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``first``.. of the block as llama.cpp's sampler left them: each row's candidate
        ids and their logits, (n, BLOCK_TOP_K) each (fewer than k: the first repeated)."""
        ids = np.zeros((n, BLOCK_TOP_K), np.int64)
        top = np.full((n, BLOCK_TOP_K), -np.inf, np.float32)
        for j in range(n):
            i = first + j
            m = min(
                int(ll.llama_get_sampled_candidates_count_ith(self._ctx, i)),
                int(ll.llama_get_sampled_logits_count_ith(self._ctx, i)),
                BLOCK_TOP_K,
            )
            if m <= 0:  # pragma: no cover - every row is an output of a sampled sequence
                raise BackendError(f"the {self.what} sampled nothing for a block's row {i}", "use another {mode}")
            ids[j, :m] = np.ctypeslib.as_array(ll.llama_get_sampled_candidates_ith(self._ctx, i), shape=(m,))
            top[j, :m] = np.ctypeslib.as_array(ll.llama_get_sampled_logits_ith(self._ctx, i), shape=(m,))
            ids[j, m:], top[j, m:] = ids[j, 0], top[j, 0]  # (repeats of the first: the same row)
        return ids, top

    def _walk(self, pos: int, first: int, n: int) -> Block:
        """DFlash2: each row of the lattice (unmasked: one per batch row) holds its top-k
        candidates, then k x k scores, [previous row's pick][this row's candidate]; the walk picks
        the best of each row given the pick before it (the first draft row's scores are the same
        for every 'pick', the last token being the only one)."""
        k = self.top_k
        lattice = np.ctypeslib.as_array(ll_ext.llama_get_embeddings_nextn(self._ctx), shape=(first + n, self.n_embd))[first:]
        candidates = lattice[:, :k].astype(np.int64)
        scores = lattice[:, k : k + k * k].reshape(n, k, k).astype(np.float32)
        tokens, stated, pick = [], [], 0
        for i in range(n):
            s = scores[i, pick]
            pick = int(np.argmax(s))
            tokens.append(int(candidates[i, pick]))
            stated.append(float(1.0 / np.exp(s - s[pick]).sum()))  # the selector's softmax at its pick
        return Block(pos, tokens, stated, None, candidates, scores, self.target.n_vocab)

    def _run(self, what: str) -> None:
        self.decodes += 1
        rc = ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        ll.llama_batch_ext_clear(self._batch)
        if rc != 0:
            raise BackendError(f"the {self.what} failed to {what} (llama_process code {rc})", "use another {mode}")

    # --- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        if getattr(self, "_chain", None) is not None:
            if self._ctx:
                ll.llama_set_sampler(self._ctx, 0, None)
            ll.llama_sampler_free(self._chain)
            self._chain = None
        _free_context(self)
        target = getattr(self, "target", None)
        if target is not None:
            read_layer_inputs(target, self, self.layers, False)
            if target.dflash is self:
                target.dflash = None
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None


def _output_on_device(opts: LoadOptions, n_layer: int) -> bool:
    """Does llama.cpp put a model's output head on a GPU under ``opts``? (It goes with the layer
    past the last: every layer and the output are offloaded.)"""
    gpu = opts.devices != () and supports_gpu_offload()
    return gpu and (opts.n_gpu_layers < 0 or opts.n_gpu_layers > n_layer)


def _meta(model, key: str) -> str | None:
    """A metadata value of a loaded model, as llama.cpp prints it (None: absent)."""
    buf = ctypes.create_string_buffer(64)
    n = ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode() if n >= 0 else None
