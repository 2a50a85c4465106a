"""Opening a target/draft pair for generation: check first, then load, then report placement.

Shared by `generate`, `chat` and `bench`. Returns notices as strings; the CLI prints them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import backend
from .backend import LoadOptions, Model
from .compat import check_vocab
from .control import CostModel, CostStore
from .errors import IncompatiblePair
from .memory import check_fit, estimate
from .modelinfo import ModelInfo, model_info

GPU_REINSTALL = (
    "this llama-cpp-python build cannot offload to a GPU, so everything runs on the CPU; for NVIDIA "
    "reinstall with: CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install --force-reinstall --no-cache-dir "
    "llama-cpp-python (Apple Silicon: -DGGML_METAL=on), or run scripts/install.sh"
)


@dataclass(frozen=True)
class PairConfig:
    n_ctx: int = 4096
    gpu_layers: int = -1
    gpu_layers_draft: int | None = None
    threads: int = 2
    verbose: bool = False


@dataclass
class OpenPair:
    target: Model
    draft: Model | None
    target_info: ModelInfo
    draft_info: ModelInfo | None
    notices: list[str] = field(default_factory=list)
    cost_key: str = ""

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
        self.target.close()


def open_pair(target_path: Path, draft_path: Path | None, cfg: PairConfig) -> OpenPair:
    """Check the vocabularies from headers (before any weights load), then load both."""
    t_info = model_info(target_path)
    d_info = model_info(draft_path) if draft_path is not None else None
    if d_info is not None:
        compat = check_vocab(t_info, d_info)
        if not compat.compatible:
            raise IncompatiblePair(
                f"{d_info.path.name} cannot draft for {t_info.path.name}: {compat.reason()}",
                "pick a draft of the same family (specrun check-pair shows the details) or use --draft ngram",
            )
    notices = []
    mems = [estimate(t_info, "target", cfg.n_ctx, cfg.gpu_layers)]
    if d_info is not None:
        dl = cfg.gpu_layers if cfg.gpu_layers_draft is None else cfg.gpu_layers_draft
        mems.append(estimate(d_info, "draft", cfg.n_ctx, dl))
    fit = check_fit(mems)
    if not fit.fits:
        short = ", ".join(f"{p.name} needs {p.need / 2**30:.1f} GiB of {p.free / 2**30:.1f} GiB free" for p in fit.pools if not p.fits)
        notices.append(f"warning: the models may not fit ({short}); lower -c or --gpu-layers if loading fails")
    if cfg.gpu_layers != 0 and not backend.supports_gpu_offload():
        notices.append(GPU_REINSTALL)
    opts = LoadOptions(n_ctx=cfg.n_ctx, n_gpu_layers=cfg.gpu_layers, n_threads=cfg.threads, verbose=cfg.verbose)
    target = Model(target_path, opts)
    draft = None
    try:
        if draft_path is not None:
            dl = cfg.gpu_layers if cfg.gpu_layers_draft is None else cfg.gpu_layers_draft
            draft = Model(draft_path, LoadOptions(n_ctx=cfg.n_ctx, n_gpu_layers=dl, n_threads=cfg.threads, n_outputs_max=1, verbose=cfg.verbose))
    except BaseException:
        target.close()
        raise
    for role, m in (("target", target), ("draft", draft)):
        if m is not None and m.offload.reported:
            notices.append(f"{role}: {m.offload.layers}/{m.offload.total} layers offloaded to the GPU")
    p = OpenPair(target, draft, t_info, d_info, notices)
    p.cost_key = cost_key(t_info, d_info, cfg)
    return p


def cost_key(t: ModelInfo, d: ModelInfo | None, cfg: PairConfig) -> str:
    parts = [f"{t.path.name}:{t.file_size}"]
    if d is not None:
        parts.append(f"{d.path.name}:{d.file_size}")
    parts += [f"t{cfg.threads}", f"ngl{cfg.gpu_layers}/{cfg.gpu_layers_draft}", f"llama_cpp {backend.version()}"]
    parts.append("gpu" if backend.supports_gpu_offload() and cfg.gpu_layers != 0 else "cpu")
    return "|".join(parts)


def load_costs(store: CostStore, key: str) -> CostModel:
    return store.load(key) or CostModel()
