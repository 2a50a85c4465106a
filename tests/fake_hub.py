"""A Hugging Face Hub on 127.0.0.1 that speaks enough of the protocol for huggingface_hub.

    hub = FakeHub({"org/repo": {"model-Q4_K_M.gguf": data}}).start()
    env HF_ENDPOINT=hub.url  ->  huggingface_hub lists, HEADs and downloads for real
    hub.stop()

What it serves (as huggingface.co does):

* ``GET /api/models/<org>/<repo>/tree/<rev>?recursive=...``: the file list, each file with its
  git blob id and LFS metadata (``lfs.oid`` is the sha256);
* ``HEAD /<org>/<repo>/resolve/<rev>/<path>``: ``X-Repo-Commit``, ``X-Linked-Etag`` (the
  sha256), ``X-Linked-Size``, ``Content-Length``;
* ``GET`` of the same URL, honouring ``Range: bytes=N-`` with 206 and ``Content-Range``;
* 404 with ``X-Error-Code: RepoNotFound`` / ``EntryNotFound``.

Faults for tests: ``drop_once[path] = n`` sends the full Content-Length, then n bytes, then
closes the connection, once; ``lie_sha256[path] = hex`` advertises a wrong LFS sha256.
Every request is recorded in ``requests`` as (method, path, Range header).
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

COMMIT = "c0ffee0000000000000000000000000000000001"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.drop_once: dict[str, int] = {}
        self.lie_sha256: dict[str, str] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hub._handle(self, head=False)

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def sha256(self, repo: str, path: str) -> str:
        return self.lie_sha256.get(path) or hashlib.sha256(self.repos[repo][path]).hexdigest()

    # --- request handling -------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlsplit(h.path)
        path = unquote(url.path)
        rng = h.headers.get("Range")
        with self._lock:
            self.requests.append(("HEAD" if head else "GET", path, rng))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            return self._tree(h, f"{parts[2]}/{parts[3]}")
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(h, f"{parts[0]}/{parts[1]}", "/".join(parts[4:]), head, rng)
        self._error(h, 404, "RepoNotFound")

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _tree(self, h: BaseHTTPRequestHandler, repo: str) -> None:
        files = self.repos.get(repo)
        if files is None:
            return self._error(h, 404, "RepoNotFound")
        entries: list[dict[str, Any]] = []
        folders = sorted({p.rsplit("/", 1)[0] for p in files if "/" in p})
        for d in folders:
            entries.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "path": d})
        for p, data in sorted(files.items()):
            lfs = {"oid": self.sha256(repo, p), "size": len(data), "pointerSize": 134}
            entries.append({"type": "file", "oid": git_blob_id(data), "size": len(data), "path": p, "lfs": lfs})
        body = json.dumps(entries).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _file(self, h: BaseHTTPRequestHandler, repo: str, path: str, head: bool, rng: str | None) -> None:
        if repo not in self.repos:
            return self._error(h, 404, "RepoNotFound")
        data = self.repos[repo].get(path)
        if data is None:
            h.send_response(404)
            h.send_header("X-Error-Code", "EntryNotFound")
            h.send_header("X-Repo-Commit", COMMIT)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        start = 0
        if rng and rng.startswith("bytes=") and not head:
            start = int(rng[len("bytes=") :].split("-")[0])
        body = data[start:]
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{git_blob_id(data)}"')
        h.send_header("X-Linked-Etag", f'"{self.sha256(repo, path)}"')
        h.send_header("X-Linked-Size", str(len(data)))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(body)))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        with self._lock:
            cut = self.drop_once.pop(path, None)
        if cut is not None:
            h.wfile.write(body[:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # the peer sees the body end early
            return
        h.wfile.write(body)
