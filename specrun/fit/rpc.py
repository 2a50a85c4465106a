"""llama.cpp's RPC workers as seen from this side of the socket: endpoints, a bounded handshake,
and the health and traffic of the connections ggml opens.

ggml's own RPC client connects without a timeout and aborts the whole process when a worker is
unreachable or speaks another protocol version. So specrun shakes hands first, itself, with a
deadline: it sends ggml's first message (``RPC_CMD_HELLO``) and reads the version in the reply.
Only a worker that answers with a compatible version is handed to ggml. The wire format used here
is protocol 7 (llama.cpp's ``ggml-rpc.h``): a command byte, a little-endian u64 size and the
request (24 bytes of transport capabilities, zero for plain TCP); the reply is a u64 size and
``major, minor, patch, padding`` followed by the worker's 24 capability bytes. Workers of
protocol 2 to 6 took an empty HELLO and answered three bytes; that form is tried to name their
version when the first is refused.

Nothing here imports llama_cpp: ``backend`` registers the workers with ggml after
:func:`handshake` has vouched for them.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from specrun.errors import SpecrunError, UsageError, WorkerMismatch, WorkerUnreachable

PROTOCOL = (7, 0, 0)  # RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION of the llama.cpp this speaks
CMD_HELLO = 14  # RPC_CMD_HELLO, "must be always 14" in every version
CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE
DEFAULT_PORT = 50052  # llama.cpp's rpc-server default
MAX_SERVERS = 16  # GGML_RPC_MAX_SERVERS
CONNECT_TIMEOUT = 3.0  # seconds to open the TCP connection
HELLO_TIMEOUT = 4.0  # seconds for the worker to answer the handshake once connected
# Once ggml holds a connection: probe an idle one after 5 s, every 2 s, give up after 3 misses,
# and give up on data unacknowledged for 15 s. A worker machine that vanishes without closing its
# sockets (power, cable) then ends the command in seconds instead of TCP's ~15 minutes.
KEEPALIVE = (5, 2, 3)
USER_TIMEOUT_MS = 15_000


@dataclass(frozen=True, order=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        return is_loopback(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_endpoint(text: str, setting: str = "rpc") -> Endpoint:
    """``HOST:PORT``, as llama.cpp's ``--rpc`` takes it (IPv4 addresses or host names)."""
    s = text.strip()
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port:
        raise UsageError(f"{{{setting}}} takes HOST:PORT, got {text!r}", f"e.g. 192.168.1.20:{DEFAULT_PORT}", setting)
    if host.startswith("[") or ":" in host:
        raise UsageError(
            f"{{{setting}}} cannot use the IPv6 address {host}: llama.cpp's RPC client connects over IPv4 only",
            "give the worker's IPv4 address or host name",
            setting,
        )
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"{{{setting}}}: the port in {text!r} must be a number from 1 to 65535", f"e.g. {host}:{DEFAULT_PORT}", setting)
    if any(c.isspace() for c in host) or "," in host:
        raise UsageError(f"{{{setting}}}: {host!r} is not a host name", "separate workers with commas and no spaces", setting)
    return Endpoint(host, int(port))


def parse_endpoints(value: str | tuple[str, ...] | list[str] | None, setting: str = "rpc") -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT...]`` (or a list of them) as a tuple of normalised endpoints."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else [x for v in value for x in str(v).split(",")]
    items = [x.strip() for x in items if x.strip()]
    eps = [str(parse_endpoint(x, setting)) for x in items]
    dup = next((e for i, e in enumerate(eps) if e in eps[:i]), None)
    if dup is not None:
        raise UsageError(f"{{{setting}}} names the worker {dup} twice", "give each worker once", setting)
    if len(eps) > MAX_SERVERS:
        raise UsageError(f"{{{setting}}} names {len(eps)} workers; llama.cpp takes at most {MAX_SERVERS}", "drop some", setting)
    return tuple(eps)


# --- the handshake ------------------------------------------------------------------------------


def _connect(ep: Endpoint, timeout: float) -> socket.socket:
    """A TCP connection over IPv4 (as ggml makes it), within ``timeout`` seconds."""
    try:
        infos = socket.getaddrinfo(ep.host, ep.port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise WorkerUnreachable(f"RPC worker {ep}: cannot resolve {ep.host!r} ({e.strerror})", "check the host name", "rpc") from None
    addr = infos[0][4]
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(addr)
    except TimeoutError:
        s.close()
        raise WorkerUnreachable(
            f"RPC worker {ep} did not answer within {timeout:.0f} s", "is the machine up, and does a firewall let its port through?", "rpc"
        ) from None
    except OSError as e:
        s.close()
        if isinstance(e, ConnectionRefusedError):
            raise WorkerUnreachable(
                f"RPC worker {ep} refused the connection: nothing listens on port {ep.port}", start_hint(ep), "rpc"
            ) from None
        raise WorkerUnreachable(f"RPC worker {ep}: {e.strerror or e}", start_hint(ep), "rpc") from None
    return s


def start_hint(ep: Endpoint) -> str:
    flag = "" if ep.is_loopback else " --i-know-rpc-is-unauthenticated"
    host = ep.host if ep.is_loopback else "0.0.0.0"
    return f"start one there with: specrun worker --host {host} --port {ep.port}{flag}"


def _recv_exact(s: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None if the peer closed the connection first."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _hello(ep: Endpoint, request: bytes, connect_timeout: float, hello_timeout: float) -> tuple[int, int, int] | None:
    """Send one HELLO; the version in the reply, or None if the worker hung up without one."""
    s = _connect(ep, connect_timeout)
    try:
        s.settimeout(hello_timeout)
        s.sendall(request)
        head = _recv_exact(s, 8)
        if head is None:
            return None
        (size,) = struct.unpack("<Q", head)
        if size not in (3, 4 + CONN_CAPS):
            raise WorkerUnreachable(f"{ep} answered, but not as a llama.cpp RPC worker", "check the port", "rpc")
        body = _recv_exact(s, size)
        if body is None:
            return None
        return body[0], body[1], body[2]
    except TimeoutError:
        raise WorkerUnreachable(
            f"RPC worker {ep} accepted the connection but did not answer the handshake within {hello_timeout:.0f} s",
            "a worker serves one client at a time: is another specrun or llama.cpp using it?",
            "rpc",
        ) from None
    except OSError as e:
        if isinstance(e, ConnectionResetError):
            return None
        raise WorkerUnreachable(f"RPC worker {ep}: {e.strerror or e}", start_hint(ep), "rpc") from None
    finally:
        s.close()


def compatible(version: tuple[int, int, int], ours: tuple[int, int, int] = PROTOCOL) -> bool:
    """ggml's own rule: the same major version, and a minor no newer than ours."""
    return version[0] == ours[0] and version[1] <= ours[1]


def handshake(endpoint: str, connect_timeout: float = CONNECT_TIMEOUT, hello_timeout: float = HELLO_TIMEOUT) -> tuple[int, int, int]:
    """Shake hands with a worker within the timeouts; its protocol version. Raises
    :class:`WorkerUnreachable` (no answer) or :class:`WorkerMismatch` (another version)."""
    ep = parse_endpoint(endpoint)
    ours = ".".join(map(str, PROTOCOL))
    version = _hello(ep, bytes([CMD_HELLO]) + struct.pack("<Q", CONN_CAPS) + bytes(CONN_CAPS), connect_timeout, hello_timeout)
    if version is None:  # refused our request's size: an older worker? ask the old way to name it
        version = _hello(ep, bytes([CMD_HELLO]) + struct.pack("<Q", 0), connect_timeout, hello_timeout)
        if version is None:
            raise WorkerMismatch(
                f"RPC worker {ep} hung up on the protocol {ours} handshake without naming its version",
                "run the worker from the same llama.cpp / llama-cpp-python version as this machine (specrun worker does)",
                "rpc",
            )
    if not compatible(version):
        theirs = ".".join(map(str, version))
        raise WorkerMismatch(
            f"RPC worker {ep} speaks protocol {theirs}, this specrun's llama.cpp speaks {ours}",
            "run the worker from the same llama-cpp-python version as this machine (specrun worker does)",
            "rpc",
        )
    return version


def alive(endpoint: str, timeout: float = 0.5) -> bool:
    """Does anything still accept connections there? (A cheap check after a lost connection.)"""
    try:
        _connect(parse_endpoint(endpoint), timeout).close()
        return True
    except WorkerUnreachable:
        return False


# --- when a worker is lost ------------------------------------------------------------------------

_fatal: list[Callable[[SpecrunError], None] | None] = [None]


def on_fatal(handler: Callable[[SpecrunError], None] | None) -> None:
    """``handler(err)`` runs when llama.cpp is about to abort the process because a worker was
    lost (ggml's RPC client has no other way to fail). It should report ``err`` and end the
    process itself: returning lets the abort go on. Only a front end sets it."""
    _fatal[0] = handler


def fatal(err: SpecrunError) -> None:
    handler = _fatal[0]
    if handler is not None:
        handler(err)
    else:
        sys.stderr.write(f"{err}\n")


# --- the connections ggml holds -----------------------------------------------------------------


def _sockets_to(endpoint: str) -> list[int]:
    """File descriptors of this process's TCP connections to ``endpoint`` (Linux; else none)."""
    import psutil

    ep = parse_endpoint(endpoint)
    try:
        ip = socket.gethostbyname(ep.host)
        conns = psutil.Process().net_connections(kind="tcp4")
    except (OSError, psutil.Error):
        return []
    return [c.fd for c in conns if c.fd is not None and c.fd >= 0 and c.raddr and c.raddr.ip == ip and c.raddr.port == ep.port]


def _borrowed(endpoint: str) -> Iterator[socket.socket]:
    """ggml's connections to ``endpoint``, each as a duplicate socket that is closed after use
    (the duplicate only; ggml's own descriptor stays open)."""
    for fd in _sockets_to(endpoint):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            yield s
        finally:
            s.close()


def watch(endpoint: str) -> int:
    """Turn on TCP keepalive and a send timeout on ggml's connections to ``endpoint``, so that a
    worker that disappears without closing them is noticed in seconds. Returns how many were set."""
    n = 0
    for s in _borrowed(endpoint):
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if sys.platform.startswith("linux"):
                idle, interval, count = KEEPALIVE
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
                s.setsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", 18), USER_TIMEOUT_MS)
            n += 1
        except OSError:
            pass
    return n


@dataclass(frozen=True)
class Traffic:
    """Bytes through this process's connections to the workers so far, and the smoothed round trip."""

    sent: int
    received: int
    rtt_s: float | None  # the largest of the connections' smoothed RTTs

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.sent - other.sent, self.received - other.received, self.rtt_s)


_TCP_INFO = getattr(socket, "TCP_INFO", 11)


def traffic(endpoints: tuple[str, ...]) -> Traffic | None:
    """Linux's TCP_INFO summed over the connections to ``endpoints``; None where it cannot be read."""
    if not sys.platform.startswith("linux"):
        return None
    sent = received = 0
    rtt: float | None = None
    found = False
    for ep in endpoints:
        for s in _borrowed(ep):
            try:
                info = s.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 232)
            except OSError:
                continue
            if len(info) < 136:
                continue
            # struct tcp_info: u32 tcpi_rtt (microseconds) at byte 68; u64 tcpi_bytes_acked at 120,
            # tcpi_bytes_received at 128
            (rtt_us,) = struct.unpack_from("<I", info, 68)
            acked, got = struct.unpack_from("<QQ", info, 120)
            sent, received, found = sent + acked, received + got, True
            rtt = max(rtt or 0.0, rtt_us / 1e6)
    return Traffic(sent, received, rtt) if found else None


def wait_for(endpoint: str, timeout: float = 30.0) -> tuple[int, int, int]:
    """Wait until a worker that is starting answers the handshake (for scripts and tests)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return handshake(endpoint, connect_timeout=1.0, hello_timeout=2.0)
        except WorkerUnreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
