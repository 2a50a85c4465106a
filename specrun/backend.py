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
"""

from __future__ import annotations

import ctypes
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import llama_cpp as ll
import numpy as np
from llama_cpp import llama_cpp_ext as ll_ext

from . import rpc
from .architecture import CHECKPOINTS_KEPT, ROLLBACK_DEPTH
from .errors import BackendError, SpecrunError, UsageError, WorkerUnreachable

_OFFLOAD_RE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_LOG_LEVEL_ERROR = 4
PIECE_BYTES = 256  # a token piece longer than this is asked for again at its size
T = TypeVar("T")


class _Log:
    """llama.cpp's log, captured: kept quiet unless verbose, errors kept for messages."""

    def __init__(self):
        self.verbose = False
        self.lines: deque[str] = deque(maxlen=400)
        self.errors: deque[str] = deque(maxlen=20)
        self.lock = threading.Lock()
        self._cb = ll.llama_log_callback(self._on_log)  # keep a reference: C holds the pointer
        ll.llama_log_set(self._cb, ctypes.c_void_p(0))

    def _on_log(self, level, text, _user):
        s = text.decode("utf-8", errors="replace") if text else ""
        with self.lock:
            self.lines.append(s)
            if level == _LOG_LEVEL_ERROR:
                self.errors.append(s.strip())
        if self.verbose:
            sys.stderr.write(s)

    def mark(self) -> int:
        with self.lock:
            self.lines.clear()
            self.errors.clear()
        return 0

    def since_mark(self) -> list[str]:
        with self.lock:
            return list(self.lines)


_log: _Log | None = None
_batches_live = [0]  # llama_batch_init minus llama_batch_free, for leak checks


def live_batches() -> int:
    return _batches_live[0]


_init_lock = threading.Lock()


def _ensure_init(verbose: bool | None = None) -> _Log:
    """Initialise llama.cpp once; ``verbose`` (when given) turns its log on stderr on or off."""
    global _log
    with _init_lock:
        if _log is None:
            ll.llama_backend_init()
            _log = _Log()
        if verbose is not None:
            _log.verbose = verbose
        return _log


def version() -> str:
    return getattr(ll, "__version__", "unknown")


@dataclass(frozen=True)
class Device:
    """A compute device as ggml sees it."""

    name: str  # ggml's name, e.g. CUDA0, Metal, CPU, RPC0
    description: str  # the GPU's model; for an RPC device, its worker's HOST:PORT
    kind: str  # "cpu", "gpu", "igpu", "accel" or "meta" (ggml calls every RPC device a GPU)
    backend: str  # the registry it belongs to: CPU, CUDA, Metal, RPC, ...
    free: int  # bytes
    total: int

    @property
    def is_rpc(self) -> bool:
        return self.backend == "RPC"


_DEV_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")  # enum ggml_backend_dev_type, in order


def _ggml() -> ctypes.CDLL:
    """libggml from the llama_cpp package (llama-cpp-python binds llama.h only)."""
    global _ggml_lib
    if _ggml_lib is None:
        libdir = Path(ll.__file__).parent / "lib"
        name = next((p for p in ("libggml.so", "libggml.dylib", "ggml.dll") if (libdir / p).exists()), None)
        if name is None:  # pragma: no cover - an unusual build layout
            raise BackendError(f"cannot find libggml next to llama_cpp in {libdir}", "reinstall with scripts/install.sh")
        lib = ctypes.CDLL(str(libdir / name))
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for fn, res, args in (
            ("ggml_backend_dev_count", sz, []),
            ("ggml_backend_dev_get", vp, [sz]),
            ("ggml_backend_dev_name", ctypes.c_char_p, [vp]),
            ("ggml_backend_dev_description", ctypes.c_char_p, [vp]),
            ("ggml_backend_dev_type", ctypes.c_int, [vp]),
            ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]),
            ("ggml_backend_dev_backend_reg", vp, [vp]),
            ("ggml_backend_reg_name", ctypes.c_char_p, [vp]),
            ("ggml_backend_reg_by_name", vp, [ctypes.c_char_p]),
            ("ggml_backend_reg_get_proc_address", vp, [vp, ctypes.c_char_p]),
            ("ggml_backend_reg_dev_count", sz, [vp]),
            ("ggml_backend_reg_dev_get", vp, [vp, sz]),
            ("ggml_backend_register", None, [vp]),
            ("ggml_set_abort_callback", vp, [vp]),
        ):
            getattr(lib, fn).restype = res
            getattr(lib, fn).argtypes = args
        _ggml_lib = lib
    return _ggml_lib


_ggml_lib: ctypes.CDLL | None = None


def _device(d: int) -> Device:
    g = _ggml()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    g.ggml_backend_dev_memory(d, ctypes.byref(free), ctypes.byref(total))
    kind = g.ggml_backend_dev_type(d)
    return Device(
        (g.ggml_backend_dev_name(d) or b"").decode(errors="replace"),
        (g.ggml_backend_dev_description(d) or b"").decode(errors="replace"),
        _DEV_KINDS[kind] if 0 <= kind < len(_DEV_KINDS) else str(kind),
        (g.ggml_backend_reg_name(g.ggml_backend_dev_backend_reg(d)) or b"").decode(errors="replace"),
        free.value,
        total.value,
    )


def devices() -> list[Device]:
    """Every device llama.cpp can place layers on (local GPUs, RPC workers once added, the CPU).
    An RPC device's memory is asked of its worker, over the network."""
    _ensure_init()
    g = _ggml()
    return [_device(g.ggml_backend_dev_get(i)) for i in range(g.ggml_backend_dev_count())]


def _device_handle(name: str) -> int:
    """ggml's handle for the device called ``name`` (case does not matter)."""
    g = _ggml()
    for i in range(g.ggml_backend_dev_count()):
        d = g.ggml_backend_dev_get(i)
        if (g.ggml_backend_dev_name(d) or b"").decode(errors="replace").lower() == name.lower():
            return d
    have = ", ".join(x.name for x in devices())
    raise UsageError(f"no device called {name!r} in {{devices}}; llama.cpp sees {have}", "see `specrun devices`", "devices")


def supports_gpu_offload() -> bool:
    """Does this build have a local GPU backend (CUDA, Metal, ...)? llama.cpp's own
    ``llama_supports_gpu_offload`` also says yes for a build with only the RPC backend."""
    return any(d.kind in ("gpu", "igpu") and d.backend != "RPC" for d in devices())


def supports_rpc() -> bool:
    return bool(ll.llama_supports_rpc())


# --- RPC: workers on other machines, and serving this one ---------------------------------------

_workers: dict[str, int] = {}  # endpoint -> the ggml registry of its devices, registered once


def rpc_protocol_built() -> tuple[int, int, int] | None:
    """The RPC protocol version in the installed llama.cpp headers (None if they are not there)."""
    header = Path(ll.__file__).parent.parent / "include" / "ggml-rpc.h"
    try:
        text = header.read_text()
    except OSError:
        return None
    found = re.findall(r"#define RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)", text)
    v = dict(found)
    return (int(v["MAJOR"]), int(v["MINOR"]), int(v["PATCH"])) if len(v) == 3 else None


def _rpc_fn(name: str, restype, *argtypes):
    """A function of ggml's RPC backend, found as llama.cpp finds it (through the registry)."""
    _ensure_init()
    if not supports_rpc():
        raise BackendError(
            "this llama-cpp-python was built without the RPC backend",
            'reinstall with scripts/install.sh (it adds CMAKE_ARGS="-DGGML_RPC=on")',
        )
    g = _ggml()
    reg = g.ggml_backend_reg_by_name(b"RPC")
    addr = g.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg else None
    if not addr:  # pragma: no cover - an RPC build always exports both
        raise BackendError(f"llama.cpp's RPC backend has no {name}", "reinstall with scripts/install.sh")
    return ctypes.CFUNCTYPE(restype, *argtypes)(addr)


@ctypes.CFUNCTYPE(None, ctypes.c_char_p)
def _on_abort(message: bytes | None) -> None:
    text = (message or b"").decode(errors="replace").strip()
    err: SpecrunError
    if _workers and any(w in text for w in ("RPC", "Remote", "connect to", "handshake")):
        gone = [ep for ep in _workers if not rpc.alive(ep)]
        who = ", ".join(gone or _workers)
        err = WorkerUnreachable(
            f"lost the RPC worker {who}: {'it no longer accepts connections' if gone else 'the connection broke'}",
            "restart the worker and run the command again",
            "rpc",
        )
    else:
        err = BackendError(f"llama.cpp aborted: {text}")
    rpc.fatal(err)


def add_workers(endpoints: tuple[str, ...]) -> list[Device]:
    """Connect to RPC workers and register their devices with llama.cpp (once per process); the
    devices, in the order given. Each worker first has to answer specrun's own bounded handshake:
    ggml connects without a timeout and aborts the process on a failure."""
    if not endpoints:
        return []
    add = _rpc_fn("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
    g = _ggml()
    g.ggml_set_abort_callback(ctypes.cast(_on_abort, ctypes.c_void_p))
    out = []
    for ep in endpoints:
        if ep not in _workers:
            rpc.handshake(ep)
            reg = add(ep.encode())
            if not reg:
                raise WorkerUnreachable(
                    f"RPC worker {ep} serves no device", "start it with at least one (specrun worker --device ...)", "rpc"
                )
            g.ggml_backend_register(reg)
            _workers[ep] = reg
        reg = _workers[ep]
        out += [_device(g.ggml_backend_reg_dev_get(reg, i)) for i in range(g.ggml_backend_reg_dev_count(reg))]
    return out


def workers() -> tuple[str, ...]:
    """The RPC workers this process has connected to."""
    return tuple(_workers)


def worker_devices(names: tuple[str, ...] | None) -> list[Device]:
    """The local devices a worker would serve: ``names`` (case does not matter, ``CPU`` allowed),
    else every local GPU, else the CPU (as llama.cpp's rpc-server chooses)."""
    local = [d for d in devices() if not d.is_rpc]
    if names is None:
        return [d for d in local if d.kind in ("gpu", "igpu")] or [d for d in local if d.kind == "cpu"]
    by_name = {d.name.lower(): d for d in local}
    unknown = [n for n in names if n.lower() not in by_name]
    if unknown:
        raise UsageError(
            f"no local device called {unknown[0]!r}; this machine has {', '.join(d.name for d in local)}", "see `specrun devices`", "device"
        )
    return [by_name[n.lower()] for n in names]


def _line_buffered_c_stdout() -> None:
    """llama.cpp's server prints with printf: flush C's stdout line by line, even into a pipe."""
    try:
        libc = ctypes.CDLL(None)
        stream = ctypes.c_void_p.in_dll(libc, "stdout" if sys.platform.startswith("linux") else "__stdoutp")
        libc.setvbuf(stream, None, 1, 0)  # _IOLBF
    except (OSError, ValueError, AttributeError):
        pass


def serve(endpoint: str, served: list[Device], cache_dir: Path | None, threads: int) -> None:
    """Serve ``served`` to RPC clients on ``endpoint`` through llama.cpp's own RPC server. Blocks;
    returns only if the server could not start or stopped (llama.cpp prints why)."""
    start = _rpc_fn(
        "ggml_backend_rpc_start_server",
        None,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p),
    )
    handles = (ctypes.c_void_p * len(served))(*[_device_handle(d.name) for d in served])
    _line_buffered_c_stdout()
    sys.stdout.flush()
    start(endpoint.encode(), str(cache_dir).encode() if cache_dir else None, threads, len(served), handles)


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
        # built-in MTP heads, an EAGLE-3 head
        self.heads: MtpHeads | None = None
        self.eagle3: Eagle3Head | None = None
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
        self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
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
    def _attached(self) -> list[DraftHead]:
        return [f for f in (self.heads, self.eagle3) if f is not None]

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

    def sequence(self, seq: int, gate: Gate) -> Sequence:
        """Sequence ``seq`` of this context (loaded with ``n_seq_max`` > ``seq``), decoding through ``gate``."""
        return Sequence(self, seq, gate)

    def _decode_many(self, asks: list[_Ask]) -> None:
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
        attached heads, MTP or EAGLE-3, move with it)."""
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
        self.heads = self.eagle3 = None
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
        if self._batch is not None:
            ll.llama_batch_ext_free(self._batch)
            self._batch = None
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
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


def _head_context(model, target: Model, log: _Log, name: str, mtp: bool, n_batch: int | None = None):
    """A context for draft heads on ``model``, beside ``target``'s (its ``ctx_other``), with the
    target's size and threads: an MTP context (``mtp``: one output row, as a draft step reads
    one and catching up none; no recurrent snapshots), else a plain one. ``n_batch`` (default
    the target's) is also its ubatch. ``name`` says what failed."""
    cp = ll.llama_context_default_params()
    cp.n_ctx = target.n_ctx
    cp.n_batch = cp.n_ubatch = n_batch or target.n_batch
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
        for lid in sorted(set(self.layers)):  # the target hands out these layers' inputs from now on
            _eagle3_fn("llama_set_embeddings_layer_inp")(target._ctx, lid, True)
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
        if self.target._ctx:  # the target no longer hands out its layer inputs
            for lid in sorted(set(self.layers)):
                _eagle3_fn("llama_set_embeddings_layer_inp")(self.target._ctx, lid, False)
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None


# --- several sequences in one context ---------------------------------------------------------


@dataclass
class _Ask:
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
        self.pending: dict[int, list[_Ask]] = {}  # id(model) -> asks, oldest first
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

    def decode(self, ask: _Ask) -> _Ask:
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
    heads = eagle3 = None

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
            ask = self.gate.decode(_Ask(m, self.seq, chunk, self.n_past, logits if last_chunk else "none"))
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
