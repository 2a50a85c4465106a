"""Opening a target/draft pair for generation: resolve, check first, then load, then report.

Shared by every front end that loads models (generate, chat, bench, serve): resolving the
names, opening the pair (how to load it is ``config.PairConfig``, the devices it may use
``inventory``, the assessment before loading ``pair.assess``), and the engine with this
machine's stored costs. The chat prompt of an open pair is ``prompt``. Returns notices as
strings; the front end shows them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.learned import CostStore
from specrun.decode.sampling import Sampler
from specrun.errors import BadModelFile, IncompatiblePair, InputError, UsageError
from specrun.fit.memory import Dev
from specrun.fit.placement import Placement, describe, fit
from specrun.gguf.architecture import require_loadable
from specrun.gguf.facts import ModelInfo, model_info
from specrun.gguf.heads import HEAD_FILE_ARCHS, Heads, head_file_of, heads_of, named_beside
from specrun.gguf.vocabulary import check_vocab
from specrun.models.registry import Registry, Resolved
from specrun.run.config import PairConfig
from specrun.run.inventory import connect
from specrun.run.pair import assess

if TYPE_CHECKING:  # llama_cpp is imported only when a pair is opened (header-only commands stay quick)
    from specrun.llama import DFlashHead, Eagle3Head, Gate, Model, MtpHeads

GPU_REINSTALL = (
    "this llama-cpp-python build cannot offload to a GPU, so everything runs on the CPU; for NVIDIA "
    'reinstall with: CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir '
    "llama-cpp-python (Apple Silicon: -DGGML_METAL=on), or run scripts/install.sh"
)


PARALLEL_AUTO_MAX = 4


def can_share_context(t: ModelInfo, d: ModelInfo | None, heads: bool) -> str | None:
    """Why these models cannot decode several sequences in one context (None: they can)."""
    if heads:
        return f"{t.path.name}'s MTP heads follow one sequence"
    h = head_file_of(d) if d is not None else None
    if d is not None and h is not None:
        return f"{d.path.name} ({h.kind}) follows one sequence"
    for info in (t, d):
        if info is not None and info.arch.kind != "attention":
            return f"{info.path.name} has a recurrent state ({info.arch.kind})"
    return None


def cache_dir() -> Path:
    """Where specrun keeps what it measures: $SPECRUN_CACHE_DIR, else the XDG cache."""
    base = os.environ.get("SPECRUN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "specrun"
    )
    return Path(base)


def cost_store() -> CostStore:
    return CostStore(cache_dir() / "costs.json")


def require_file(r: Resolved) -> Resolved:
    """A registry entry whose file is missing gets the entry's `source` as the fix."""
    if not r.path.exists() and r.entry is not None:
        how = r.entry.source or "download it or fix `path` in your models.toml"
        raise InputError(f"model {r.entry.name!r} is not on disk ({r.path})", f"get it with: {how}")
    return r


def resolve_pair(reg: Registry, model: str, draft_model: str | None, settings: Settings) -> tuple[Resolved, Resolved | None, Settings]:
    """The target and draft files for these names, and the settings as they apply: hybrid
    drafts with the target's own MTP heads when it has them (its best free draft; the chooser
    weighs them against what is named or registered beside them: a draft model, an EAGLE-3 head,
    a block drafter, Gemma 4's MTP assistant), and is the n-gram lookup alone with nothing at
    hand. ``{mode} mtp`` on a target without heads (and no assistant given), a draft of the wrong
    kind for the mode, and a head trained for another target are refused here, from their
    headers, before anything loads."""
    target = require_file(reg.resolve(model))
    t_info = model_info(target.path)
    heads = heads_of(t_info)
    if settings.mode == "mtp" and not draft_model:  # the target's own heads
        if not heads.usable:
            raise UsageError(
                f"{{mode}} mtp needs built-in MTP heads, and {target.label} has {_no_heads(heads)}; "
                f"its draft sources: {', '.join(_sources(reg, target))}",
                "use {mode} ngram, or give a draft model ({draft_model}) with {mode} model",
                "draft",
            )
        return target, None, settings
    draft = None
    if settings.mode == "mtp" or {"model", "eagle3", "dflash"} & set(settings.sources):  # (mtp: an assistant is given)
        d: Resolved | None
        if draft_model:
            d = reg.resolve(draft_model)
        elif "dflash" in settings.sources and (found := beside(as_given(model, target), t_info)):
            d = Resolved(found[0])  # a block drafter the user put beside the target: theirs, before the registry's
        else:
            d = reg.default_draft(target)
        if d is None:
            if settings.mode in ("model", "eagle3", "dflash"):
                what = {"eagle3": "EAGLE-3 head", "dflash": "block drafter"}.get(settings.mode, "draft model")
                raise UsageError(
                    f"no {what} for {target.label}",
                    "give one ({draft_model}), set `draft` in its registry entry, or use {mode} ngram",
                    "draft_model",
                )
        else:
            draft = require_file(d)
            _check_draft_kind(t_info, target, draft, settings)
    return target, draft, settings if draft is not None else settings.without_draft_model(heads.usable)


def as_given(model: str, target: Resolved) -> Path:
    """The target's file where the user put it: a path given is looked beside as given (a link
    into a store's blobs, as Hugging Face's cache makes, is not followed)."""
    given = Path(model).expanduser()
    return given.absolute() if given.is_file() else target.path


def beside(target: Path, t_info: ModelInfo) -> list[Path]:
    """The block drafters in the target's folder (``named_beside``) that can draft for it, by
    their headers."""
    found = []
    for path in named_beside(target):
        try:
            head = head_file_of(model_info(path))
        except (InputError, OSError):
            continue  # unreadable: -d names it to hear why
        if head is not None and head.source == "dflash" and head.mismatch(t_info) is None:
            found.append(path)
    return found


# what -d must be, by mode
_WANTS = {
    "model": "a draft model",
    "eagle3": "an EAGLE-3 head",
    "mtp": "an MTP assistant",
    "dflash": "a block drafter (DFlash, DSpark, DFlash2)",
}


def _check_draft_kind(t_info: ModelInfo, target: Resolved, draft: Resolved, settings: Settings) -> None:
    """The draft file is of the kind the mode drafts with (a draft model, an EAGLE-3 head, a
    block drafter, Gemma 4's MTP assistant; any for hybrid), and a head is one trained for this
    target. A head file llama.cpp would refuse or abort on by itself is a bad file (exit 3)."""
    info = model_info(draft.path)
    head = head_file_of(info)
    source = head.source if head is not None else "model"
    if settings.mode in _WANTS and source != settings.mode:
        if settings.mode == "mtp" and heads_of(t_info).usable:
            raise UsageError("{mode} mtp drafts with the target's own heads alone", "drop {draft_model}, or use {mode} hybrid", "mode")
        what = head.kind if head is not None else f"a {info.architecture} model"
        raise UsageError(
            f"{{mode}} {settings.mode} needs {_WANTS[settings.mode]}, and {draft.label} is {what}",
            f"use {{mode}} {source} or {{mode}} hybrid" if head is not None else "give one ({draft_model}), or use {mode} model",
            "draft_model",
        )
    why = head.mismatch(t_info) if head is not None else None
    if head is not None and why and head.fault is not None:
        raise BadModelFile(f"{draft.label} ({head.kind}) cannot be used: {why}", "convert it again with llama.cpp's convert_hf_to_gguf.py")
    if head is not None and why:
        raise UsageError(
            f"{draft.label} ({head.kind}) cannot draft for {target.label}: {why}", "give the head trained for this target", "draft_model"
        )


def uses_heads(target: Path, settings: Settings, draft: Path | None) -> bool:
    """Will these settings draft with the target's own MTP heads (so they must be loaded)?"""
    return "mtp" in settings.sources and heads_of(model_info(target)).usable


def _no_heads(h: Heads) -> str:
    if h.count and not h.supported:
        return f"{h.count} that llama.cpp cannot run ({h.architecture} has no MTP graph)"
    stripped = "; the conversion or quant may have stripped them" if h.stripped_note() else ""
    return f"none (nextn_predict_layers is 0{stripped})"


def _sources(reg: Registry, target: Resolved) -> list[str]:
    """The draft sources a target without usable heads does have, in words."""
    out = ["ngram (prompt lookup)"]
    arch = model_info(target.path).architecture
    if any(want == arch for source, want in HEAD_FILE_ARCHS.values() if source == "mtp"):
        out.append("mtp (with the MTP assistant file you give, mtp-*.gguf)")
    d = reg.default_draft(target)
    out.append(f"model (its registry draft {d.label})" if d is not None else "model (with a draft model you give)")
    return out


@dataclass
class OpenPair:
    target: Model
    draft: Model | None
    target_info: ModelInfo
    draft_info: ModelInfo | None
    notices: list[str] = field(default_factory=list)
    cost_key: str = ""
    heads: MtpHeads | None = None  # the target's own MTP heads, loaded and attached to it
    eagle3: Eagle3Head | None = None  # an EAGLE-3 head given as the draft, loaded and attached to it
    dflash: DFlashHead | None = None  # a block drafter given as the draft, loaded and attached to it
    labels: tuple[str, str | None] = ("", None)  # the names the user gave, as the registry resolved them
    placement: Placement | None = None
    workers: tuple[str, ...] = ()  # the RPC workers in use
    parallel: int = 1  # sequences the contexts were made for (Model.sequence)
    gate: Gate | None = None  # where those sequences' decodes meet (parallel > 1)

    def settings_for(self, settings: Settings) -> Settings:
        """``settings`` as they apply to this pair: hybrid without a draft model is the n-gram
        lookup, with whatever heads are loaded (the target's MTP heads, an EAGLE-3 head, a block
        drafter)."""
        if self.draft is not None:
            return settings
        return settings.without_draft_model(any(h is not None for h in (self.heads, self.eagle3, self.dflash)))

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
        self.target.close()  # and the heads attached to it


def open_pair(target_path: Path, draft_path: Path | None, cfg: PairConfig, heads: bool = False, tree: bool = False) -> OpenPair:
    """Check the vocabularies from headers (before any weights load), reach the RPC workers,
    place both models, check the fit per device, then load both; with ``heads``, the target's
    MTP heads too (their weights and KV are in the target's estimate already). A draft that is
    a head in a file of its own (an EAGLE-3 head, a block drafter, Gemma 4's MTP assistant) is placed and fitted
    as a draft, and loaded beside the target, attached to it. With ``tree``, the target's context
    gets ids for token trees' branches where it can have them (``LoadOptions.tree_branches``)."""
    from specrun import llama
    from specrun.llama import DFlashHead, Eagle3Head, Gemma4Assistant, LoadOptions, Model, MtpHeads

    t_info = model_info(target_path)
    d_info = model_info(draft_path) if draft_path is not None else None
    for info in (t_info, d_info):
        if info is not None:
            require_loadable(info.arch, info.path.name)
    if d_info is not None:
        compat = check_vocab(t_info, d_info)
        if not compat.compatible:
            raise IncompatiblePair(
                f"{d_info.path.name} cannot draft for {t_info.path.name}: {compat.reason()}",
                "pick a draft of the same family (specrun check-pair shows the details) or use {mode} ngram",
            )
    notices = []
    inv = connect(cfg)
    a = assess(cfg, inv, t_info, d_info)
    placement, f = a.placement, a.fit
    notices += [f"warning: {n}" for n in placement.notes]
    n_seq = cfg.parallel
    why_not = can_share_context(t_info, d_info, heads)
    if n_seq is None:  # the most sequences whose KV fits, each n_ctx long (the cache holds them all)
        n_seq = (
            1
            if why_not
            else next((n for n in range(PARALLEL_AUTO_MAX, 1, -1) if fit(placement, inv, t_info, d_info, cfg.n_ctx * n).fits), 1)
        )
        if why_not:
            notices.append(f"parallel 1: {why_not}")
    elif n_seq > 1 and why_not:
        raise UsageError(f"{{parallel}} {n_seq} needs attention-only models, and {why_not}", "use {parallel} 1", "parallel")
    if n_seq > 1:  # every sequence has its own n_ctx of KV
        f = fit(placement, inv, t_info, d_info, cfg.n_ctx * n_seq)
    if not f.fits:
        fix = "; ".join(proposal_flags(p.settings) for p in f.proposals)
        notices.append(
            f"warning: the models may not fit ({f.short()}); " + (f"this would: {fix}" if fix else "lower {n_ctx} or pick smaller models")
        )
    if cfg.gpu_layers != 0 and not llama.supports_gpu_offload() and not cfg.rpc:
        notices.append(GPU_REINSTALL)
    if placement.target.devices or (placement.draft is not None and placement.draft.devices):
        notices.append(f"placement: {describe(placement)}")

    def options(where, n_outputs_max: int, load_mtp: bool = False, tree_branches: int = 0) -> LoadOptions:
        return LoadOptions(
            n_ctx=cfg.n_ctx,
            n_gpu_layers=where.gpu_layers,
            n_threads=cfg.threads,
            n_outputs_max=n_outputs_max,
            devices=where.devices,
            split_mode=where.split_mode,
            main_gpu=where.main_gpu,
            tensor_split=where.split if len(where.devices) > 1 else None,
            verbose=cfg.verbose,
            load_mtp=load_mtp,
            n_seq_max=n_seq,
            tree_branches=tree_branches,
        )

    # a tree's every node but its root may be a leaf: as many branches as a verify's rows, less one
    target = Model(target_path, options(placement.target, 64 * n_seq, load_mtp=heads, tree_branches=63 if tree else 0))
    if tree and not target.tree_branches:
        notices.append(f"token trees: {target_path.name} cannot branch (a recurrent state, MTP heads or {{parallel}} > 1): chains")
    draft = None
    mtp = None
    eagle3 = None
    dflash = None
    try:
        if heads:
            mtp = MtpHeads(target)
        if draft_path is not None and placement.draft is not None:
            head = head_file_of(d_info) if d_info is not None else None
            if head is not None and head.source == "eagle3":
                eagle3 = Eagle3Head(target, draft_path, options(placement.draft, n_seq))
            elif head is not None and head.source == "dflash":
                dflash = DFlashHead(target, draft_path, options(placement.draft, n_seq))
            elif head is not None:
                mtp = Gemma4Assistant(target, draft_path, options(placement.draft, n_seq))
            else:
                draft = Model(draft_path, options(placement.draft, n_seq))
    except BaseException:
        target.close()
        raise
    for role, m in (("target", target), ("draft", draft)):
        if m is not None and m.offload.reported and m.offload.layers:
            notices.append(f"{role}: {m.offload.layers}/{m.offload.total} layers offloaded")
    if isinstance(mtp, Gemma4Assistant):
        notices.append(f"drafting with Gemma 4's MTP assistant {mtp.path.name} ({mtp.n_heads} blocks)")
    elif mtp is not None:
        chain = f", chained: a draft is at most {mtp.n_heads} long" if mtp.chain else ""
        notices.append(f"drafting with {t_info.path.name}'s own MTP heads ({mtp.n_heads}{chain})")
    if eagle3 is not None:
        notices.append(f"drafting with the EAGLE-3 head {eagle3.path.name} (it reads the target's layers {list(eagle3.layers)})")
    if dflash is not None:
        notices.append(
            f"drafting with the {dflash.what} {dflash.path.name} (it reads the target's layers {list(dflash.layers)}; "
            f"up to {dflash.max_draft} drafts a block)"
        )
    p = OpenPair(
        target,
        draft,
        t_info,
        d_info,
        notices,
        placement=placement,
        workers=cfg.rpc,
        heads=mtp,
        eagle3=eagle3,
        dflash=dflash,
        parallel=n_seq,
    )
    p.gate = llama.Gate() if n_seq > 1 else None
    p.cost_key = cost_key(t_info, d_info, cfg, placement, inv)
    return p


def proposal_flags(settings: dict[str, str]) -> str:
    """A proposal's settings as a core message writes them: ``{gpu_layers} 70``."""
    return " ".join(f"{{{k}}} {v}" for k, v in settings.items())


def cost_key(t: ModelInfo, d: ModelInfo | None, cfg: PairConfig, placement: Placement | None = None, inv: list[Dev] | None = None) -> str:
    """Costs are learned per machine, models, threads and placement: a split over GPUs or RPC
    workers has its own verify curve. (A pair wholly on the CPU keeps the key it always had.)"""
    from specrun import llama

    parts = [f"{t.path.name}:{t.file_size}"]
    if d is not None:
        parts.append(f"{d.path.name}:{d.file_size}")
    parts += [f"t{cfg.threads}", f"ngl{cfg.gpu_layers}/{cfg.gpu_layers_draft}", f"llama_cpp {llama.version()}"]
    parts.append("gpu" if llama.supports_gpu_offload() and cfg.gpu_layers != 0 else "cpu")
    if placement is not None and (placement.target.devices or (placement.draft is not None and placement.draft.devices)):
        where = {x.name: f"{x.name}@{x.description}" if x.kind == "rpc" else x.name for x in inv or []}

        def one(mp) -> str:
            return ",".join(f"{where.get(n, n)}:{x:.2f}" for n, x in zip(mp.devices, mp.split)) or "cpu"

        parts.append(f"target {one(placement.target)} {placement.target.split_mode}")
        if placement.draft is not None:
            parts.append(f"draft {one(placement.draft)}")
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
    that one was disturbed (its curve serves this run only). The draft model's step is timed
    again at the first prompt (``ModelSource.begin``): the stored one is only a prior."""
    learned = store.load(pair.cost_key)
    engine = Engine(pair.target, pair.draft, settings, sampler, learned=learned, heads=pair.heads, eagle3=pair.eagle3, dflash=pair.dflash)
    if settings.sources and not settings.fixed and (recalibrate or not engine.cost.verify):
        if on_notice is not None:
            on_notice("measuring this machine's verify costs (stored for next time)...")
        engine.calibrate()
        why = engine.cost.measured.get("disturbed")
        if why and on_notice is not None:
            on_notice(f"the machine was busy while measuring ({why}): these costs serve this run only and are not stored")
    return engine
