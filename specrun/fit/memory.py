"""Will the pair fit? Estimates from GGUF headers, laid out per device as llama.cpp lays them out.

Per model, and per device it touches:

* weights: each tensor's exact size, on the device of its layer. llama.cpp keeps the input layer
  (token embeddings) on the CPU, offloads the *last* ``gpu_layers`` of the ``n_layer + 1`` layers
  (the output layer counts), and cuts them among its devices at the cumulative tensor split:
  :func:`layer_devices` does the same arithmetic, in float32 as llama.cpp does;
* KV cache: ``n_ctx x n_head_kv x (head_dim_k + head_dim_v) x bytes(type)`` per layer, on the
  layer's device (the formula llama.cpp sizes its cache with); a hybrid's recurrent layers have
  none, but hold the recurrent state instead, ``1 + n_rs_seq`` copies of it where the
  architecture keeps snapshots, on the layer's device; the backend's checkpoints of that state
  sit in RAM (see ``architecture``);
* compute buffers: ``4 bytes x n_ubatch x (n_head x n_ctx + 4 n_embd + n_ff)`` for the
  activations and attention scores of one layer on every device that holds a layer, plus
  ``4 x n_ubatch x n_vocab`` for the logits on the output layer's device, and 64 MiB of runtime
  on each device and on the host.

Free memory: local NVIDIA GPUs from NVML through :func:`query_gpus`, the one function that
touches the driver (named ``CUDA0``, ``CUDA1``... as llama.cpp names them); RPC workers' devices
as their workers report them; the host's available RAM (psutil), which is also the right check
on Apple Silicon, where GPU and CPU share memory. A device fits when its need stays within 95%
of its free memory.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np
import psutil

from specrun.gguf.architecture import ROLLBACK_DEPTH
from specrun.gguf.facts import ModelFacts, ModelInfo

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


@dataclass(frozen=True)
class Dev:
    """A place memory is checked against: a local GPU, a device on an RPC worker, or this
    machine's RAM (name ``CPU``)."""

    name: str  # as llama.cpp names it: CUDA0, Metal, RPC0, CPU
    kind: str  # "gpu" (local), "rpc" (on a worker) or "cpu" (this machine's RAM)
    free: int
    total: int
    description: str = ""  # the GPU's model, or the worker's HOST:PORT


HOST = "CPU"


def host_device(available_ram: int | None = None) -> Dev:
    vm = psutil.virtual_memory()
    return Dev(HOST, "cpu", vm.available if available_ram is None else available_ram, vm.total, "system RAM")


def visible_gpus(gq: GpuQuery) -> list[Gpu]:
    """The NVML GPUs CUDA shows this process, in CUDA's numbering: CUDA_VISIBLE_DEVICES may
    hide some and renumber the rest (indices only; UUIDs keep NVML's order)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is None or not all(p.strip().isdigit() for p in vis.split(",") if p.strip()):
        return list(gq.gpus)
    by_index = {g.index: g for g in gq.gpus}
    return [by_index[int(p)] for p in vis.split(",") if p.strip() and int(p) in by_index]


def local_devices(gq: GpuQuery | None = None, available_ram: int | None = None) -> tuple[list[Dev], str]:
    """This machine's GPUs (NVML) and RAM, and a note on where the numbers come from."""
    gq = gq if gq is not None else query_gpus()
    gpus = visible_gpus(gq)
    devs = [Dev(f"CUDA{i}", "gpu", g.free, g.total, g.name) for i, g in enumerate(gpus)]
    if gpus:
        note = f"{len(gpus)} NVIDIA GPU{'s' if len(gpus) > 1 else ''}, driver {gq.driver}"
    else:
        note = f"no NVIDIA GPU found ({gq.problem}); system RAM is also what Apple Silicon's unified memory and CPU runs use"
    return devs + [host_device(available_ram)], note


@dataclass
class ModelMemory:
    role: str
    weights: int
    kv_cache: int
    compute: int
    by_device: dict[str, int]  # bytes on each device; "CPU" is this machine's RAM
    state: int = 0  # recurrent state: in the context (with its snapshots) plus the checkpoints in RAM

    @property
    def total(self) -> int:
        return sum(self.by_device.values())

    @property
    def on_host(self) -> int:
        return self.by_device.get(HOST, 0)

    @property
    def on_devices(self) -> int:
        return self.total - self.on_host


def compute_allowance(m: ModelFacts, n_ctx: int) -> int:
    return _activations(m, n_ctx) + _logits(m, n_ctx) + RUNTIME_OVERHEAD


def _activations(m: ModelFacts, n_ctx: int) -> int:
    return 4 * min(N_UBATCH, n_ctx) * (m.n_head * n_ctx + 4 * m.n_embd + m.n_ff)


def _logits(m: ModelFacts, n_ctx: int) -> int:
    return 4 * min(N_UBATCH, n_ctx) * m.n_vocab


def device_overhead(m: ModelInfo, n_ctx: int) -> int:
    """What holding any layer of ``m`` costs a device before the layer itself: its compute
    buffer and runtime."""
    return _activations(m, n_ctx) + RUNTIME_OVERHEAD


def largest_layer(m: ModelInfo, n_ctx: int, cache_type: str = "f16") -> int:
    lw = m.layer_weights()
    kv = m.kv_bytes_per_layer(n_ctx, cache_type)
    return max([b + k for b, k in zip(lw.blocks, kv)] + [lw.output + lw.tied_head])


def layer_devices(n_layer: int, gpu_layers: int, devices: tuple[str, ...], split: tuple[float, ...]) -> list[str]:
    """The device of each of the ``n_layer + 1`` layers (the last is the output layer), as
    llama.cpp's ``load_tensors`` assigns them: the last ``gpu_layers`` layers are offloaded and
    cut at the cumulative, normalised ``split`` (float32 arithmetic, ``upper_bound``)."""
    names = [HOST, *devices]
    return [names[i] for i in _layer_device_index(n_layer, gpu_layers, devices, split)]


def _layer_device_index(n_layer: int, gpu_layers: int, devices: tuple[str, ...], split: tuple[float, ...]) -> np.ndarray:
    """0 for the CPU, else 1 + the index into ``devices``, per layer (vectorised: a header may
    claim any number of layers)."""
    total = n_layer + 1
    if not devices:
        return np.zeros(total, dtype=np.int64)
    ngl = total if gpu_layers < 0 else min(gpu_layers, total)
    start = max(total - ngl, 0)
    weights = np.asarray(split if split else [1.0] * len(devices), dtype=np.float32)
    cum = np.cumsum(weights, dtype=np.float32)
    cum = (cum / cum[-1]).astype(np.float32)
    il = np.arange(total)
    x = (il - start).astype(np.float32) / np.float32(max(ngl, 1))
    k = np.minimum(np.searchsorted(cum, x, side="right"), len(devices) - 1) + 1  # std::upper_bound
    return np.where(il < start, 0, k)


def estimate(
    m: ModelInfo,
    role: str,
    n_ctx: int,
    gpu_layers: int,
    devices: tuple[str, ...] = (),
    split: tuple[float, ...] = (),
    cache_type: str = "f16",
) -> ModelMemory:
    """Where one model's memory goes with its layers on ``devices`` (none: all in RAM)."""
    lw = m.layer_weights()
    names = [HOST, *devices]
    where = _layer_device_index(m.n_layer, gpu_layers, devices, split)
    per_layer = np.asarray(lw.blocks, dtype=np.float64) + np.asarray(m.kv_bytes_per_layer(n_ctx, cache_type), dtype=np.float64)
    per_layer[: m.n_layer] += _state_per_layer(m, m.n_layer)
    sums = np.bincount(where[:-1], weights=per_layer, minlength=len(names)) if m.n_layer else np.zeros(len(names))
    by: dict[str, int] = defaultdict(int)
    for i, name in enumerate(names):
        if sums[i]:
            by[name] += int(sums[i])
    by[HOST] += lw.input + RUNTIME_OVERHEAD + m.arch.checkpoint_total()
    out_dev = names[int(where[-1])]
    tied = lw.tied_head if out_dev != HOST else 0
    by[out_dev] += lw.output + tied
    act, logits = _activations(m, n_ctx), _logits(m, n_ctx)
    used = {names[i] for i in np.unique(where)}
    for dev in used:
        by[dev] += act + (RUNTIME_OVERHEAD if dev != HOST else 0)
    by[out_dev] += logits
    compute = act * len(used) + logits + RUNTIME_OVERHEAD * len(used | {HOST})
    state = m.arch.state_total(ROLLBACK_DEPTH) + m.arch.checkpoint_total()
    return ModelMemory(role, m.weights_bytes + tied, sum(m.kv_bytes_per_layer(n_ctx, cache_type)), compute, dict(by), state)


def _state_per_layer(m: ModelInfo, n_layer: int) -> np.ndarray:
    """The recurrent state's bytes in the context (snapshots included), per layer."""
    out = np.zeros(n_layer)
    rec = m.arch.recurrent_layers
    if rec is None or not sum(rec):
        return out
    flags = np.asarray(list(rec)[:n_layer] + [False] * max(0, n_layer - len(rec)), dtype=bool)
    out[flags] = m.arch.state_total(ROLLBACK_DEPTH) / sum(rec)
    return out


def estimate_local(m: ModelFacts, role: str, n_ctx: int, cache_type: str = "f16") -> ModelMemory:
    """One model wholly in this machine's RAM (a CPU run; unified memory), from header totals
    alone: what draft discovery shows for files it has only summarised."""
    kv = m.kv_bytes(n_ctx, cache_type)
    compute = compute_allowance(m, n_ctx)
    return ModelMemory(role, m.weights_bytes, kv, compute, {HOST: m.weights_bytes + kv + compute})


@dataclass
class Share:
    """One device's load: what each model puts there, against its free memory."""

    device: Dev
    target: int = 0
    draft: int = 0

    @property
    def need(self) -> int:
        return self.target + self.draft

    @property
    def headroom(self) -> int:
        return self.device.free - self.need

    @property
    def fits(self) -> bool:
        return self.need <= self.device.free * (1 - HEADROOM_FRACTION)

    def to_json(self) -> dict:
        d = asdict(self.device)
        return {**d, "target": self.target, "draft": self.draft, "need": self.need, "headroom": self.headroom, "fits": self.fits}


@dataclass
class Fit:
    models: list[ModelMemory]
    shares: list[Share]  # every device known, then this machine's RAM
    note: str
    proposals: list = field(default_factory=list)  # placement.Proposal, when it does not fit

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.shares)

    def short(self) -> str:
        """The devices that overflow, in words."""
        return ", ".join(
            f"{s.device.name} needs {s.need / 2**30:.1f} GiB of {s.device.free / 2**30:.1f} GiB free" for s in self.shares if not s.fits
        )

    def to_json(self) -> dict:
        return {
            "fits": self.fits,
            "note": self.note,
            "models": [{**asdict(mm), "total": mm.total, "on_devices": mm.on_devices, "on_host": mm.on_host} for mm in self.models],
            "devices": [s.to_json() for s in self.shares],
            "proposals": [p.to_json() for p in self.proposals],
        }


def check_fit(models: list[ModelMemory], inventory: list[Dev], note: str = "") -> Fit:
    """Each device's share of the models against its free memory. A device no model uses is
    listed too (with nothing on it), so the table shows everything that could take a share."""
    shares = {d.name: Share(d) for d in inventory}
    for mm in models:
        for name, n in mm.by_device.items():
            share = shares.get(name) or shares.setdefault(name, Share(Dev(name, "gpu", 0, 0, "not found")))
            if mm.role == "draft":
                share.draft += n
            else:
                share.target += n
    ordered = [s for s in shares.values() if s.device.kind != "cpu"] + [s for s in shares.values() if s.device.kind == "cpu"]
    return Fit(models, ordered, note)
