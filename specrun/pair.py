"""check-pair: vocabulary compatibility plus memory fit, from headers only."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .compat import Compatibility, check_vocab
from .errors import SpecrunError
from .memory import Fit, GpuQuery, check_fit, estimate
from .modelinfo import ModelInfo, model_info


@dataclass
class PairReport:
    target: ModelInfo
    draft: ModelInfo
    compat: Compatibility
    fit: Fit
    n_ctx: int
    suggestions: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.compat.compatible and self.fit.fits

    def to_json(self) -> dict:
        return {
            "target": {"path": str(self.target.path), "name": self.target.name},
            "draft": {"path": str(self.draft.path), "name": self.draft.name},
            "n_ctx": self.n_ctx,
            "compatible": self.compat.compatible,
            "fits": self.fit.fits,
            "ok": self.ok,
            "vocab": self.compat.to_json()["checks"],
            "memory": self.fit.to_json(),
            "suggested_drafts": self.suggestions,
        }


def check_pair(
    target: Path | ModelInfo,
    draft: Path | ModelInfo,
    n_ctx: int = 4096,
    gpu_layers: int = -1,
    gpu_layers_draft: int | None = None,
    candidates: dict[str, Path] | None = None,
    gpu_query: GpuQuery | None = None,
) -> PairReport:
    """Read both headers, compare vocabularies, estimate memory. ``candidates`` (registry
    name -> path of files present) are searched for drafts that would match on a mismatch."""
    t = target if isinstance(target, ModelInfo) else model_info(target)
    d = draft if isinstance(draft, ModelInfo) else model_info(draft)
    compat = check_vocab(t, d)
    mems = [
        estimate(t, "target", n_ctx, gpu_layers),
        estimate(d, "draft", n_ctx, gpu_layers if gpu_layers_draft is None else gpu_layers_draft),
    ]
    fit = check_fit(mems, gpu_query)
    report = PairReport(t, d, compat, fit, n_ctx)
    if not compat.compatible and candidates:
        report.suggestions = suggest_drafts(t, candidates, exclude={t.path, d.path})
    return report


def suggest_drafts(t: ModelInfo, candidates: dict[str, Path], exclude=frozenset(), limit: int = 3) -> list[str]:
    """Registry models present on disk whose vocabulary matches ``t``, smallest first."""
    found = []
    for name, path in candidates.items():
        if path in exclude or not path.is_file() or path.stat().st_size >= t.file_size:
            continue  # a draft must be smaller than its target; skip reading bigger headers
        try:
            m = model_info(path)
        except SpecrunError:
            continue
        if m.weights_bytes < t.weights_bytes and check_vocab(t, m).compatible:
            found.append((m.weights_bytes, name))
    return [name for _, name in sorted(found)[:limit]]
