"""`specrun doctor`: what this machine can do, one line per problem with its fix."""

from __future__ import annotations

import typer

from specrun.cli.common import JsonOpt, print_json, stdout
from specrun.cli.options import RPC, Options, shared


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    @shared(RPC)
    def doctor(opts: Options, json_out: JsonOpt = False) -> int:
        """Check the llama_cpp build (version, GPU offload, RPC support), NVIDIA driver and
        GPUs with free memory, system RAM, and the platform (WSL2, Apple Silicon); with --rpc,
        whether each worker answers, its protocol and its devices' free memory. Prints one line
        per problem, each with its fix. Exits 1 if there is a problem."""
        from specrun.cli.diagnose import diagnose  # loads llama_cpp

        report = diagnose(rpc_endpoints=opts.pair.rpc)
        if json_out:
            print_json(report.to_json())
        else:
            con = stdout()
            for k, v in report.facts:
                con.print(f"[bold]{k:<18}[/bold] {v}")
            for p in report.problems:
                con.print(f"[red]problem:[/red] {p}")
            if not report.problems:
                con.print("[green]no problems found[/green]")
        return 1 if report.problems else 0
