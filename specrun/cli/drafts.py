"""`specrun drafts`: which known GGUF files can draft for a target, and why the others cannot."""

from __future__ import annotations

from typing import Annotated

import typer

from specrun.cli.common import JsonOpt, RegistryOpt, load_registry, print_json, require_file, stderr, stdout
from specrun.cli.display import drafts_table
from specrun.errors import EXIT_FAIL, UsageError
from specrun.models.discovery import drafts_for
from specrun.run.session import as_given


def register(app: typer.Typer) -> None:
    @app.command("drafts")
    def drafts(
        model: Annotated[str, typer.Argument(help="Target: a registry name, alias, ollama:/lmstudio:/hf: reference or .gguf path.")],
        ctx: Annotated[int, typer.Option("-c", "--ctx", help="Context length for the memory estimates.")] = 4096,
        registry: RegistryOpt = None,
        json_out: JsonOpt = False,
    ) -> int:
        """List every GGUF in the registry and in the Ollama, LM Studio, Hugging Face and
        llama.cpp stores that can draft for MODEL: the same vocabulary under check-pair's
        rules, and smaller. Ranked most useful first (same architecture, then smallest), with
        the size ratio and estimated memory. Every other file is listed with the reason it
        cannot draft. Reads headers only; a fingerprint cache keeps repeat runs fast.

        A target that carries its own MTP heads lists them first: they are its best free draft
        (`--draft mtp`). A block drafter put beside the target (`dflash*.gguf`, `dspark*.gguf`)
        is listed too: `--draft hybrid` (the default) drafts with it when no -d is given.

        Exit codes: 0 at least one draft found (the heads count); 1 none; 3 the target cannot be read.
        """
        if ctx < 1:
            raise UsageError(f"-c/--ctx must be >= 1, got {ctx}", "pass a positive context length")
        reg = load_registry(registry)
        t = require_file(reg.resolve(model))
        report = drafts_for(reg, t.path, t.label, ctx, given=as_given(model, t))
        if json_out:
            print_json(report.to_json())
        else:
            stdout().print(drafts_table(report))
            n = len(report.drafts) + len(report.cannot) + len(report.unreadable) + len(report.no_tokenizer)
            stderr().print(
                f"checked {n} files in {report.seconds:.2f} s ({report.headers_read} headers read, the rest cached)", style="dim"
            )
        return 0 if report.any else EXIT_FAIL
