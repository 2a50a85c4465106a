"""A real `specrun serve` process on 127.0.0.1 (a free port it picks itself), and plain HTTP
helpers over http.client, for tests/test_serve.py and scripts/tools/bench_serve.py.

Nothing here talks to any address but the loopback one the server printed."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

SPECRUN = Path(sys.executable).parent / "specrun"
LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)/v1")


class Server:
    """``specrun serve ... --port 0``; waits for its "listening on" line, then drains stderr."""

    def __init__(self, args: list[str], home: Path, env: dict[str, str] | None = None, start_timeout: float = 300.0, isolate: bool = True):
        """``isolate``: a registry and cost cache of its own under ``home`` (tests); else the user's."""
        full_env = {k: v for k, v in os.environ.items() if k != "SPECRUN_API_KEY"}
        full_env["NO_COLOR"] = "1"
        if isolate:
            full_env.update({"SPECRUN_CACHE_DIR": str(home / "cache"), "XDG_CONFIG_HOME": str(home / "config")})
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [str(SPECRUN), "serve", "--host", "127.0.0.1", "--port", "0", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env,
        )  # fmt: skip
        self.lines: list[str] = []
        self.port = 0
        self._listening = threading.Event()
        self._drain = threading.Thread(target=self._read, daemon=True)  # a thread: select() cannot see text already buffered
        self._drain.start()
        if not self._listening.wait(start_timeout) or not self.port:
            self.kill()
            raise AssertionError(f"specrun serve did not start (rc {self.proc.returncode}):\n" + self.stderr)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = LISTENING.search(line)
            if m and not self.port:
                self.port = int(m.group(1))
                self._listening.set()
        self._listening.set()  # the process ended

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float) -> int:
        """The exit code, once the process has ended and its last stderr line is read (the
        drain thread may still hold it when the process is gone)."""
        rc = self.proc.wait(timeout)
        self._drain.join(timeout)
        return rc

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def conn(self, timeout: float = 120.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 120.0):
        """(status, headers, parsed JSON or text). ``body``: a dict (sent as JSON) or raw bytes."""
        c = self.conn(timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
            h = {"Content-Type": "application/json", **(headers or {})}
            c.request(method, path, body=data, headers=h)
            r = c.getresponse()
            raw = r.read()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = raw.decode(errors="replace")
            return r.status, {k.lower(): v for k, v in r.getheaders()}, parsed
        finally:
            c.close()

    def post(self, path: str, body, **kw):
        return self.request("POST", path, body, **kw)

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    def stream(self, path: str, body: dict, headers: dict | None = None, timeout: float = 120.0) -> Iterator[dict | str]:
        """The SSE ``data:`` payloads, parsed (``"[DONE]"`` as the string)."""
        c = self.conn(timeout)
        try:
            c.request(
                "POST",
                path,
                body=json.dumps({**body, "stream": True}).encode(),
                headers={"Content-Type": "application/json", **(headers or {})},
            )
            r = c.getresponse()
            assert r.status == 200, (r.status, r.read())
            for line in iter(r.readline, b""):
                line = line.strip()
                if line.startswith(b"data: "):
                    payload = line[6:].decode()
                    yield payload if payload == "[DONE]" else json.loads(payload)
        finally:
            c.close()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {"name{labels}": value}."""
        status, _, text = self.get("/metrics")
        assert status == 200
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out
