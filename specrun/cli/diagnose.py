"""What this machine can do for specrun, and what to fix. Data only; the CLI prints it."""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import dataclass, field

import psutil

from specrun import llama
from specrun.errors import SpecrunError
from specrun.fit import rpc
from specrun.fit.memory import GpuQuery, query_gpus

CUDA_FIX = 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python'
METAL_FIX = 'CMAKE_ARGS="-DGGML_METAL=on" pip install --force-reinstall --no-cache-dir llama-cpp-python'


@dataclass
class Report:
    facts: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"facts": dict(self.facts), "problems": self.problems, "ok": not self.problems}


def is_wsl() -> bool:
    try:
        with open("/proc/version") as f:
            return "microsoft" in f.read().lower()
    except OSError:
        return False


def is_apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def _version(v: tuple[int, int, int]) -> str:
    return ".".join(map(str, v))


def check_rpc(r: Report, endpoints: tuple[str, ...]) -> None:
    """RPC support in this build, and each worker: answers? which protocol? free memory?"""
    if not llama.supports_rpc():
        r.facts.append(("rpc", "no (llama_cpp was built without the RPC backend)"))
        r.problems.append(
            "llama_cpp has no RPC backend, so --rpc and `specrun worker` cannot work; fix: bash scripts/install.sh (it builds with -DGGML_RPC=on)"
        )
        return
    built = llama.rpc_protocol_built()
    r.facts.append(
        ("rpc", f"yes, protocol {_version(built or rpc.PROTOCOL)}: --rpc HOST:PORT uses workers, `specrun worker` serves this machine")
    )
    if built is not None and built != rpc.PROTOCOL:
        r.problems.append(
            f"llama_cpp speaks RPC protocol {_version(built)} but this specrun speaks {_version(rpc.PROTOCOL)}; fix: install the "
            "llama-cpp-python version this specrun pins (scripts/install.sh)"
        )
    for ep in endpoints:
        try:
            version = rpc.handshake(ep)
            devs = [d for d in llama.add_workers((ep,))]
        except SpecrunError as e:
            r.facts.append((f"worker {ep}", "not usable"))
            r.problems.append(f"{e.message}; fix: {e.fix}" if e.fix else e.message)
            continue
        mem = "; ".join(f"{d.name}: {d.free / 2**30:.1f} GiB free of {d.total / 2**30:.1f} GiB" for d in devs)
        r.facts.append((f"worker {ep}", f"answers, protocol {_version(version)}; {mem}"))


def diagnose(gpu_query: GpuQuery | None = None, rpc_endpoints: tuple[str, ...] = ()) -> Report:
    r = Report()
    wsl, apple = is_wsl(), is_apple_silicon()
    plat = f"{platform.system()} {platform.release()} {platform.machine()}"
    if wsl:
        plat += " (WSL2)"
    if apple:
        plat += " (Apple Silicon, unified memory)"
    r.facts.append(("platform", plat))
    r.facts.append(("python", platform.python_version()))
    offload = llama.supports_gpu_offload()
    r.facts.append(("llama_cpp", f"{llama.version()}, GPU offload: {'yes' if offload else 'no'}"))
    check_rpc(r, rpc_endpoints)
    gq = gpu_query if gpu_query is not None else query_gpus()
    if gq.gpus:
        r.facts.append(("nvidia driver", str(gq.driver)))
        for g in gq.gpus:
            r.facts.append((f"gpu {g.index}", f"{g.name}: {g.free / 2**30:.1f} GiB free of {g.total / 2**30:.1f} GiB"))
    else:
        r.facts.append(("nvidia", f"none ({gq.problem})"))
    vm = psutil.virtual_memory()
    r.facts.append(("system RAM", f"{vm.available / 2**30:.1f} GiB available of {vm.total / 2**30:.1f} GiB"))
    r.facts.append(("cpu cores", str(os.cpu_count())))

    has_driver_tool = bool(shutil.which("nvidia-smi"))  # nvcc alone is a toolkit, not a GPU
    if shutil.which("nvcc") and not has_driver_tool and not gq.gpus:
        r.facts.append(("cuda toolkit", "nvcc found but no NVIDIA driver: CPU only on this machine"))
    if not offload:
        if gq.gpus or has_driver_tool:
            r.problems.append(f"an NVIDIA GPU is present but llama_cpp was built without CUDA; fix: {CUDA_FIX}")
        elif apple:
            r.problems.append(f"llama_cpp was built without Metal on Apple Silicon; fix: {METAL_FIX}")
    if has_driver_tool and not gq.gpus:
        fix = (
            "install the NVIDIA driver on Windows (not inside WSL2) and update WSL"
            if wsl
            else "install or repair the NVIDIA driver, then check nvidia-smi"
        )
        r.problems.append(f"nvidia-smi is installed but NVML found no GPU ({gq.problem}); fix: {fix}")
    if vm.available < 2 * 2**30:
        r.problems.append(f"only {vm.available / 2**30:.1f} GiB RAM available; fix: close other programs or use smaller models")
    return r
