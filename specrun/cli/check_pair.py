"""`specrun check-pair`: will this draft work with this target, before any weights load?"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from specrun.cli.common import JsonOpt, RegistryOpt, load_registry, print_json, require_file, stdout
from specrun.cli.display import drafts_table, pair_table
from specrun.cli.options import PLACEMENT, Options, long_flag, shared
from specrun.errors import EXIT_FAIL
from specrun.models.discovery import drafts_for
from specrun.run.inventory import remote_devices
from specrun.run.pair import check_pair


def register(app: typer.Typer) -> None:
    @app.command("check-pair")
    @shared(PLACEMENT)
    def check_pair_cmd(
        opts: Options,
        model: Annotated[str, typer.Option("-m", "--model", help="Target: a registry name, alias or .gguf path.")],
        draft: Annotated[
            Optional[str],
            typer.Option(
                "-d",
                "--draft-model",
                help="Draft: a registry name, alias, store reference or .gguf path; without it, list every known file that can draft (as `specrun drafts`).",
                show_default=False,
            ),
        ] = None,
        registry: RegistryOpt = None,
        json_out: JsonOpt = False,
    ) -> int:
        """Check a target/draft pair from GGUF headers alone: same tokenizer and vocabulary
        (llama.cpp's rules and more), and whether both fit, device by device, placed as they
        would load (the default placement or your --device, --device-draft, --tensor-split):
        local GPUs (NVML), RPC workers (--rpc; asked for their free memory) and system RAM.
        When they do not fit, it prints the exact flags that would.

        Without -d, list the known GGUF files that can draft for the target instead, ranked,
        and why the others cannot (exit 1 if none can); a target with built-in MTP heads lists
        them first, as its best free draft.

        Exit codes: 0 compatible and fits; 1 incompatible or does not fit; 2 usage error;
        3 an input cannot be read.
        """
        reg = load_registry(registry)
        t = require_file(reg.resolve(model))
        if draft is None:
            found = drafts_for(reg, t.path, t.label, opts.pair.n_ctx)
            if json_out:
                print_json(found.to_json())
            else:
                stdout().print(drafts_table(found))
            return 0 if found.any else EXIT_FAIL
        d = require_file(reg.resolve(draft))
        cfg = opts.pair
        report = check_pair(t.path, d.path, cfg, remote=remote_devices(cfg.rpc) if cfg.rpc else None)
        if not report.compat.compatible:  # what could draft instead, by the same finder as `specrun drafts`
            report.suggestions = [c.known.label for c in drafts_for(reg, t.path, t.label, cfg.n_ctx).drafts[:3]]
        if json_out:
            out = report.to_json()
            for p in out["memory"]["proposals"]:
                p["flags"] = " ".join(f"{long_flag(k)} {v}" for k, v in p["settings"].items())
            print_json(out)
        else:
            stdout().print(pair_table(report, long_flag))
        return 0 if report.ok else EXIT_FAIL
