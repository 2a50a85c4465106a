"""How to load a pair: the context, layers, threads and placement every front end sets, with
their defaults and their checks (``PairConfig``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from specrun.errors import UsageError
from specrun.fit.placement import check_settings
from specrun.fit.rpc import parse_endpoints


@dataclass(frozen=True)
class PairConfig:
    """How to load a pair. Every front end builds one of these; its defaults are the defaults."""

    n_ctx: int = 4096
    gpu_layers: int = -1
    gpu_layers_draft: int | None = None
    threads: int = field(default_factory=lambda: default_threads())
    verbose: bool = False
    # placement (see placement.py): device names for each model (None: specrun's default, which
    # puts the draft wholly on one local GPU; () the CPU alone), the target's proportions per
    # device, llama.cpp's split mode and main GPU, and the RPC workers whose devices join in
    devices: tuple[str, ...] | None = None
    devices_draft: tuple[str, ...] | None = None
    tensor_split: tuple[float, ...] | None = None
    split_mode: str = "layer"
    main_gpu: int | None = None
    rpc: tuple[str, ...] = ()
    # sequences decoding together in one context (serve's slots); None: as many as memory
    # allows, up to PARALLEL_AUTO_MAX (1 where the pair cannot share a context that way)
    parallel: int | None = 1

    def __post_init__(self):
        _check_range("n_ctx", self.n_ctx, 16, 1 << 24)
        _check_range("threads", self.threads, 1, 1024)
        _check_range("gpu_layers", self.gpu_layers, -1)
        if self.gpu_layers_draft is not None:
            _check_range("gpu_layers_draft", self.gpu_layers_draft, -1)
        if self.parallel is not None:
            _check_range("parallel", self.parallel, 1, 64)
        check_settings(self)
        if self.rpc:
            parse_endpoints(self.rpc)


def default_threads() -> int:
    """All cores up to 8 (more rarely helps token generation, which is memory-bound)."""
    return max(1, min(os.cpu_count() or 2, 8))


def _check_range(field: str, value: int, lo: int, hi: int | None = None) -> None:
    if value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UsageError(f"{{{field}}} must be {bounds}, got {value}", f"pass a value {bounds}", field)
