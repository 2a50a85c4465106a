"""Assessing a pair from headers only: vocabulary compatibility, where each model would go, the
memory fit per device and, when it does not fit, the settings that would.

``assess`` is the one pipeline (check, plan, fit, proposals) that ``specrun check-pair`` reports
and that opening a pair for generation (``session.open_pair``) acts on. Which other files could
draft for a target is ``discovery``'s question, not this module's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specrun.fit.memory import Dev, Fit, GpuQuery, local_devices
from specrun.fit.placement import Placement, PlacementSettings, Settings, fit, plan, proposals
from specrun.gguf.architecture import require_loadable
from specrun.gguf.facts import ModelInfo, model_info
from specrun.gguf.heads import HeadFile, head_file_of
from specrun.gguf.vocabulary import Compatibility, check_vocab


@dataclass
class Assessment:
    """A pair over a set of devices: the vocabulary check (None without a draft), the placement
    and its fit (with the proposals that would fit, when it does not)."""

    compat: Compatibility | None
    placement: Placement
    fit: Fit


def assess(s: Settings, inv: list[Dev], t: ModelInfo, d: ModelInfo | None, note: str = "") -> Assessment:
    """Check the vocabularies, place both models as they would load over ``inv``, fit them
    device by device, and when they do not fit, find the settings that would."""
    compat = check_vocab(t, d) if d is not None else None
    where = plan(s, inv, t, d)
    f = fit(where, inv, t, d, s.n_ctx, note)
    if not f.fits:
        f.proposals = proposals(s, inv, t, d)
    return Assessment(compat, where, f)


@dataclass
class PairReport:
    target: ModelInfo
    draft: ModelInfo
    compat: Compatibility
    fit: Fit
    n_ctx: int
    suggestions: list[str] = field(default_factory=list)
    placement: Placement | None = None
    draft_head: HeadFile | None = None  # the draft is a head in a file of its own: the target it was trained for
    head_mismatch: str | None = None  # ... and why this target is not that one

    @property
    def ok(self) -> bool:
        return self.compat.compatible and self.fit.fits and self.head_mismatch is None

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
            "draft_head": {**self.draft_head.to_json(), "matches": self.head_mismatch is None, "mismatch": self.head_mismatch}
            if self.draft_head is not None
            else None,
        }


def check_pair(
    target: Path | ModelInfo,
    draft: Path | ModelInfo,
    settings: Settings | None = None,
    gpu_query: GpuQuery | None = None,
    remote: list[Dev] | None = None,
    available_ram: int | None = None,
) -> PairReport:
    """Read both headers and assess the pair (``settings``: context, layers, devices, split)
    over this machine's GPUs (NVML), ``remote`` RPC devices and RAM. An architecture the
    installed llama.cpp cannot load is an error."""
    s = settings if settings is not None else PlacementSettings()
    t = target if isinstance(target, ModelInfo) else model_info(target)
    d = draft if isinstance(draft, ModelInfo) else model_info(draft)
    for m in (t, d):
        require_loadable(m.arch, m.path.name)
    local, note = local_devices(gpu_query, available_ram)
    a = assess(s, list(remote or []) + local, t, d, note)
    assert a.compat is not None
    head = head_file_of(d)
    mismatch = head.mismatch(t) if head is not None else None
    return PairReport(t, d, a.compat, a.fit, s.n_ctx, placement=a.placement, draft_head=head, head_mismatch=mismatch)
