"""`specrun models`: list the registry, or scan every model store on this machine."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from specrun.cli.common import JsonOpt, RegistryOpt, load_registry, print_json, stderr, stdout
from specrun.cli.display import models_table, scan_table
from specrun.errors import EXIT_FAIL, SpecrunError, UnknownModel
from specrun.gguf.facts import model_info
from specrun.models.catalog import SummaryCache, build_catalog
from specrun.models.registry import sha256_file


def register(app: typer.Typer) -> None:
    @app.command("models")
    def models(
        registry: RegistryOpt = None,
        json_out: JsonOpt = False,
        verify: Annotated[bool, typer.Option("--verify", help="Check the sha256 of every present file that has one.")] = False,
        where: Annotated[bool, typer.Option("--where", help="Print the registry files in use and exit.")] = False,
        scan: Annotated[
            bool,
            typer.Option(
                "--scan",
                help="List every GGUF in the registry and in the Ollama, LM Studio, Hugging Face and llama.cpp stores, with its reference and vocabulary fingerprint.",
            ),
        ] = False,
    ) -> int:
        """List registry entries: resolved path, present or missing, size, architecture, quant,
        default draft. Exits 1 if --verify finds a mismatch. With --scan, list every GGUF file
        found in the registry and the model stores instead (headers only, cached by path, size
        and mtime)."""
        reg = load_registry(registry)
        if where:
            for f in reg.files:
                print(f)
            return 0
        if scan:
            start = time.perf_counter()
            cache = SummaryCache(reg.roots.cache_dir)
            cat = build_catalog(reg, reg.roots, cache)
            seconds = time.perf_counter() - start
            if json_out:
                print_json(
                    {
                        "models": [k.to_json() for k in cat.models],
                        "seconds": round(seconds, 4),
                        "headers_read": cat.headers_read,
                        "truncated": cat.truncated,
                    }
                )
            else:
                stdout().print(scan_table(cat))
                stderr().print(
                    f"{len(cat.models)} files in {seconds:.2f} s ({cat.headers_read} headers read, the rest cached)", style="dim"
                )
            for folder in cat.truncated:
                stderr().print(f"specrun: warning: stopped walking {folder} at the entry limit", markup=False)
            return 0
        rows = []
        for e in reg.entries.values():
            row = {**e.to_json(), "present": False, "size": None, "architecture": None, "quant": None}
            try:
                path = reg.locate(e)
            except UnknownModel:
                path = None  # a store reference to a model not pulled yet: missing
            except SpecrunError as err:
                path, row["error"] = None, str(err)
            if path is not None and path.is_file():
                row["present"], row["file"] = True, str(path)
                row["size"] = path.stat().st_size
                try:
                    m = model_info(path)
                    row["architecture"], row["quant"] = m.architecture, m.quant
                except SpecrunError as err:
                    row["error"] = str(err)
                if verify and e.sha256:
                    row["verified"] = sha256_file(path) == e.sha256
            rows.append(row)
        if json_out:
            print_json({"files": [str(f) for f in reg.files], "models": rows})
        else:
            stdout().print(models_table(rows))
        return EXIT_FAIL if any(r.get("verified") is False for r in rows) else 0
