"""The flags shared by the commands that load models, declared once.

Each flag sets one field of a core value (``PairConfig``, ``Settings``, ``Sampler``) and takes
its default from there, so a new flag is one line here plus the field in the core. The
``@shared(...)`` decorator adds a group of flags to a command; the command receives them as one
``Options`` value, already validated by the core values' own checks. ``flag_name`` turns a
setting the core names in an error (``draft_max``) into the flag the user typed
(``--draft-max``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from specrun.decode.engine import Settings
from specrun.decode.sampling import Sampler
from specrun.fit.placement import parse_device_list, parse_tensor_split
from specrun.fit.rpc import parse_endpoints
from specrun.run.config import PairConfig


@dataclass(frozen=True)
class Flag:
    field: str  # the setting it sets; also the command's parameter name
    decls: tuple[str, ...]
    help: str
    type: Any
    default: Any
    parse: Callable[[Any], Any] | None = None  # text (or None) -> the core's value: the core's own parser
    envvar: str | None = None

    @property
    def name(self) -> str:
        """How messages write it: ``-c/--ctx`` when it has a one-letter form, else the long one."""
        long = next(d for d in self.decls if d.startswith("--"))
        short = next((d for d in self.decls if len(d) == 2), None)
        return f"{short}/{long}" if short else long


def _default(cls: type, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _flag(
    cls: type | None,
    field: str,
    decls: tuple[str, ...],
    help: str,
    type_: Any,
    default: Any = None,
    parse: Callable[[Any], Any] | None = None,
    envvar: str | None = None,
) -> Flag:
    if cls is not None:
        default = _default(cls, field)
        if parse is not None and default is not None:  # a tuple in the core, text on the command line
            default = ",".join(map(str, default)) or None
    return Flag(field, decls, help, type_, default, parse, envvar)


# --- the groups ----------------------------------------------------------------------------------

MODELS = (
    _flag(None, "model", ("-m", "--model"), "Target: a registry name, alias or .gguf path.", str, ...),
    _flag(None, "draft_model", ("-d", "--draft-model"), "Draft model (default: the target's registry draft).", Optional[str]),
    _flag(
        None,
        "registry",
        ("--registry",),
        "A models.toml laid over the packaged one (else $SPECRUN_REGISTRY, else ~/.config/specrun/models.toml).",
        Optional[Path],
    ),
)
PLACEMENT = (
    _flag(PairConfig, "n_ctx", ("-c", "--ctx"), "Context length in tokens.", int),
    _flag(PairConfig, "gpu_layers", ("--gpu-layers", "-ngl"), "Target layers on the GPU; -1 means all.", int),
    _flag(
        PairConfig,
        "gpu_layers_draft",
        ("--gpu-layers-draft", "-ngld"),
        "Draft layers on the GPU; -1 means all (default: as --gpu-layers).",
        Optional[int],
    ),
    _flag(
        PairConfig,
        "devices",
        ("--device", "-dev"),
        "Devices for the target, comma-separated (CUDA0,RPC0; `specrun devices` lists them); none for the CPU alone "
        "(default: every GPU and RPC device, in proportion to free memory, leaving the draft its GPU).",
        Optional[str],
        parse=lambda v: parse_device_list(v, "devices"),
    ),
    _flag(
        PairConfig,
        "devices_draft",
        ("--device-draft", "-devd"),
        "Devices for the draft; none for the CPU (default: wholly on the local GPU with the most free memory after the target's share, "
        "else the CPU; never an RPC worker unless named here).",
        Optional[str],
        parse=lambda v: parse_device_list(v, "devices_draft"),
    ),
    _flag(
        PairConfig,
        "tensor_split",
        ("--tensor-split", "-ts"),
        "The target's proportion on each of its devices, in order, e.g. 3,1.",
        Optional[str],
        parse=parse_tensor_split,
    ),
    _flag(
        PairConfig,
        "split_mode",
        ("--split-mode", "-sm"),
        "How the target is split over its devices: layer (pipelined), row (CUDA's split matrices) or none (one device).",
        str,
    ),
    _flag(
        PairConfig,
        "main_gpu",
        ("--main-gpu", "-mg"),
        "With --split-mode none: the index of the target's one device; with row: the device for intermediate results.",
        Optional[int],
    ),
    _flag(
        PairConfig,
        "rpc",
        ("--rpc",),
        "RPC workers whose devices join the target's split: HOST:PORT[,HOST:PORT...] (start one with `specrun worker`). "
        "Unencrypted and unauthenticated: trusted networks only.",
        Optional[str],
        parse=parse_endpoints,
        envvar="SPECRUN_RPC",
    ),
)
RUNTIME = (
    _flag(PairConfig, "threads", ("-t", "--threads"), "CPU threads for both models (n_threads and n_threads_batch).", int),
    _flag(PairConfig, "verbose", ("--verbose",), "Show llama.cpp's own log on stderr.", bool),
)
DRAFTING = (
    _flag(
        Settings,
        "mode",
        ("--draft",),
        "Drafter: model, ngram, mtp (the target's own MTP heads, or Gemma 4's assistant given with -d), eagle3 (the "
        "EAGLE-3 head given with -d), dflash (the block drafter given with -d: DFlash, DSpark or DFlash2), hybrid (each round, the best of the n-gram lookup, the target's MTP heads and what "
        "-d gives) or none (plain decoding).",
        str,
    ),
    _flag(
        Settings,
        "draft_max",
        ("--draft-max",),
        "Most draft tokens per round (default: 63 adaptive, where the chooser picks K up to it: the rows of logits a verify returns, less one; 32 on a hybrid target that undoes drafts through state snapshots; 8 with --fixed).",
        Optional[int],
    ),
    _flag(Settings, "draft_min", ("--draft-min",), "Drafts shorter than this are dropped (the round decodes plainly).", int),
    _flag(
        Settings,
        "p_min",
        ("--draft-p-min", "--draft-p-split"),
        "With --fixed, the draft model stops when its top-token probability falls below this (adaptive mode stops by its own rule, from acceptance by confidence).",
        float,
    ),
    _flag(
        Settings,
        "fixed",
        ("--fixed",),
        "Turn adaptive control off: every round drafts up to --draft-max tokens with the chosen drafter (the draft model still stops below --draft-p-min; use 0 to always draft all).",
        bool,
    ),
    _flag(
        Settings,
        "tree",
        ("--tree",),
        "Token trees: the draft model and the n-gram lookup may add second candidates beside their chain, verified in the same "
        "decode, and the round keeps the longest branch the target agrees with (attention-only targets; others keep chains).",
        bool,
    ),
    _flag(Settings, "ngram_min", ("--ngram-min",), "Shortest suffix the n-gram drafter matches.", int),
    _flag(Settings, "ngram_max", ("--ngram-max",), "Longest suffix the n-gram drafter matches.", int),
    _flag(
        Settings,
        "tie_margin",
        ("--tie-margin",),
        "Greedy only: a position whose top two logits are closer than this is decided by a one-token decode, as plain decoding would "
        "(llama.cpp's batched and one-token kernels differ by up to ~0.5 logit on quantized CPU weights). Default: 3x the gap "
        "measured at calibration, at most 0.5. 0 turns it off.",
        Optional[float],
    ),
)
SAMPLING = (
    _flag(Sampler, "temperature", ("--temp",), "Temperature; 0 is greedy (exactly the target's argmax).", float),
    _flag(Sampler, "seed", ("--seed",), "Random seed for sampling (makes runs reproducible).", Optional[int]),
    _flag(Sampler, "top_k", ("--top-k",), "Top-k filter (0 disables).", int),
    _flag(Sampler, "top_p", ("--top-p",), "Top-p (nucleus) filter (1 disables).", float),
    _flag(Sampler, "min_p", ("--min-p",), "Min-p filter (0 disables).", float),
)
RPC = tuple(f for f in PLACEMENT if f.field == "rpc")  # for commands that only reach workers (devices, doctor)
LOADING = MODELS + PLACEMENT + RUNTIME + DRAFTING  # what every model-loading command takes
ALL = LOADING + SAMPLING

# settings named by the core that are not shared flags, as the commands spell them
_OTHER_NAMES = {
    "prompt": "-p/--prompt",
    "max_tokens": "-n/--n-predict",
    "runs": "--runs",
    "prompts": "--prompts",
    "host": "--host",
    "port": "--port",
    "parallel": "--parallel",
    "suffix_mb": "--suffix-mb",
    "suffix_cache": "--suffix-cache",
    "suffix_corpus": "--suffix-corpus",
}
_NAMES = {f.field: f.name for f in ALL} | _OTHER_NAMES


def flag_name(setting: str) -> str:
    """The flag that sets ``setting`` (the setting itself if no flag does)."""
    return _NAMES.get(setting, setting)


def long_flag(setting: str) -> str:
    """The long form alone (``--ctx``), for flags written out to be typed, as in a proposal."""
    f = next((f for f in ALL if f.field == setting), None)
    return next(d for d in f.decls if d.startswith("--")) if f is not None else flag_name(setting)


# --- the values a command receives ---------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """The shared flags a command was given, as the core's values (validated on creation)."""

    values: dict[str, Any]
    pair: PairConfig
    settings: Settings
    sampler: Sampler

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    @classmethod
    def build(cls, values: dict[str, Any]) -> Options:
        def pick(flags: tuple[Flag, ...]) -> dict[str, Any]:
            return {f.field: f.parse(values[f.field]) if f.parse else values[f.field] for f in flags if f.field in values}

        pair = PairConfig(**pick(PLACEMENT + RUNTIME))
        settings = Settings(**pick(DRAFTING))
        sampler = Sampler(**pick(SAMPLING))
        return cls(dict(values), pair, settings, sampler)


def shared(*groups: tuple[Flag, ...], exclude: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the flags of ``groups`` to a command, which then takes ``opts: Options`` instead."""
    flags = [f for g in groups for f in g if f.field not in exclude]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "opts"]
        added = [
            inspect.Parameter(
                f.field,
                inspect.Parameter.KEYWORD_ONLY,
                default=f.default,
                annotation=Annotated[
                    f.type, typer.Option(*f.decls, help=f.help, show_default=f.default not in (None, ...), envvar=f.envvar)
                ],
            )
            for f in flags
        ]

        def command(**kwargs: Any) -> Any:
            values = {f.field: kwargs.pop(f.field) for f in flags}
            return fn(opts=Options.build(values), **kwargs)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + added
        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.__name__, command.__doc__, command.__module__ = fn.__name__, fn.__doc__, fn.__module__
        return command

    return decorate
