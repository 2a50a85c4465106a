"""`specrun check-pair`: will this draft work with this target, before any weights load?"""

from __future__ import annotations

from typing import Annotated

import typer

from ..discovery import drafts_for
from ..display import drafts_table, pair_table
from ..errors import EXIT_FAIL
from ..pair import check_pair
from .common import (
    CtxOpt, GpuLayersDraftOpt, GpuLayersOpt, JsonOpt, RegistryOpt, check_range, load_registry,
    print_json, require_file, stdout,
)


def register(app: typer.Typer) -> None:
    @app.command("check-pair")
    def check_pair_cmd(
        model: Annotated[str, typer.Option("-m", "--model", help="Target: a registry name, alias or .gguf path.")],
        draft: Annotated[
            str | None,
            typer.Option("-d", "--draft-model", help="Draft: a registry name, alias, store reference or .gguf path; without it, list every known file that can draft (as `specrun drafts`).", show_default=False),
        ] = None,
        ctx: CtxOpt = 4096,
        gpu_layers: GpuLayersOpt = -1,
        gpu_layers_draft: GpuLayersDraftOpt = None,
        registry: RegistryOpt = None,
        json_out: JsonOpt = False,
    ) -> int:
        """Check a target/draft pair from GGUF headers alone: same tokenizer and vocabulary
        (llama.cpp's rules and more), and whether both fit in free GPU memory (NVML) or,
        without an NVIDIA GPU, in system RAM.

        Without -d, list the known GGUF files that can draft for the target instead, ranked,
        and why the others cannot (exit 1 if none can).

        Exit codes: 0 compatible and fits; 1 incompatible or does not fit; 2 usage error;
        3 an input cannot be read.
        """
        check_range("-c/--ctx", ctx, 1, 1 << 24)
        check_range("--gpu-layers", gpu_layers, -1)
        if gpu_layers_draft is not None:
            check_range("--gpu-layers-draft", gpu_layers_draft, -1)
        reg = load_registry(registry)
        t = require_file(reg.resolve(model))
        if draft is None:
            found = drafts_for(reg, t.path, t.label, ctx)
            if json_out:
                print_json(found.to_json())
            else:
                stdout().print(drafts_table(found))
            return 0 if found.drafts else EXIT_FAIL
        d = require_file(reg.resolve(draft))
        candidates = {e.name: e.path for e in reg.entries.values()}
        report = check_pair(t.path, d.path, ctx, gpu_layers, gpu_layers_draft, candidates)
        if json_out:
            print_json(report.to_json())
        else:
            stdout().print(pair_table(report))
        return 0 if report.ok else EXIT_FAIL
