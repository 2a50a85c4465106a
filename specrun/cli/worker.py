"""`specrun worker`: serve this machine's devices to other machines' specrun (or llama.cpp) over RPC."""

from __future__ import annotations

import ipaddress
import socket
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer

from specrun.cli.common import SignalStop, stderr
from specrun.errors import BackendError, InputError, SpecrunError, UsageError
from specrun.fit.rpc import DEFAULT_PORT, PROTOCOL, is_loopback
from specrun.run.config import default_threads

WARNING = (
    "llama.cpp's RPC protocol has no authentication and no encryption: anyone who can reach {endpoint} can use this "
    "machine's {devices} and memory and see the weights and activations sent to it, and the server is not hardened "
    "against hostile clients. Let only a trusted network reach it (or serve on 127.0.0.1 and tunnel, e.g. ssh -L)."
)


def _check_host(host: str, unauthenticated_ok: bool) -> None:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise UsageError(
            f"--host takes an IPv4 address, got {host!r} (llama.cpp's RPC server binds IPv4 only)",
            "e.g. 127.0.0.1, or 0.0.0.0 for every interface",
            "host",
        ) from None
    if not is_loopback(host) and not unauthenticated_ok:
        raise UsageError(
            f"serving on {host} exposes an unauthenticated, unencrypted RPC server beyond this machine",
            "add --i-know-rpc-is-unauthenticated if only a trusted network can reach it, or serve on 127.0.0.1 and tunnel (ssh -L)",
            "host",
        )


def _check_port_free(host: str, port: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as llama.cpp's server does
        s.bind((host, port))
    except OSError as e:
        raise SpecrunError(
            f"cannot listen on {host}:{port}: {e.strerror}", "is another worker running there? pick another --port"
        ) from None
    finally:
        s.close()


def register(app: typer.Typer) -> None:
    @app.command("worker")
    def worker(
        host: Annotated[
            str,
            typer.Option(
                "--host", "-H", help="The IPv4 address to listen on; anything but loopback needs --i-know-rpc-is-unauthenticated."
            ),
        ] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", "-p", help="The TCP port to listen on.", min=1, max=65535)] = DEFAULT_PORT,
        device: Annotated[
            Optional[str],
            typer.Option(
                "--device",
                "-dev",
                help="Local devices to serve, comma-separated, e.g. CUDA0,CUDA1 or CPU (default: every local GPU, else the CPU).",
                show_default=False,
            ),
        ] = None,
        cache: Annotated[
            Optional[Path],
            typer.Option(
                "--cache",
                "-c",
                help="Keep large tensors a client sends in this folder, so the next load of the same model skips the network.",
                show_default=False,
            ),
        ] = None,
        threads: Annotated[
            int, typer.Option("-t", "--threads", help="CPU threads when serving the CPU.", min=1, max=1024)
        ] = default_threads(),
        unauthenticated_ok: Annotated[
            bool,
            typer.Option("--i-know-rpc-is-unauthenticated", help="Allow a non-loopback --host: RPC has no authentication or encryption."),
        ] = False,
    ) -> int:
        """Serve this machine's devices to another machine's `specrun ... --rpc HOST:PORT` (or
        llama.cpp's --rpc) through llama.cpp's own RPC server, from the same build, so the
        protocol always matches. One client at a time. Stop it with Ctrl-C.

        RPC has no authentication and no encryption: serve on 127.0.0.1 (the default), or on a
        network only trusted machines can reach, with --i-know-rpc-is-unauthenticated.

        Exit codes: 2 usage error (a non-loopback --host without the flag, an unknown device);
        1 the port is taken or the server stopped; 130/143 stopped by SIGINT/SIGTERM.
        """
        from specrun import llama  # loads llama_cpp

        _check_host(host, unauthenticated_ok)
        names = tuple(n.strip() for n in device.split(",")) if device is not None else None
        if names is not None and not all(names):
            raise UsageError(f"--device takes device names separated by commas, got {device!r}", "see `specrun devices`", "device")
        served = llama.worker_devices(names)
        if cache is not None:
            try:
                cache.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise InputError(f"cannot create the cache folder {cache}: {e.strerror}", "pick a writable folder") from None
        _check_port_free(host, port)
        endpoint = f"{host}:{port}"
        err = stderr()
        err.print(
            f"specrun worker: WARNING: {WARNING.format(endpoint=endpoint, devices=', '.join(d.name for d in served))}", style="bold yellow"
        )
        err.print(
            f"specrun worker: serving {', '.join(f'{d.name} ({d.description})' for d in served)} on {endpoint}, RPC protocol "
            f"{'.'.join(map(str, PROTOCOL))}, {threads} threads; on the main machine: specrun generate --rpc "
            f"{'THIS_MACHINE' if host == '0.0.0.0' else host}:{port} -m ...",
            style="dim",
        )
        stopped = threading.Event()

        def serve() -> None:
            try:
                llama.serve(endpoint, served, cache, threads)
            finally:
                stopped.set()

        with SignalStop() as sig:
            threading.Thread(target=serve, name="rpc-server", daemon=True).start()
            while not stopped.is_set() and not sig.event.is_set():
                sig.event.wait(0.5)
        if sig.signum is not None:
            err.print("specrun worker: stopped", style="dim")
            return sig.exit_code()
        raise BackendError(f"the RPC server on {endpoint} stopped", "see llama.cpp's message above")
