"""What the command modules share: option types, the registry, consoles, paths."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from ..errors import UsageError
from ..registry import Registry, Resolved

RegistryOpt = Annotated[
    Optional[Path],
    typer.Option("--registry", help="A models.toml laid over the packaged one (else $SPECRUN_REGISTRY, else ~/.config/specrun/models.toml).", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
CtxOpt = Annotated[int, typer.Option("-c", "--ctx", help="Context length in tokens.")]
GpuLayersOpt = Annotated[int, typer.Option("--gpu-layers", "-ngl", help="Target layers on the GPU; -1 means all.")]
GpuLayersDraftOpt = Annotated[
    Optional[int], typer.Option("--gpu-layers-draft", "-ngld", help="Draft layers on the GPU; -1 means all (default: as --gpu-layers).", show_default=False)
]


def stderr() -> Console:
    return Console(stderr=True, highlight=False)


def stdout() -> Console:
    return Console(highlight=False)


def load_registry(path: Path | None) -> Registry:
    return Registry.load(path)


def cache_dir() -> Path:
    base = os.environ.get("SPECRUN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "specrun"
    )
    return Path(base)


def default_threads() -> int:
    n = os.cpu_count() or 2
    return max(1, min(n, 8))


def check_range(name: str, value, lo=None, hi=None, fix: str = "") -> None:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        raise UsageError(f"{name} must be {bounds}, got {value}", fix or f"pass a value {bounds}")


def print_json(obj) -> None:
    """One JSON object on stdout. A reader that has gone (`| head`) is not an error: without
    this, click turns the BrokenPipeError into a silent exit 1."""
    try:
        sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        from .main import _silence_stdout

        _silence_stdout()


def require_file(r: Resolved) -> Resolved:
    """A registry entry whose file is missing gets the entry's `source` as the fix."""
    from ..errors import InputError

    if not r.path.exists() and r.entry is not None:
        how = r.entry.source or "download it or fix `path` in your models.toml"
        raise InputError(f"model {r.entry.name!r} is not on disk ({r.path})", f"get it with: {how}")
    return r


# --- options shared by generate, chat and bench -------------------------------------------

TargetOpt = Annotated[str, typer.Option("-m", "--model", help="Target: a registry name, alias or .gguf path.")]
DraftModelOpt = Annotated[
    Optional[str],
    typer.Option("-d", "--draft-model", help="Draft model (default: the target's registry draft).", show_default=False),
]
DraftModeOpt = Annotated[str, typer.Option("--draft", help="Drafter: model, ngram, hybrid (n-gram when it has a guess, else the model) or none (plain decoding).")]
DraftMaxOpt = Annotated[
    Optional[int],
    typer.Option("--draft-max", help="Most draft tokens per round (default: 32 adaptive, where the controller picks K up to it; 8 with --fixed).", show_default=False),
]
DRAFT_MAX_ADAPTIVE, DRAFT_MAX_FIXED = 32, 8
DraftMinOpt = Annotated[int, typer.Option("--draft-min", help="Drafts shorter than this are dropped (the round decodes plainly).")]
PSplitOpt = Annotated[float, typer.Option("--draft-p-split", help="The model drafter stops when its top-token probability falls below this (adaptive mode tunes it).")]
FixedOpt = Annotated[bool, typer.Option("--fixed", help="Turn adaptive control off: every round drafts up to --draft-max tokens with the chosen drafter (the draft model still stops below --draft-p-split; use 0 to always draft all).")]
NgramMinOpt = Annotated[int, typer.Option("--ngram-min", help="Shortest suffix the n-gram drafter matches.")]
NgramMaxOpt = Annotated[int, typer.Option("--ngram-max", help="Longest suffix the n-gram drafter matches.")]
TieMarginOpt = Annotated[
    float,
    typer.Option("--tie-margin", help="Greedy only: a position whose top two logits are closer than this is decided by a one-token decode, as plain decoding would (llama.cpp's batched and one-token kernels differ by up to ~0.5 logit). 0 turns it off."),
]
ThreadsOpt = Annotated[int, typer.Option("-t", "--threads", help="CPU threads for both models (n_threads and n_threads_batch).")]
TempOpt = Annotated[float, typer.Option("--temp", help="Temperature; 0 is greedy (exactly the target's argmax).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling (makes runs reproducible).", show_default=False)]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k filter (0 disables).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Top-p (nucleus) filter (1 disables).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Min-p filter (0 disables).")]
NPredictOpt = Annotated[int, typer.Option("-n", "--n-predict", help="Most tokens to generate.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="Show llama.cpp's own log on stderr.")]


class SignalStop:
    """SIGINT/SIGTERM set an event the engine checks between rounds (stop within one round)."""

    def __init__(self, signals=None):
        import signal
        import threading

        self.event = threading.Event()
        self.signum: int | None = None
        self._signals = signals or (signal.SIGINT, signal.SIGTERM)
        self._old = {}

    def _handler(self, signum, frame):
        self.signum = signum
        self.event.set()

    def __enter__(self) -> SignalStop:
        import signal

        for s in self._signals:
            self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for s, h in self._old.items():
            signal.signal(s, h)

    def exit_code(self) -> int:
        import signal

        from ..errors import EXIT_SIGINT, EXIT_SIGTERM

        return EXIT_SIGTERM if self.signum == signal.SIGTERM else EXIT_SIGINT
