"""`specrun pull`: download registry entries and hf: references, checked by sha256."""

from __future__ import annotations

from typing import Annotated

import typer

from specrun.cli.common import JsonOpt, RegistryOpt, load_registry, print_json, stderr, stdout
from specrun.models.download import pull


def register(app: typer.Typer) -> None:
    @app.command("pull")
    def pull_cmd(
        names: Annotated[
            list[str], typer.Argument(help="Registry names or aliases (e.g. 70b 8b), or hf:org/repo[:QUANT or /file.gguf] references.")
        ],
        registry: RegistryOpt = None,
        json_out: JsonOpt = False,
    ) -> int:
        """Download models through huggingface_hub (HF_TOKEN and HF_ENDPOINT apply; a dropped
        connection is resumed). A registry entry's file goes to its `path` (its `hf` key says
        where from); an hf: reference goes to the Hugging Face cache, where hf: references
        resolve. Split GGUFs come with all their parts. Every file is checked against the
        registry's sha256 or the Hub's; a mismatch deletes it and exits 1.

        Exit codes: 0 all present or downloaded; 1 a download failed or did not verify;
        2 a name that cannot be pulled; 3 unknown model, repo or file.
        """
        reg = load_registry(registry)
        err = stderr()
        done = []
        for name in names:
            p = pull(name, reg, reg.roots, log=lambda s: err.print(s, style="dim", markup=False))
            done.append(p)
            if not json_out:
                verb = "already present" if p.present else "downloaded and verified"
                stdout().print(f"{p.label}: {verb}: {', '.join(str(f) for f in p.files)}", markup=False)
        if json_out:
            print_json(
                {
                    "pulled": [
                        {
                            "name": p.label,
                            "repo": p.repo,
                            "files": [str(f) for f in p.files],
                            "downloaded_bytes": p.downloaded,
                            "already_present": p.present,
                        }
                        for p in done
                    ]
                }
            )
        return 0
