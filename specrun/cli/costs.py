"""`specrun costs`: what specrun has measured and learned on this machine, and forgetting it."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from specrun.cli.common import JsonOpt, print_json, stdout
from specrun.cli.display import costs_table
from specrun.run.session import cost_store


def register(app: typer.Typer) -> None:
    @app.command("costs")
    def costs(
        key: Annotated[
            Optional[str],
            typer.Option("--key", help="Only the entries whose key contains this (a model file name, say).", show_default=False),
        ] = None,
        reset: Annotated[
            bool,
            typer.Option("--reset", help="Forget the entries shown: the next run measures afresh and starts its statistics from priors."),
        ] = False,
        json_out: JsonOpt = False,
    ) -> int:
        """Show the stored verify curves (seconds per batch size, relative to one token), when
        and under what conditions they were measured, the draft's cost per token, and what the
        chooser learned about copies and near-ties, per model pair, threads and placement.
        --reset forgets them (all, or those matching --key)."""
        store = cost_store()
        entries = {k: v for k, v in store.entries().items() if not key or key in k}
        if reset:
            gone = store.remove(key or "")
            stdout().print(f"forgot {len(gone)} entr{'y' if len(gone) == 1 else 'ies'} in {store.path}")
            return 0
        if json_out:
            print_json({"path": str(store.path), "entries": entries})
        else:
            stdout().print(costs_table(store.path, entries))
        return 0
