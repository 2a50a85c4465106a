"""What the command modules share: consoles, output, signals, and opening a pair for a command."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from specrun.cli.options import Options, flag_name
from specrun.errors import EXIT_SIGINT, EXIT_SIGTERM, render
from specrun.models.registry import Registry
from specrun.run.session import OpenPair, open_pair, require_file, resolve_pair, uses_heads

__all__ = [
    "JsonOpt", "RegistryOpt", "SignalStop", "load_pair", "load_registry", "print_json", "require_file",
    "silence_stdout", "stderr", "stdout",
]  # fmt: skip

RegistryOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--registry",
        help="A models.toml laid over the packaged one (else $SPECRUN_REGISTRY, else ~/.config/specrun/models.toml).",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


def stderr() -> Console:
    return Console(stderr=True, highlight=False)


def stdout() -> Console:
    return Console(highlight=False)


def load_registry(path: Path | None) -> Registry:
    return Registry.load(path)


def silence_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so Python's exit flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass


def print_json(obj) -> None:
    """One JSON object on stdout. A reader that has gone (`| head`) is not an error: without
    this, click turns the BrokenPipeError into a silent exit 1."""
    try:
        sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()


def load_pair(opts: Options, err: Console, settings=None) -> OpenPair:
    """Resolve the names, check and load the pair, and show its notices. ``settings``: the
    drafting settings to resolve for (default: the command's own)."""
    settings = settings or opts.settings
    target, draft, resolved = resolve_pair(load_registry(opts.registry), opts.model, opts.draft_model, settings)
    pair = open_pair(
        target.path,
        draft.path if draft else None,
        opts.pair,
        uses_heads(target.path, resolved, draft.path if draft else None),
        tree=settings.tree,
    )
    pair.labels = (target.label, draft.label if draft else None)
    for n in pair.notices:
        err.print(f"specrun: {render(n, flag_name)}", style="dim")
    return pair


class SignalStop:
    """SIGINT/SIGTERM set an event the engine checks between rounds (stop within one round)."""

    def __init__(self, signals=None):
        self.event = threading.Event()
        self.signum: int | None = None
        self._signals = signals or (signal.SIGINT, signal.SIGTERM)
        self._old: dict = {}

    def _handler(self, signum, frame):
        self.signum = signum
        self.event.set()

    def __enter__(self) -> SignalStop:
        for s in self._signals:
            self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def exit_code(self) -> int:
        return EXIT_SIGTERM if self.signum == signal.SIGTERM else EXIT_SIGINT
