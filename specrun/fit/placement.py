"""Where the target's and the draft's layers go: local GPUs, RPC workers, the CPU.

The default, when the user names no devices:

* the **draft** goes wholly on one local GPU: the one with the most free memory once the
  target's share is counted. A draft split across devices, or sent over the network, pays a
  synchronisation or a round trip on every drafted token. With no local GPU it stays on the
  CPU of this machine; it never goes to an RPC worker unless the user puts it there;
* the **target** spreads over every device in llama.cpp's order (RPC workers first, local GPUs
  last, so its output layer and logits stay on this machine), in proportion to each device's
  free memory after the draft's reservation. With two or more local GPUs and room for the
  target without the draft's GPU, the target leaves that GPU to the draft.

The user's ``devices`` / ``devices_draft`` / ``tensor_split`` / ``split_mode`` / ``main_gpu``
override any part of it; they are checked against the devices that exist. :func:`plan` decides,
:func:`fit` lays the memory out per device (``memory``), and :func:`proposals` searches for the
settings that would fit when the plan does not: the split, the largest ``gpu_layers``, or the
largest context. All of it is pure: the devices come in as data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from specrun.errors import UsageError
from specrun.fit.memory import HEADROOM_FRACTION, HOST, Dev, Fit, ModelMemory, check_fit, device_overhead, estimate, largest_layer
from specrun.gguf.facts import ModelInfo

SPLIT_MODES = ("layer", "row", "none")


class Settings(Protocol):
    """The placement settings of a PairConfig (``session`` holds the dataclass)."""

    @property
    def n_ctx(self) -> int: ...
    @property
    def gpu_layers(self) -> int: ...
    @property
    def gpu_layers_draft(self) -> int | None: ...
    @property
    def devices(self) -> tuple[str, ...] | None: ...
    @property
    def devices_draft(self) -> tuple[str, ...] | None: ...
    @property
    def tensor_split(self) -> tuple[float, ...] | None: ...
    @property
    def split_mode(self) -> str: ...
    @property
    def main_gpu(self) -> int | None: ...


@dataclass(frozen=True)
class PlacementSettings:
    """The defaults, for callers without a PairConfig (the pure check-pair)."""

    n_ctx: int = 4096
    gpu_layers: int = -1
    gpu_layers_draft: int | None = None
    devices: tuple[str, ...] | None = None
    devices_draft: tuple[str, ...] | None = None
    tensor_split: tuple[float, ...] | None = None
    split_mode: str = "layer"
    main_gpu: int | None = None


# --- parsing and checking the settings on their own ---------------------------------------------


def parse_device_list(value: str | tuple[str, ...] | list[str] | None, setting: str = "devices") -> tuple[str, ...] | None:
    """``CUDA0,RPC0`` as a tuple of names; ``none`` (alone) is the CPU, an empty tuple."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [x for v in value for x in str(v).split(",")]
    names = [x.strip() for x in items]
    if not names or any(not n for n in names):
        raise UsageError(f"{{{setting}}} takes device names separated by commas, got {value!r}", "see `specrun devices`", setting)
    if any(n.lower() == "none" for n in names):
        if len(names) > 1:
            raise UsageError(
                f"{{{setting}}}: 'none' (the CPU alone) cannot be combined with devices", "give none, or a list of devices", setting
            )
        return ()
    dup = next((n for i, n in enumerate(names) if n.lower() in [x.lower() for x in names[:i]]), None)
    if dup is not None:
        raise UsageError(f"{{{setting}}} names {dup} twice", "give each device once", setting)
    return tuple(names)


def parse_tensor_split(value: str | tuple[float, ...] | list[float] | None) -> tuple[float, ...] | None:
    """``3,1`` (llama.cpp also takes ``3/1``) as proportions, one per device of the target."""
    if value is None:
        return None
    parts = value.replace("/", ",").split(",") if isinstance(value, str) else list(value)
    try:
        nums = tuple(float(p) for p in parts)
    except ValueError:
        raise UsageError(f"{{tensor_split}} takes numbers separated by commas, got {value!r}", "e.g. 3,1", "tensor_split") from None
    check_tensor_split(nums)
    return nums


def check_tensor_split(nums: tuple[float, ...]) -> None:
    if not nums:
        raise UsageError("{tensor_split} is empty", "give one proportion per device, e.g. 3,1", "tensor_split")
    bad = next((x for x in nums if not math.isfinite(x) or x < 0), None)
    if bad is not None:
        raise UsageError(f"{{tensor_split}} values must be numbers >= 0, got {bad:g}", "e.g. 3,1", "tensor_split")
    if sum(nums) <= 0:
        raise UsageError("{tensor_split} cannot be all zeros", "give each device a proportion, e.g. 3,1", "tensor_split")


def check_settings(s: Settings) -> None:
    """The checks that need no device list."""
    if s.split_mode not in SPLIT_MODES:
        raise UsageError(f"{{split_mode}} is one of {', '.join(SPLIT_MODES)}, got {s.split_mode!r}", "layer is the default", "split_mode")
    if s.main_gpu is not None and s.main_gpu < 0:
        raise UsageError(f"{{main_gpu}} must be >= 0, got {s.main_gpu}", "it is an index into the target's devices", "main_gpu")
    if s.main_gpu is not None and s.split_mode == "layer":
        raise UsageError(
            "{main_gpu} applies with {split_mode} none or row, not layer",
            "add {split_mode} none to put the target on one device",
            "main_gpu",
        )
    if s.tensor_split is not None:
        check_tensor_split(s.tensor_split)
        if s.split_mode == "none":
            raise UsageError("{tensor_split} has no effect with {split_mode} none (one device)", "drop one of them", "tensor_split")
    if s.devices == () and (s.tensor_split is not None or s.main_gpu is not None):
        which = "tensor_split" if s.tensor_split is not None else "main_gpu"
        raise UsageError(f"{{{which}}} has no effect with {{devices}} none (the CPU alone)", "drop one of them", which)


# --- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPlacement:
    """One model's devices, in llama.cpp's order, and the proportion of its layers for each."""

    devices: tuple[str, ...]  # () = the CPU alone
    split: tuple[float, ...]  # one per device, summing to 1
    gpu_layers: int
    split_mode: str = "layer"
    main_gpu: int = 0

    def to_json(self) -> dict:
        return {
            "devices": list(self.devices),
            "split": [round(x, 4) for x in self.split],
            "gpu_layers": self.gpu_layers,
            "split_mode": self.split_mode,
            "main_gpu": self.main_gpu,
        }


@dataclass(frozen=True)
class Placement:
    target: ModelPlacement
    draft: ModelPlacement | None
    notes: tuple[str, ...] = ()  # warnings about the user's choice, in words

    def to_json(self) -> dict:
        return {"target": self.target.to_json(), "draft": self.draft.to_json() if self.draft else None, "notes": list(self.notes)}


def _resolve(names: tuple[str, ...], inv: list[Dev], setting: str) -> list[Dev]:
    by_name = {d.name.lower(): d for d in inv if d.kind != "cpu"}
    by_endpoint = {d.description: d for d in inv if d.kind == "rpc"}
    out = []
    for n in names:
        d = by_name.get(n.lower()) or by_endpoint.get(n)
        if d is None:
            if n.lower() == HOST.lower():
                raise UsageError(f"{{{setting}}}: the CPU is not a device to list", f"use {{{setting}}} none for the CPU alone", setting)
            have = ", ".join(d.name for d in inv if d.kind != "cpu") or "no GPU or RPC device"
            hint = "; RPC devices appear once their workers are given with {rpc}" if n.upper().startswith("RPC") else ""
            raise UsageError(f"unknown device {n!r} in {{{setting}}}: this machine has {have}{hint}", "see `specrun devices`", setting)
        out.append(d)
    return out


def _usable(d: Dev, reserved: int = 0) -> float:
    return max(d.free * (1 - HEADROOM_FRACTION) - reserved, 0.0)


def _balanced(devs: list[Dev], reserved: dict[str, int], m: ModelInfo, n_ctx: int) -> tuple[float, ...]:
    """Proportions by the memory each device has left for ``m``'s layers (llama.cpp splits by
    free memory; this also keeps what another model was given, and the compute buffer each
    device pays). A device without room for one layer gets none."""
    fixed, layer = device_overhead(m, n_ctx), largest_layer(m, n_ctx)
    room = [_usable(d, reserved.get(d.name, 0)) - fixed for d in devs]
    room = [r if r >= layer else 0.0 for r in room]
    if sum(room) <= 0:
        room = [float(max(d.free, 1)) for d in devs]
    total = sum(room)
    return tuple(r / total for r in room)


def _normalised(split: tuple[float, ...]) -> tuple[float, ...]:
    total = sum(split)
    return tuple(x / total for x in split)


def plan(s: Settings, inv: list[Dev], target: ModelInfo, draft: ModelInfo | None) -> Placement:
    """The placement the pair will load with (see the module docstring for the default)."""
    check_settings(s)
    local_gpus = [d for d in inv if d.kind == "gpu"]
    notes: list[str] = []
    default_target = s.devices is None
    t_devs = [d for d in inv if d.kind == "rpc"] + local_gpus if default_target else _resolve(s.devices or (), inv, "devices")
    if s.split_mode == "none" and t_devs:
        mg = s.main_gpu or 0
        if mg >= len(t_devs):
            raise UsageError(
                f"{{main_gpu}} {mg} is out of range: the target has {len(t_devs)} device{'s' * (len(t_devs) != 1)} ({', '.join(d.name for d in t_devs)})",
                f"pick 0 to {len(t_devs) - 1}",
                "main_gpu",
            )
        t_devs = [t_devs[mg]]
    if s.tensor_split is not None and len(s.tensor_split) != len(t_devs):
        raise UsageError(
            f"{{tensor_split}} has {len(s.tensor_split)} value{'s' * (len(s.tensor_split) != 1)} but the target is placed on "
            f"{len(t_devs)} device{'s' * (len(t_devs) != 1)} ({', '.join(d.name for d in t_devs) or 'the CPU alone'})",
            "give one proportion per device, in that order, or name the devices with {devices}",
            "tensor_split",
        )
    mode, mg = s.split_mode, (s.main_gpu or 0) if s.split_mode == "row" else 0

    def target_on(devs: list[Dev], split: tuple[float, ...]) -> ModelPlacement:
        if default_target and s.tensor_split is None:  # a device given no share is left out
            kept = [(d, x) for d, x in zip(devs, split) if x > 0]
            devs, split = [d for d, _ in kept], _normalised(tuple(x for _, x in kept)) if kept else ()
        return ModelPlacement(tuple(d.name for d in devs), split if devs else (), s.gpu_layers, mode, mg)

    def balanced(devs: list[Dev], reserved: dict[str, int]) -> tuple[float, ...]:
        return _balanced(devs, reserved, target, s.n_ctx)

    d_layers = s.gpu_layers if s.gpu_layers_draft is None else s.gpu_layers_draft
    if s.tensor_split is not None:
        t_place = target_on(t_devs, _normalised(s.tensor_split))
    else:
        t_place = target_on(t_devs, balanced(t_devs, {}))
    if draft is None:
        return Placement(t_place, None, tuple(notes))

    if s.devices_draft is not None:  # the user's choice
        d_devs = _resolve(s.devices_draft, inv, "devices_draft")
        remote = [d.name for d in d_devs if d.kind == "rpc"]
        if remote:
            notes.append(
                f"the draft is on {', '.join(remote)}, across the network: every drafted token then pays a round trip to the "
                "worker, which usually costs more than a small draft saves; a local GPU or this machine's CPU is faster"
            )
        if len(d_devs) > 1:
            notes.append(
                "the draft is split across several devices: each drafted token pays a hand-over between them; one device is faster"
            )
        d_place = ModelPlacement(tuple(d.name for d in d_devs), _balanced(d_devs, {}, draft, s.n_ctx) if d_devs else (), d_layers)
        if s.tensor_split is None and default_target:
            need = _on_each(estimate(draft, "draft", s.n_ctx, d_layers, d_place.devices, d_place.split))
            t_place = target_on(t_devs, balanced(t_devs, need))
        return Placement(t_place, d_place, tuple(notes))

    if d_layers == 0 or not local_gpus:
        return Placement(t_place, ModelPlacement((), (), d_layers), tuple(notes))

    whole = estimate(draft, "draft", s.n_ctx, d_layers, ("*",), (1.0,)).by_device.get("*", 0)
    # With two or more local GPUs, can the target do without one, leaving it to the draft?
    if default_target and s.tensor_split is None and mode == "layer" and len(local_gpus) >= 2:
        for g in sorted(local_gpus, key=lambda d: -d.free):
            rest = [d for d in t_devs if d.name != g.name]
            t_try = target_on(rest, balanced(rest, {}))
            on = _on_each(estimate(target, "target", s.n_ctx, s.gpu_layers, t_try.devices, t_try.split))
            if whole <= _usable(g) and all(on.get(d.name, 0) <= _usable(d) for d in rest):
                return Placement(t_try, ModelPlacement((g.name,), (1.0,), d_layers), tuple(notes))
    # The local GPU with the most free memory once the target has its share; the target is then
    # rebalanced around the draft's reservation (unless the user fixed its split).
    on = _on_each(estimate(target, "target", s.n_ctx, s.gpu_layers, t_place.devices, t_place.split))
    g = max(local_gpus, key=lambda d: d.free - on.get(d.name, 0))
    if s.tensor_split is None and g in t_devs and len(t_devs) > 1:
        t_place = target_on(t_devs, balanced(t_devs, {g.name: whole}))
    return Placement(t_place, ModelPlacement((g.name,), (1.0,), d_layers), tuple(notes))


def _on_each(mm: ModelMemory) -> dict[str, int]:
    return {k: v for k, v in mm.by_device.items() if k != HOST}


def fit(p: Placement, inv: list[Dev], target: ModelInfo, draft: ModelInfo | None, n_ctx: int, note: str = "") -> Fit:
    """Each device's share of the pair, as placed, against its free memory."""
    models = [estimate(target, "target", n_ctx, p.target.gpu_layers, p.target.devices, p.target.split)]
    if draft is not None and p.draft is not None:
        models.append(estimate(draft, "draft", n_ctx, p.draft.gpu_layers, p.draft.devices, p.draft.split))
    return check_fit(models, inv, note)


# --- when it does not fit: the settings that would -----------------------------------------------


@dataclass(frozen=True)
class Proposal:
    """Settings that make the pair fit (setting -> value as the user would type it)."""

    settings: dict[str, str]
    why: str
    fit: Fit | None = field(default=None, compare=False)

    def to_json(self) -> dict:
        return {"settings": self.settings, "why": self.why}


def _try(s: Settings, inv: list[Dev], target: ModelInfo, draft: ModelInfo | None) -> Fit | None:
    """The fit of ``s``'s placement if it fits, else None (as for settings that cannot be placed)."""
    f = _plan_fit(s, inv, target, draft)
    return f if f is not None and f.fits else None


def _split_text(split: tuple[float, ...]) -> str:
    """Proportions as whole numbers summing to about 100 (what -ts is usually given as)."""
    return ",".join(str(round(100 * x)) for x in split)


def proposals(s: Settings, inv: list[Dev], target: ModelInfo, draft: ModelInfo | None) -> list[Proposal]:
    """Settings that would fit, the least drastic first: the balanced split over the user's
    devices; else the largest target ``gpu_layers`` (the draft kept whole); else the largest
    draft ``gpu_layers`` with none of the target's; else the largest context. Each proposal is
    checked by planning it again. Empty when nothing fits."""
    out: list[Proposal] = []
    n_layers = target.n_layer + 1
    if s.tensor_split is not None:
        unsplit = replace(s, tensor_split=None)  # type: ignore[type-var]
        f = _try(unsplit, inv, target, draft)
        if f is not None:
            chosen = plan(unsplit, inv, target, draft).target
            share = dict(zip(chosen.devices, chosen.split))
            order = (
                [d.name for d in inv if d.kind == "rpc"] + [d.name for d in inv if d.kind == "gpu"]
                if s.devices is None
                else list(s.devices)
            )
            balanced = tuple(share.get(n, 0.0) for n in order)
            exact = replace(s, tensor_split=tuple(float(round(100 * x)) for x in balanced))  # type: ignore[type-var]
            if _try(exact, inv, target, draft) is not None:
                return [Proposal({"tensor_split": _split_text(balanced)}, "a split by the memory each device has left", f)]
    ngl_now = n_layers if s.gpu_layers < 0 else min(s.gpu_layers, n_layers)
    ngl, f = _largest(ngl_now - 1, lambda n: _plan_fit(replace(s, gpu_layers=n, gpu_layers_draft=_draft_layers(s)), inv, target, draft))  # type: ignore[type-var]
    if f is not None:
        settings = {"gpu_layers": str(ngl)}
        if s.gpu_layers_draft is None and draft is not None:
            settings["gpu_layers_draft"] = str(_draft_layers(s))
        out.append(Proposal(settings, f"the target's last {ngl} of {n_layers} layers on the devices, the rest in RAM", f))
    if not out and draft is not None:
        d_now = draft.n_layer + 1 if _draft_layers(s) < 0 else min(_draft_layers(s), draft.n_layer + 1)
        ngld, f = _largest(d_now - 1, lambda n: _plan_fit(replace(s, gpu_layers=0, gpu_layers_draft=n), inv, target, draft))  # type: ignore[type-var]
        if f is not None:
            out.append(
                Proposal({"gpu_layers": "0", "gpu_layers_draft": str(ngld)}, "the target in RAM, the draft's last layers on a GPU", f)
            )
    if not out:
        c = s.n_ctx // 2
        while c >= 256:
            f = _try(replace(s, n_ctx=c), inv, target, draft)  # type: ignore[type-var]
            if f is not None:
                out.append(Proposal({"n_ctx": str(c)}, f"a {c}-token context: a smaller KV cache", f))
                break
            c //= 2
    return out


def _plan_fit(s: Settings, inv: list[Dev], target: ModelInfo, draft: ModelInfo | None) -> Fit | None:
    try:
        return fit(plan(s, inv, target, draft), inv, target, draft, s.n_ctx)
    except UsageError:
        return None


def _largest(hi: int, fit_at: Callable[[int], Fit | None]) -> tuple[int, Fit | None]:
    """The largest n in [0, hi] at which the pair fits, with that fit. Offloading one layer
    fewer moves memory from the devices to RAM, so the devices fit up to some n and RAM from
    some n on: a binary search finds the largest n where the devices fit (a header may claim
    any number of layers), and the pair fits anywhere only if RAM also fits there."""
    if hi < 0:
        return -1, None

    def devices_fit(n: int) -> Fit | None:
        f = fit_at(n)
        return f if f is not None and all(x.fits for x in f.shares if x.device.kind != "cpu") else None

    best = devices_fit(0)
    if best is None:
        return -1, None
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        f = devices_fit(mid)
        if f is not None:
            lo, best = mid, f
        else:
            hi = mid - 1
    return (lo, best) if best.fits else (-1, None)


def _draft_layers(s: Settings) -> int:
    return s.gpu_layers if s.gpu_layers_draft is None else s.gpu_layers_draft


def describe(p: Placement, fit_: Fit | None = None) -> str:
    """One line: which device holds what."""

    def one(mp: ModelPlacement) -> str:
        if not mp.devices:
            return "the CPU"
        parts = [f"{d} {100 * x:.0f}%" for d, x in zip(mp.devices, mp.split)] if len(mp.devices) > 1 else list(mp.devices)
        layers = "" if mp.gpu_layers < 0 else f" (last {mp.gpu_layers} layers; the rest on the CPU)"
        return ", ".join(parts) + layers

    out = f"target on {one(p.target)}"
    if p.draft is not None:
        out += f"; draft on {one(p.draft)}"
    return out
