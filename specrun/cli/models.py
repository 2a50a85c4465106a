"""`specrun models`: list the registry."""

from __future__ import annotations

from typing import Annotated

import typer

from ..display import models_table
from ..errors import EXIT_FAIL, SpecrunError
from ..modelinfo import model_info
from ..registry import sha256_file
from .common import JsonOpt, RegistryOpt, load_registry, print_json, stdout


def register(app: typer.Typer) -> None:
    @app.command("models")
    def models(
        registry: RegistryOpt = None,
        json_out: JsonOpt = False,
        verify: Annotated[bool, typer.Option("--verify", help="Check the sha256 of every present file that has one.")] = False,
        where: Annotated[bool, typer.Option("--where", help="Print the registry files in use and exit.")] = False,
    ) -> int:
        """List registry entries: resolved path, present or missing, size, architecture, quant,
        default draft. Exits 1 if --verify finds a mismatch."""
        reg = load_registry(registry)
        if where:
            for f in reg.files:
                print(f)
            return 0
        rows = []
        for e in reg.entries.values():
            row = {**e.to_json(), "present": e.path.is_file(), "size": None, "architecture": None, "quant": None}
            if row["present"]:
                row["size"] = e.path.stat().st_size
                try:
                    m = model_info(e.path)
                    row["architecture"], row["quant"] = m.architecture, m.quant
                except SpecrunError as err:
                    row["error"] = str(err)
                if verify and e.sha256:
                    row["verified"] = sha256_file(e.path) == e.sha256
            rows.append(row)
        if json_out:
            print_json({"files": [str(f) for f in reg.files], "models": rows})
        else:
            stdout().print(models_table(rows))
        return EXIT_FAIL if any(r.get("verified") is False for r in rows) else 0
