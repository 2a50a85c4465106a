"""Opening a target/draft pair for generation: resolve, check first, then load, then report.

Shared by every front end that loads models (generate, chat, bench, serve): resolving the
names, opening the pair, the engine with this machine's stored costs, and the chat prompt.
Returns notices as strings; the front end shows them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .compat import check_vocab
from .control import CostModel, CostStore
from .engine import Engine, Settings
from .errors import IncompatiblePair, InputError, UsageError
from .memory import check_fit, estimate
from .modelinfo import ModelInfo, model_info
from .registry import Registry, Resolved
from .sampling import Sampler
from .template import ChatTemplate, render_chat

if TYPE_CHECKING:  # llama_cpp is imported only when a pair is opened (header-only commands stay quick)
    from .backend import Model

GPU_REINSTALL = (
    "this llama-cpp-python build cannot offload to a GPU, so everything runs on the CPU; for NVIDIA "
    'reinstall with: CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir '
    "llama-cpp-python (Apple Silicon: -DGGML_METAL=on), or run scripts/install.sh"
)


@dataclass(frozen=True)
class PairConfig:
    """How to load a pair. Every front end builds one of these; its defaults are the defaults."""

    n_ctx: int = 4096
    gpu_layers: int = -1
    gpu_layers_draft: int | None = None
    threads: int = field(default_factory=lambda: default_threads())
    verbose: bool = False

    def __post_init__(self):
        _check_range("n_ctx", self.n_ctx, 16, 1 << 24)
        _check_range("threads", self.threads, 1, 1024)
        _check_range("gpu_layers", self.gpu_layers, -1)
        if self.gpu_layers_draft is not None:
            _check_range("gpu_layers_draft", self.gpu_layers_draft, -1)


def default_threads() -> int:
    """All cores up to 8 (more rarely helps token generation, which is memory-bound)."""
    return max(1, min(os.cpu_count() or 2, 8))


def cache_dir() -> Path:
    """Where specrun keeps what it measures: $SPECRUN_CACHE_DIR, else the XDG cache."""
    base = os.environ.get("SPECRUN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "specrun"
    )
    return Path(base)


def cost_store() -> CostStore:
    return CostStore(cache_dir() / "costs.json")


def _check_range(field: str, value: int, lo: int, hi: int | None = None) -> None:
    if value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UsageError(f"{{{field}}} must be {bounds}, got {value}", f"pass a value {bounds}", field)


def require_file(r: Resolved) -> Resolved:
    """A registry entry whose file is missing gets the entry's `source` as the fix."""
    if not r.path.exists() and r.entry is not None:
        how = r.entry.source or "download it or fix `path` in your models.toml"
        raise InputError(f"model {r.entry.name!r} is not on disk ({r.path})", f"get it with: {how}")
    return r


def resolve_pair(reg: Registry, model: str, draft_model: str | None, settings: Settings) -> tuple[Resolved, Resolved | None, Settings]:
    """The target and draft files for these names, and the settings as they apply: with no
    draft model to fall back on, hybrid drafting is the n-gram lookup alone."""
    target = require_file(reg.resolve(model))
    draft = None
    if "model" in settings.sources:
        d = reg.resolve(draft_model) if draft_model else reg.default_draft(target)
        if d is None:
            if settings.draft == "model":
                raise UsageError(
                    f"no draft model for {target.label}",
                    "give one ({draft_model}), set `draft` in its registry entry, or use {draft} ngram",
                    "draft_model",
                )
        else:
            draft = require_file(d)
    return target, draft, settings if draft is not None else settings.without_draft_model()


@dataclass
class OpenPair:
    target: Model
    draft: Model | None
    target_info: ModelInfo
    draft_info: ModelInfo | None
    notices: list[str] = field(default_factory=list)
    cost_key: str = ""
    labels: tuple[str, str | None] = ("", None)  # the names the user gave, as the registry resolved them

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
        self.target.close()


def open_pair(target_path: Path, draft_path: Path | None, cfg: PairConfig) -> OpenPair:
    """Check the vocabularies from headers (before any weights load), then load both."""
    from . import backend
    from .backend import LoadOptions, Model

    t_info = model_info(target_path)
    d_info = model_info(draft_path) if draft_path is not None else None
    if d_info is not None:
        compat = check_vocab(t_info, d_info)
        if not compat.compatible:
            raise IncompatiblePair(
                f"{d_info.path.name} cannot draft for {t_info.path.name}: {compat.reason()}",
                "pick a draft of the same family (specrun check-pair shows the details) or use {draft} ngram",
            )
    notices = []
    mems = [estimate(t_info, "target", cfg.n_ctx, cfg.gpu_layers)]
    if d_info is not None:
        dl = cfg.gpu_layers if cfg.gpu_layers_draft is None else cfg.gpu_layers_draft
        mems.append(estimate(d_info, "draft", cfg.n_ctx, dl))
    fit = check_fit(mems)
    if not fit.fits:
        short = ", ".join(f"{p.name} needs {p.need / 2**30:.1f} GiB of {p.free / 2**30:.1f} GiB free" for p in fit.pools if not p.fits)
        notices.append(f"warning: the models may not fit ({short}); lower {{n_ctx}} or {{gpu_layers}} if loading fails")
    if cfg.gpu_layers != 0 and not backend.supports_gpu_offload():
        notices.append(GPU_REINSTALL)
    opts = LoadOptions(n_ctx=cfg.n_ctx, n_gpu_layers=cfg.gpu_layers, n_threads=cfg.threads, verbose=cfg.verbose)
    target = Model(target_path, opts)
    draft = None
    try:
        if draft_path is not None:
            dl = cfg.gpu_layers if cfg.gpu_layers_draft is None else cfg.gpu_layers_draft
            draft = Model(
                draft_path, LoadOptions(n_ctx=cfg.n_ctx, n_gpu_layers=dl, n_threads=cfg.threads, n_outputs_max=1, verbose=cfg.verbose)
            )
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
    from . import backend

    parts = [f"{t.path.name}:{t.file_size}"]
    if d is not None:
        parts.append(f"{d.path.name}:{d.file_size}")
    parts += [f"t{cfg.threads}", f"ngl{cfg.gpu_layers}/{cfg.gpu_layers_draft}", f"llama_cpp {backend.version()}"]
    parts.append("gpu" if backend.supports_gpu_offload() and cfg.gpu_layers != 0 else "cpu")
    return "|".join(parts)


def load_costs(store: CostStore, key: str) -> CostModel:
    learned = store.load(key)
    return learned.cost if learned is not None else CostModel()


def open_engine(
    pair: OpenPair,
    settings: Settings,
    sampler: Sampler,
    store: CostStore,
    on_notice: Callable[[str], None] | None = None,
    recalibrate: bool = False,
) -> Engine:
    """An engine that starts from what this pair learned on this machine before (costs,
    copies, near-ties), calibrated first if there is no verify curve yet (or ``recalibrate``).
    ``on_notice`` hears, in one line each, that a calibration starts (it takes seconds) and
    that one was disturbed (its curve serves this run only)."""
    learned = store.load(pair.cost_key)
    engine = Engine(pair.target, pair.draft, settings, sampler, learned=learned)
    if settings.sources and not settings.fixed and (recalibrate or not engine.cost.verify):
        if on_notice is not None:
            on_notice("measuring this machine's verify costs (stored for next time)...")
        engine.calibrate()
        why = engine.cost.measured.get("disturbed")
        if why and on_notice is not None:
            on_notice(f"the machine was busy while measuring ({why}): these costs serve this run only and are not stored")
    return engine


def model_template(pair: OpenPair) -> ChatTemplate:
    """The target's chat template, with its BOS and EOS token texts."""
    info = pair.target_info
    tok = info.tokens

    def text(i: int | None) -> str:
        return tok[i] if i is not None and 0 <= i < len(tok) else ""

    return ChatTemplate(info.chat_template, text(info.bos_id), text(info.eos_id))


def chat_prompt(pair: OpenPair, messages: list[dict], warn: Callable[[str], None] | None = None) -> list[int]:
    """Messages rendered with the model's template, as token ids. Templates that write the
    BOS text themselves do not get a second one from the tokenizer."""
    tmpl = model_template(pair)
    text = render_chat(tmpl, messages, warn)
    bos = tmpl.bos_token
    return pair.target.tokenize(text, add_special=not (bos and text.startswith(bos)), parse_special=True)
