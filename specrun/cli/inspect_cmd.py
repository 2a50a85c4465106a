"""`specrun inspect`: GGUF metadata without loading weights."""

from __future__ import annotations

from typing import Annotated

import typer

from specrun.cli.common import JsonOpt, RegistryOpt, load_registry, print_json, require_file, stdout
from specrun.cli.display import inspect_table
from specrun.gguf.facts import model_info
from specrun.gguf.heads import model_json


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    def inspect(
        model: Annotated[str, typer.Argument(help="A registry name, alias or path to a .gguf file.")],
        registry: RegistryOpt = None,
        json_out: JsonOpt = False,
    ) -> int:
        """Show a model's metadata from its GGUF header: architecture, parameters, layers,
        context, tokenizer and vocabulary, special tokens, quantization, chat template and
        KV-cache bytes per 1k context. Reads no weights."""
        r = require_file(load_registry(registry).resolve(model))
        m = model_info(r.path)
        if json_out:
            print_json(model_json(m))
        else:
            stdout().print(inspect_table(m))
        return 0
