"""The devices a pair may use: this machine's GPUs and RAM, and the RPC workers' devices, as
placement sees them (ggml is asked through the backend, loaded only when this is called)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specrun.fit.memory import Dev, host_device
from specrun.run.config import PairConfig

if TYPE_CHECKING:
    from specrun.llama import Device


def inventory(found: list[Device]) -> list[Dev]:
    """ggml's devices as placement sees them: local GPUs, RPC devices, and this machine's RAM
    (psutil's available memory: ggml reports the CPU's total as free)."""
    out = []
    for d in found:
        if d.is_rpc:
            out.append(Dev(d.name, "rpc", d.free, d.total, d.description))
        elif d.kind in ("gpu", "igpu"):
            out.append(Dev(d.name, "gpu", d.free, d.total, d.description))
    return out + [host_device()]


def remote_devices(endpoints: tuple[str, ...]) -> list[Dev]:
    """The devices of these RPC workers (reached with a bounded handshake first)."""
    from specrun import llama

    return [Dev(d.name, "rpc", d.free, d.total, d.description) for d in llama.add_workers(endpoints)]


def connect(cfg: PairConfig) -> list[Dev]:
    """Reach the RPC workers (bounded; unreachable ones are an error naming them) and list
    every device the pair could use."""
    from specrun import llama

    llama.add_workers(cfg.rpc)
    return inventory(llama.devices())
