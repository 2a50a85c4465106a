"""The compute devices ggml sees, RPC workers among them, and serving them as a worker."""

from __future__ import annotations

import ctypes
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as ll

from specrun.errors import BackendError, SpecrunError, UsageError, WorkerUnreachable
from specrun.fit import rpc
from specrun.llama.ffi import _ensure_init


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
