"""How much of a verify goes to the network when the target is split over RPC workers.

ggml's RPC client gives no timings of its own, so this measures from outside, per verify batch
size (the sizes the cost model uses):

* the verify time through the split, as the engine sees it (best of three);
* the same verify with the target loaded on this machine alone (its local GPUs, else the CPU),
  when it fits here: the difference is what the split adds. On one machine (a loopback worker)
  that is exactly the network and RPC overhead. Across machines it also holds the difference
  between the worker's compute and this machine's, so it is an upper bound on the network;
* the bytes through the workers' sockets per verify and their smoothed round-trip time (Linux's
  TCP_INFO), which need no local copy: the lower bound on the network is the round trips.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specrun.fit import rpc
from specrun.fit.memory import Dev
from specrun.fit.placement import fit, plan
from specrun.llama import LoadOptions, Model
from specrun.run.config import PairConfig
from specrun.run.inventory import inventory
from specrun.run.session import OpenPair

SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class VerifyCost:
    batch: int
    split_s: float  # one verify through the RPC split
    local_s: float | None  # the same on this machine alone (None: the target does not fit here)
    sent: int | None  # bytes to the workers per verify
    received: int | None

    @property
    def network_share(self) -> float | None:
        """The share of a verify the split adds over the local run (0 when it adds nothing)."""
        if self.local_s is None or self.split_s <= 0:
            return None
        return max(0.0, self.split_s - self.local_s) / self.split_s

    def to_json(self) -> dict:
        return {
            "batch": self.batch,
            "split_ms": round(1000 * self.split_s, 3),
            "local_ms": None if self.local_s is None else round(1000 * self.local_s, 3),
            "network_share": None if self.network_share is None else round(self.network_share, 4),
            "bytes_sent": self.sent,
            "bytes_received": self.received,
        }


@dataclass
class NetworkReport:
    workers: tuple[str, ...]
    rows: list[VerifyCost] = field(default_factory=list)
    rtt_s: float | None = None
    note: str = ""

    def to_json(self) -> dict:
        return {
            "workers": list(self.workers),
            "rtt_ms": None if self.rtt_s is None else round(1000 * self.rtt_s, 3),
            "verify": [r.to_json() for r in self.rows],
            "note": self.note,
        }


def _verify_time(model: Model, pad: int, b: int, workers: tuple[str, ...], repeats: int = 3) -> tuple[float, rpc.Traffic | None]:
    """Best-of-``repeats`` seconds for one batch of ``b`` tokens with logits on every row (a
    verify), and the traffic of one such verify; the cache is left as it was."""
    base = model.n_past
    best = float("inf")
    moved = None
    model.checkpoint(full=True)  # hybrid/recurrent targets: each measured decode is undone
    for _ in range(repeats):
        before = rpc.traffic(workers) if workers else None
        t = time.perf_counter()
        model.eval([pad] * b, logits="all")
        dt = time.perf_counter() - t
        after = rpc.traffic(workers) if workers else None
        model.rollback(base)
        best = min(best, dt)
        if before is not None and after is not None:
            moved = after - before
    return best, moved


def _curve(
    model: Model, prompt: list[int], sizes: tuple[int, ...], workers: tuple[str, ...]
) -> dict[int, tuple[float, rpc.Traffic | None]]:
    model.reset()
    model.eval(prompt, logits="none")
    _verify_time(model, prompt[-1], 1, workers, repeats=1)  # the first decode after a pause is slow
    out = {b: _verify_time(model, prompt[-1], b, workers) for b in sizes if model.n_past + b <= model.n_ctx}
    model.reset()
    return out


def local_devices_only(inv: list[Dev]) -> list[Dev]:
    return [d for d in inv if d.kind != "rpc"]


def measure(pair: OpenPair, cfg: PairConfig, sizes: tuple[int, ...] = SIZES) -> NetworkReport:
    """The verify curve through the split and on this machine alone, with the traffic per
    verify. Leaves the pair's caches empty."""
    from specrun import llama

    workers = pair.workers
    report = NetworkReport(workers)
    prompt = pair.target.tokenize("def fibonacci(n):\n    ", add_special=True, parse_special=True)
    split = _curve(pair.target, prompt, sizes, workers)
    traffic = rpc.traffic(workers)
    report.rtt_s = traffic.rtt_s if traffic else None
    # the same target, placed on this machine's devices alone, if it fits next to what is loaded
    here = local_devices_only(inventory(llama.devices()))
    local_cfg = PairConfig(cfg.n_ctx, cfg.gpu_layers, cfg.gpu_layers_draft, cfg.threads, split_mode=cfg.split_mode)
    local_plan = plan(local_cfg, here, pair.target_info, None)
    where = local_plan.target
    room = fit(local_plan, here, pair.target_info, None, cfg.n_ctx)
    local: dict[int, tuple[float, rpc.Traffic | None]] = {}
    if room.fits:
        opts = LoadOptions(
            n_ctx=cfg.n_ctx, n_gpu_layers=where.gpu_layers, n_threads=cfg.threads, devices=where.devices,
            tensor_split=where.split if len(where.devices) > 1 else None,
        )  # fmt: skip
        with Model(pair.target.path, opts) as m:
            local = _curve(m, prompt, sizes, ())
        report.note = f"local run: the target on {', '.join(where.devices) or 'this CPU'} alone, {cfg.threads} threads"
    else:
        report.note = (
            f"the target does not fit on this machine alone ({room.short()}), so the network cannot be "
            "separated from the workers' compute; the bytes and round-trip time are measured"
        )
    for b, (t, moved) in split.items():
        report.rows.append(
            VerifyCost(b, t, local[b][0] if b in local else None, moved.sent if moved else None, moved.received if moved else None)
        )
    return report
