"""`specrun devices`: what llama.cpp can place layers on, here and on RPC workers."""

from __future__ import annotations

import typer

from specrun.cli.common import JsonOpt, print_json, stdout
from specrun.cli.display import devices_table
from specrun.cli.options import RPC, Options, shared


def register(app: typer.Typer) -> None:
    @app.command("devices")
    @shared(RPC)
    def devices(opts: Options, json_out: JsonOpt = False) -> int:
        """List the devices llama.cpp sees, with free memory: local GPUs (CUDA, Metal...), the
        CPU, and with --rpc each worker's devices (RPC0, RPC1... in the order given). These are
        the names --device and --device-draft take.

        Exit codes: 0 listed; 3 an RPC worker cannot be reached; 1 one speaks another protocol.
        """
        from specrun import llama  # loads llama_cpp

        llama.add_workers(opts.pair.rpc)
        rows = [
            {
                "name": d.name,
                "backend": d.backend,
                "kind": d.kind if not d.is_rpc else "rpc",
                "description": d.description,
                "free": d.free,
                "total": d.total,
            }
            for d in llama.devices()
        ]
        if json_out:
            print_json({"devices": rows, "rpc_support": llama.supports_rpc()})
        else:
            stdout().print(devices_table(rows))
        return 0
