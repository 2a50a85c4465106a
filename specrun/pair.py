"""check-pair: vocabulary compatibility plus the memory fit per device, from headers only."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .architecture import require_loadable
from .compat import Compatibility, check_vocab
from .errors import SpecrunError
from .memory import Dev, Fit, GpuQuery, local_devices
from .modelinfo import ModelInfo, model_info
from .placement import Placement, PlacementSettings, Settings, fit, plan, proposals


@dataclass
class PairReport:
    target: ModelInfo
    draft: ModelInfo
    compat: Compatibility
    fit: Fit
    n_ctx: int
    suggestions: list[str] = field(default_factory=list)
    placement: Placement | None = None

    @property
    def ok(self) -> bool:
        return self.compat.compatible and self.fit.fits

    def to_json(self) -> dict:
        return {
            "target": {"path": str(self.target.path), "name": self.target.name},
            "draft": {"path": str(self.draft.path), "name": self.draft.name},
            "n_ctx": self.n_ctx,
            "architectures": {"target": self.target.arch.to_json(), "draft": self.draft.arch.to_json()},
            "compatible": self.compat.compatible,
            "fits": self.fit.fits,
            "ok": self.ok,
            "vocab": self.compat.to_json()["checks"],
            "memory": self.fit.to_json(),
            "placement": self.placement.to_json() if self.placement else None,
            "suggested_drafts": self.suggestions,
        }


def check_pair(
    target: Path | ModelInfo,
    draft: Path | ModelInfo,
    settings: Settings | None = None,
    candidates: dict[str, Path] | None = None,
    gpu_query: GpuQuery | None = None,
    remote: list[Dev] | None = None,
    available_ram: int | None = None,
) -> PairReport:
    """Read both headers, compare vocabularies, place the pair as it would load (``settings``:
    context, layers, devices, split) over this machine's GPUs (NVML), ``remote`` RPC devices and
    RAM, and lay the memory out per device; when it does not fit, the settings that would.
    ``candidates`` (registry name -> path of files present) are searched for drafts that would
    match on a mismatch. An architecture the installed llama.cpp cannot load is an error."""
    s = settings if settings is not None else PlacementSettings()
    t = target if isinstance(target, ModelInfo) else model_info(target)
    d = draft if isinstance(draft, ModelInfo) else model_info(draft)
    for m in (t, d):
        require_loadable(m.arch, m.path.name)
    compat = check_vocab(t, d)
    local, note = local_devices(gpu_query, available_ram)
    inv = list(remote or []) + local
    where = plan(s, inv, t, d)
    f = fit(where, inv, t, d, s.n_ctx, note)
    if not f.fits:
        f.proposals = proposals(s, inv, t, d)
    report = PairReport(t, d, compat, f, s.n_ctx, placement=where)
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
