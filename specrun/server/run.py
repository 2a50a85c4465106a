"""Listening and stopping.

``listen`` binds the socket before anything loads, so a taken port or a bad address is one
clear error, not a failure after minutes of loading. ``serve`` runs uvicorn on that socket
until SIGTERM or SIGINT: the first signal stops the engine host (the running generation ends
within a round with its finish reason set, waiting requests get 503), uvicorn closes the
listener and waits for the open streams to finish; a second signal stops at once. It
returns the signal number, so the command can exit 143 or 130 as every specrun command does.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from specrun.errors import SpecrunError, UsageError

__all__ = ["is_loopback", "listen", "serve"]


def listen(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise UsageError(f"{{port}} must be in [0, 65535], got {port}", "0 picks a free port", "port")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UsageError(f"cannot resolve {{host}} {host!r}: {e.strerror}", "give an address such as 127.0.0.1", "host") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise SpecrunError(
            f"cannot listen on {host}:{port}: {e.strerror or e}", "pick another {port} (0 picks a free one)", "port"
        ) from None
    return sock


def address(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return host, port


def is_loopback(sock: socket.socket) -> bool:
    return ipaddress.ip_address(address(sock)[0]).is_loopback


@contextlib.contextmanager
def _stop_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGINT and SIGTERM go to ``handler`` within the block, to what they went to before after it."""
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None], held: list[int]):
        super().__init__(config)
        self.on_stop = on_stop
        self.held = held  # signals that came before this server caught them itself
        self.signum: int | None = None
        self.stopped = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own version re-raises the signal after shutdown, which would kill the
        # process by signal instead of letting the command exit with its documented code
        with _stop_signals(self.handle_exit):
            yield

    def handle_exit(self, sig, frame) -> None:
        if self.signum is not None:
            self.force_exit = True  # a second signal: do not wait for open connections
        else:
            self.signum = sig
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.held and self.signum is None:
            self.handle_exit(self.held[0], None)
        if self.should_exit and not self.stopped:  # on the event loop, not inside the signal handler
            self.stopped = True
            self.on_stop()
        return await super().on_tick(counter)


@contextlib.contextmanager
def signals_held() -> Iterator[list[int]]:
    """Until ``serve`` takes over, SIGINT and SIGTERM are kept (in the list yielded), not acted
    on: a stop that comes right after "listening" is printed still ends the server in order."""
    held: list[int] = []
    with _stop_signals(lambda sig, frame: held.append(sig)):
        yield held


def serve(app, sock: socket.socket, on_stop: Callable[[], None], grace_s: float = 30.0, held: list[int] | None = None) -> int | None:
    """Serve ``app`` on ``sock`` until a signal; returns its number (None if none came).
    ``held``: signals that came before (``signals_held``): the first stops the server at once."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=int(grace_s), http="h11")
    server = _Server(config, on_stop, held if held is not None else [])
    server.run(sockets=[sock])
    if not server.stopped:
        on_stop()
    return server.signum
