"""Will the pair fit? Estimates from GGUF headers, compared with free GPU or system memory.

Per model:

* weights: the sum of its tensor sizes (exact; offloaded in proportion to ``gpu_layers``);
* KV cache: ``n_ctx x sum over layers of n_head_kv x (head_dim_k + head_dim_v) x bytes(type)``,
  the same formula llama.cpp uses to size its cache;
* compute allowance: llama.cpp's scratch buffers for one micro-batch, approximated by
  ``4 bytes x n_ubatch x (n_vocab + n_head x n_ctx + 4 n_embd + n_ff)`` (logits, attention
  scores without flash attention, activations), plus a fixed 64 MiB for the runtime.

GPU memory comes from NVML through :func:`query_gpus`, the one function that touches the
driver; with no NVIDIA GPU or driver, the check is against available system RAM (psutil),
which is also the right check on Apple Silicon, where GPU and CPU share memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol

import psutil


class ModelShape(Protocol):
    """What an estimate reads: a ModelInfo, or a cached summary of one (specrun.catalog)."""

    @property
    def weights_bytes(self) -> int: ...
    @property
    def n_vocab(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_ff(self) -> int: ...
    def kv_bytes(self, n_ctx: int, cache_type: str = "f16") -> int: ...


MiB = 1 << 20
N_UBATCH = 512
RUNTIME_OVERHEAD = 64 * MiB
HEADROOM_FRACTION = 0.05  # keep 5% of free memory for fragmentation and the driver


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total: int
    free: int


@dataclass
class GpuQuery:
    gpus: list[Gpu]
    driver: str | None = None
    problem: str | None = None  # why there are no GPUs, in words


def query_gpus() -> GpuQuery:
    """Free memory per NVIDIA GPU via NVML. The only code that talks to the NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        return GpuQuery([], problem="the nvidia-ml-py package is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError subclasses, or a missing libnvidia-ml
        return GpuQuery([], problem=f"no NVIDIA driver ({e})")
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            gpus.append(Gpu(i, name, int(mem.total), int(mem.free)))
        return GpuQuery(gpus, driver=driver if isinstance(driver, str) else driver.decode())
    except Exception as e:
        return GpuQuery([], problem=f"NVML failed: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


@dataclass
class ModelMemory:
    role: str
    weights: int
    kv_cache: int
    compute: int
    gpu_fraction: float  # share of layers offloaded

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute

    @property
    def on_gpu(self) -> int:
        return int((self.weights + self.kv_cache) * self.gpu_fraction) + (self.compute if self.gpu_fraction > 0 else 0)

    @property
    def on_host(self) -> int:
        return self.total - self.on_gpu


def compute_allowance(m: ModelShape, n_ctx: int) -> int:
    per_row = m.n_vocab + m.n_head * n_ctx + 4 * m.n_embd + m.n_ff
    return 4 * min(N_UBATCH, n_ctx) * per_row + RUNTIME_OVERHEAD


def gpu_fraction(m: ModelShape, gpu_layers: int) -> float:
    """llama.cpp offloads n of n_layer+1 'layers' (the +1 is the output layer)."""
    total = m.n_layer + 1
    n = total if gpu_layers < 0 else min(gpu_layers, total)
    return n / total if total else 0.0


def estimate(m: ModelShape, role: str, n_ctx: int, gpu_layers: int, cache_type: str = "f16") -> ModelMemory:
    return ModelMemory(
        role=role,
        weights=m.weights_bytes,
        kv_cache=m.kv_bytes(n_ctx, cache_type),
        compute=compute_allowance(m, n_ctx),
        gpu_fraction=gpu_fraction(m, gpu_layers),
    )


@dataclass
class Pool:
    """One pool of memory the models are checked against: a GPU set or system RAM."""

    name: str
    free: int
    need: int

    @property
    def headroom(self) -> int:
        return self.free - self.need

    @property
    def fits(self) -> bool:
        return self.need <= self.free * (1 - HEADROOM_FRACTION)


@dataclass
class Fit:
    models: list[ModelMemory]
    pools: list[Pool]
    gpus: list[Gpu]
    device: str  # "cuda" or "cpu"
    note: str
    per_gpu_need: list[int] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.pools)

    def to_json(self) -> dict:
        return {
            "fits": self.fits,
            "device": self.device,
            "note": self.note,
            "models": [{**asdict(mm), "total": mm.total, "on_gpu": mm.on_gpu, "on_host": mm.on_host} for mm in self.models],
            "pools": [{**asdict(p), "headroom": p.headroom, "fits": p.fits} for p in self.pools],
            "gpus": [{**asdict(g), "need": n} for g, n in zip(self.gpus, self.per_gpu_need)],
        }


def check_fit(models: list[ModelMemory], gpu_query: GpuQuery | None = None, available_ram: int | None = None) -> Fit:
    """Compare the estimates with free memory. GPUs share the load in proportion to their free
    memory, as llama.cpp's default tensor split does; what is not offloaded lives in RAM."""
    gq = gpu_query if gpu_query is not None else query_gpus()
    ram = available_ram if available_ram is not None else psutil.virtual_memory().available
    host_need = sum(mm.on_host for mm in models)
    gpu_need = sum(mm.on_gpu for mm in models)
    if gq.gpus:
        free = sum(g.free for g in gq.gpus)
        shares = [int(gpu_need * g.free / free) if free else gpu_need for g in gq.gpus]
        pools = [Pool(f"GPU {g.index} ({g.name})", g.free, s) for g, s in zip(gq.gpus, shares)]
        pools.append(Pool("system RAM", ram, host_need))
        n = len(gq.gpus)
        note = f"{n} NVIDIA GPU{'s' if n > 1 else ''}, driver {gq.driver}"
        return Fit(models, pools, gq.gpus, "cuda", note, shares)
    note = (
        f"no NVIDIA GPU found ({gq.problem}); checked against system RAM, "
        "which is also what Apple Silicon's unified memory and CPU runs use"
    )
    return Fit(models, [Pool("system RAM", ram, host_need + gpu_need)], [], "cpu", note)
