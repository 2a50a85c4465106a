"""Past one machine: llama.cpp RPC workers (the placement and memory over devices are tested in
test_placement.py and test_memory.py).

Three tiers:

* pure: parsing and checking the endpoints, and the handshake against scripted peers;
* real RPC on loopback: ``specrun worker`` subprocesses on 127.0.0.1 serving this CPU, and
  ``specrun`` subprocesses using them (never this test process: ggml registers a worker's devices
  for the life of the process, and a lost worker aborts it);
* the demo pair through a worker, token for token against a local run, and llama.cpp's own
  per-device buffer sizes against the estimate.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from serve_helpers import Server

from specrun.errors import EXIT_FAIL, EXIT_INPUT, EXIT_USAGE, UsageError, WorkerMismatch, WorkerUnreachable
from specrun.fit import rpc
from specrun.fit.memory import Dev, layer_devices
from specrun.fit.placement import plan
from specrun.gguf.facts import model_info
from specrun.run.config import PairConfig
from specrun.run.session import cost_key

SPECRUN = Path(sys.executable).parent / "specrun"
GiB = 1 << 30
PROMPT = "The quick brown fox"  # greedy from here runs to the end of a 4096 context on the tiny target


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")


# --- loopback workers ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """A `specrun worker` subprocess on 127.0.0.1, serving this machine's CPU."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(SPECRUN), "worker", "--port", str(self.port), "-t", "2", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            rpc.wait_for(self.endpoint, timeout=60)
        except WorkerUnreachable:
            self.stop()
            raise AssertionError(f"the worker did not start: {self.proc.communicate()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.stop()


def specrun(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(SPECRUN), *args], capture_output=True, text=True, timeout=timeout, **kw)


def error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("specrun: error:")]
    assert len(lines) == 1, err
    return lines[0]


def generate_json(*args: str) -> dict:
    p = specrun("generate", *args, "--temp", "0", "-t", "2", "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


# --- the settings on their own -------------------------------------------------------------------


def test_endpoints_are_parsed_and_checked():
    assert rpc.parse_endpoints("10.0.0.2:50052, box:7000") == ("10.0.0.2:50052", "box:7000")
    for bad, needle in [
        ("10.0.0.2", "HOST:PORT"),
        ("10.0.0.2:0", "1 to 65535"),
        ("10.0.0.2:http", "1 to 65535"),
        ("[::1]:50052", "IPv6"),
        ("a:1,a:1", "twice"),
        (",".join(f"h{i}:1" for i in range(17)), "at most 16"),
    ]:
        with pytest.raises(UsageError) as e:
            rpc.parse_endpoints(bad)
        assert needle in str(e.value) and e.value.field == "rpc"


def test_costs_are_keyed_by_placement(tiny):
    t, d = model_info(tiny["target"]), model_info(tiny["draft-copy"])
    cfg = PairConfig(512, threads=2)
    inv = [Dev("RPC0", "rpc", GiB, GiB, "127.0.0.1:5000"), Dev("CPU", "cpu", GiB, GiB)]
    local = cost_key(t, d, cfg, plan(cfg, inv[1:], t, d), inv[1:])
    remote = cost_key(t, d, cfg, plan(cfg, inv, t, d), inv)
    other = cost_key(
        t,
        d,
        cfg,
        plan(cfg, [Dev("RPC0", "rpc", GiB, GiB, "127.0.0.1:5001"), inv[1]], t, d),
        [Dev("RPC0", "rpc", GiB, GiB, "127.0.0.1:5001"), inv[1]],
    )
    assert local == cost_key(t, d, cfg)  # a pair wholly on the CPU keeps the key it always had
    assert len({local, remote, other}) == 3 and "127.0.0.1:5000" in remote


# --- the handshake, against servers that are not the right worker --------------------------------


class FakePeer:
    """A loopback TCP server that answers ggml's HELLO in a scripted way (another protocol
    version, an older wire format, or silence), to test specrun's side of the handshake."""

    def __init__(self, reply):
        self.reply = reply
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            data = c.recv(1 + 8)
            size = struct.unpack("<Q", data[1:9])[0] if len(data) == 9 else 0
            if size:
                c.recv(size)
            out = self.reply(size)
            if out is None:
                self.held.append(c)  # say nothing, keep it open
                continue
            c.sendall(out)
            c.close()

    def close(self):
        self.sock.close()
        for c in self.held:
            c.close()


def hello_reply(major: int, minor: int, patch: int) -> bytes:
    return struct.pack("<Q", 28) + bytes([major, minor, patch, 0]) + bytes(24)


def test_handshake_names_both_versions():
    peer = FakePeer(lambda size: hello_reply(8, 1, 0))
    try:
        with pytest.raises(WorkerMismatch) as e:
            rpc.handshake(peer.endpoint)
        assert "8.1.0" in str(e.value) and "7.0.0" in str(e.value)
    finally:
        peer.close()
    # a protocol 3 server hangs up on the 24-byte request, then answers an empty one with 3 bytes
    old = FakePeer(lambda size: b"" if size else struct.pack("<Q", 3) + bytes([3, 0, 0]))
    try:
        with pytest.raises(WorkerMismatch) as e:
            rpc.handshake(old.endpoint)
        assert "3.0.0" in str(e.value) and "7.0.0" in str(e.value)
    finally:
        old.close()
    assert rpc.compatible((7, 0, 5)) and not rpc.compatible((7, 1, 0)) and not rpc.compatible((6, 0, 0))


def test_mismatched_worker_is_refused_by_the_command(tiny):
    peer = FakePeer(lambda size: hello_reply(6, 0, 0))
    try:
        p = specrun("generate", "-m", str(tiny["target"]), "-p", "hi", "-n", "4", "--rpc", peer.endpoint, timeout=60)
    finally:
        peer.close()
    assert p.returncode == EXIT_FAIL
    line = error_line(p.stderr)
    assert peer.endpoint in line and "6.0.0" in line and "7.0.0" in line


def test_a_silent_or_foreign_server_is_not_a_hang():
    silent = FakePeer(lambda size: None)
    try:
        with pytest.raises(WorkerUnreachable) as e:
            rpc.handshake(silent.endpoint, hello_timeout=1.0)
        # the work it did: one connection per wire format at most, each hung up by specrun
        # (it gave up on the silence instead of waiting on it)
        assert 1 <= len(silent.held) <= 2
        for c in silent.held:
            c.settimeout(30)
            assert c.recv(1) == b""
    finally:
        silent.close()
    assert "one client at a time" in str(e.value)
    http = FakePeer(lambda size: b"HTTP/1.1 400 Bad Request\r\n\r\n")
    try:
        with pytest.raises(WorkerUnreachable) as e:
            rpc.handshake(http.endpoint)
        assert "not as a llama.cpp RPC worker" in str(e.value)
    finally:
        http.close()


# --- real workers on loopback --------------------------------------------------------------------


def test_unreachable_worker_is_exit_3_at_the_refusal(tiny):
    port = free_port()  # nothing listens there
    for argv in (
        ["generate", "-m", str(tiny["target"]), "-p", "hi", "-n", "4"],
        ["check-pair", "-m", str(tiny["target"]), "-d", str(tiny["draft-copy"])],
        ["devices"],
    ):
        p = specrun(*argv, "--rpc", f"127.0.0.1:{port}", timeout=30)
        assert p.returncode == EXIT_INPUT, p.stderr
        line = error_line(p.stderr)
        assert f"127.0.0.1:{port}" in line and "specrun worker" in line
        # the first refusal ends it: no retry, no connect timeout waited out, nothing loaded
        assert "refused the connection" in line and "did not answer within" not in p.stderr, p.stderr


def test_specrun_rpc_environment_variable(worker):
    p = specrun("devices", "--json", env={**os.environ, "SPECRUN_RPC": worker.endpoint})
    assert p.returncode == 0, p.stderr
    devs = {d["name"]: d for d in json.loads(p.stdout)["devices"]}
    assert devs["RPC0"]["description"] == worker.endpoint and devs["RPC0"]["backend"] == "RPC"


def test_greedy_output_through_a_worker_equals_local_tiny(tiny, worker):
    args = ["-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "-p", PROMPT, "-n", "64", "-c", "512"]
    local = generate_json(*args)
    remote = generate_json(*args, "--rpc", worker.endpoint)
    assert remote["tokens"] == local["tokens"] and len(local["tokens"]) == 64
    # and with the draft placed on the worker too, on purpose: the same tokens, and a warning
    p = specrun("generate", *args, "--rpc", worker.endpoint, "-devd", "RPC0", "--temp", "0", "-t", "2", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["tokens"] == local["tokens"]
    assert "round trip" in p.stderr and "placement: target on RPC0; draft on RPC0" in p.stderr


def test_check_pair_shows_the_workers_memory(tiny, worker):
    p = specrun("check-pair", "-m", str(tiny["target"]), "-d", str(tiny["draft-copy"]), "--rpc", worker.endpoint, "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    devs = {d["name"]: d for d in r["memory"]["devices"]}
    w = devs["RPC0"]
    # the worker serves this machine's CPU, whose memory llama.cpp reports as the RAM's total
    assert w["kind"] == "rpc" and w["description"] == worker.endpoint and w["total"] == psutil.virtual_memory().total
    assert w["target"] > 0 and w["draft"] == 0 and devs["CPU"]["draft"] > 0
    assert r["placement"]["target"]["devices"] == ["RPC0"] and r["placement"]["draft"]["devices"] == []
    p = specrun("check-pair", "-m", str(tiny["target"]), "-d", str(tiny["draft-copy"]), "--rpc", worker.endpoint)
    assert re.search(
        rf"RPC0[│ ]+RPC[│ ]+{re.escape(worker.endpoint)}[│ ]+23|RPC0[│ ]+RPC[│ ]+{re.escape(worker.endpoint)}[│ ]+\d", p.stdout
    ), p.stdout


def test_doctor_reports_rpc_and_each_worker(worker):
    dead = f"127.0.0.1:{free_port()}"
    p = specrun("doctor", "--rpc", f"{worker.endpoint},{dead}", "--json")
    r = json.loads(p.stdout)
    assert r["facts"]["rpc"].startswith("yes, protocol 7.0.0")
    assert "answers, protocol 7.0.0" in r["facts"][f"worker {worker.endpoint}"] and "GiB free" in r["facts"][f"worker {worker.endpoint}"]
    assert any(dead in x and "refused" in x for x in r["problems"])


def test_a_worker_killed_mid_generation_ends_the_command_cleanly(tiny):
    w = Worker()
    proc = subprocess.Popen(
        [
            str(SPECRUN),
            "generate",
            "-m",
            str(tiny["target"]),
            "--draft",
            "none",
            "-p",
            PROMPT,
            "-n",
            "4000",
            "-c",
            "4096",
            "-t",
            "2",
            "--rpc",
            w.endpoint,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.read(40)  # generation has started
        assert first, proc.stderr.read()
        w.proc.kill()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        w.stop()
    # it stopped at the loss: far short of the 4000 tokens (each at least one byte) it asked for
    assert len((first + out).encode()) < 4000, len(first + out)
    assert proc.returncode == EXIT_INPUT, err
    line = error_line(err)
    assert w.endpoint in line and "lost the RPC worker" in line


def test_a_worker_lost_under_serve_ends_the_server_with_exit_3(tiny, tmp_path):
    """A server whose layers live on a worker cannot go on without it: the next request that
    needs the worker ends the process with exit 3 and a line naming the worker (a supervisor
    restarts it), instead of failing every request from then on."""
    w = Worker()
    s = Server(["-m", str(tiny["target"]), "--draft", "none", "-t", "2", "-c", "1024", "--quiet", "--rpc", w.endpoint], tmp_path)
    try:
        status, _, body = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
        assert status == 200 and body["usage"]["completion_tokens"] == 8, (body, s.stderr)
        w.proc.kill()
        w.proc.wait(10)
        try:
            status, _, body = s.post("/v1/completions", {"prompt": "Another prompt", "max_tokens": 8}, timeout=30)
            answered = status
        except (OSError, http.client.HTTPException):
            answered = None  # the process ended under the request
        rc = s.wait(30)
    finally:
        s.kill()
        w.stop()
    assert answered != 200, s.stderr
    assert rc == EXIT_INPUT, s.stderr
    assert "Traceback" not in s.stderr
    line = error_line(s.stderr)
    assert w.endpoint in line and "lost the RPC worker" in line


def test_worker_refuses_unsafe_or_impossible_settings(worker):
    for args, code, needle in [
        (["--host", "0.0.0.0"], EXIT_USAGE, "--i-know-rpc-is-unauthenticated"),
        (["--host", "localhost"], EXIT_USAGE, "IPv4"),
        (["--device", "CUDA3"], EXIT_USAGE, "CUDA3"),
        (["--port", str(worker.port)], EXIT_FAIL, "is another worker running"),
    ]:
        p = specrun("worker", *args, timeout=30)
        assert p.returncode == code, (args, p.stderr)
        assert needle in error_line(p.stderr)


def test_worker_warns_and_stops_on_sigterm():
    w = Worker("--cache", str(Path(os.environ["SPECRUN_CACHE_DIR"]) / "rpc"))
    w.proc.send_signal(signal.SIGTERM)
    out, err = w.proc.communicate(timeout=10)
    assert w.proc.returncode == 143
    assert "no authentication and no encryption" in err and "serving CPU" in err
    assert "Starting RPC server v7.0.0" in out and "local cache" in out and "/rpc" in out


def test_bench_through_a_worker_reports_the_network_share(tiny, worker, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"class": "chat", "prompt": PROMPT}) + "\n")
    p = specrun(
        "bench", "-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "--rpc", worker.endpoint, "--prompts", str(prompts),
        "--runs", "1", "-n", "16", "-c", "512", "-t", "2", "--draft", "model", "--json",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    net = json.loads(p.stdout)["meta"]["network"]
    assert net["workers"] == [worker.endpoint] and net["rtt_ms"] is not None
    rows = {r["batch"]: r for r in net["verify"]}
    assert set(rows) >= {1, 2, 4, 8}
    for r in rows.values():
        assert r["local_ms"] is not None and 0 <= r["network_share"] < 1
        assert r["bytes_sent"] > 0 and r["bytes_received"] > 0
    # a verify returns one row of logits per token: more tokens, more bytes back
    assert rows[8]["bytes_received"] > rows[1]["bytes_received"] + 6 * 640 * 4
    md = specrun(
        "bench", "-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "--rpc", worker.endpoint, "--prompts", str(prompts),
        "--runs", "1", "-n", "16", "-c", "512", "-t", "2", "--draft", "model", "--markdown",
    )  # fmt: skip
    assert "Network share of a verify" in md.stdout and "| verify batch |" in md.stdout


# --- the demo pair --------------------------------------------------------------------------------


@pytest.mark.demo
def test_greedy_output_through_a_worker_equals_local_demo(demo, demo_store, worker):
    args = ["-m", str(demo["target"]), "-d", str(demo["draft"]), "--chat", "-p", "Write a Python function that reverses a linked list.",
            "-n", "64", "-c", "1024", "--draft", "model", "--fixed", "--draft-max", "4"]  # fmt: skip
    local = generate_json(*args)
    remote = generate_json(*args, "--rpc", worker.endpoint)
    assert len(local["tokens"]) == 64
    assert remote["tokens"] == local["tokens"]


@pytest.mark.demo
def test_split_over_two_workers_matches_llama_cpps_own_buffers(demo, worker):
    """Two workers, -ts 3,1: llama.cpp's own per-device weight and KV buffers (its log) against
    check-pair's per-device estimate for the same flags."""
    second = Worker()
    try:
        eps = f"{worker.endpoint},{second.endpoint}"
        flags = ["-m", str(demo["draft"]), "--rpc", eps, "-ts", "3,1", "-c", "1024"]
        cp = specrun("check-pair", *flags, "-d", str(demo["draft"]), "--json")
        assert cp.returncode == 0, cp.stderr
        est = {d["name"]: d for d in json.loads(cp.stdout)["memory"]["devices"]}
        g = specrun("generate", *flags, "--draft", "none", "-p", "hi", "-n", "1", "-t", "2", "--verbose")
        assert g.returncode == 0, g.stderr[-3000:]
    finally:
        second.stop()
    mib = 2**20
    log = g.stderr
    got = {}
    for dev, ep in (("RPC0", worker.endpoint), ("RPC1", second.endpoint)):
        weights = float(re.search(rf"RPC0\[{re.escape(ep)}\] model buffer size = +([\d.]+) MiB", log).group(1)) * mib
        kv = float(re.search(rf"RPC0\[{re.escape(ep)}\] KV buffer size = +([\d.]+) MiB", log).group(1)) * mib
        compute = float(re.search(rf"RPC0\[{re.escape(ep)}\] compute buffer size = +([\d.]+) MiB", log).group(1)) * mib
        got[dev] = (weights + kv, compute)
    layers = {d: len(re.findall(rf"layer +\d+ assigned to device {d}\b", log)) for d in ("RPC0", "RPC1")}
    assert layers["RPC0"] > 2 * layers["RPC1"] > 0  # 3:1
    # the same layers on each device, so the same weights and KV cache there
    m = model_info(demo["draft"])
    where = layer_devices(m.n_layer, -1, ("RPC0", "RPC1"), (3.0, 1.0))
    assert {d: where.count(d) for d in ("RPC0", "RPC1")} == layers
    lw, kv = m.layer_weights(), m.kv_bytes_per_layer(1024)
    for dev, (wkv, compute) in got.items():
        ours = sum(lw.blocks[i] + kv[i] for i in range(m.n_layer) if where[i] == dev)
        if where[-1] == dev:
            ours += lw.output + lw.tied_head
        assert abs(ours - wkv) < 0.01 * wkv + mib, (dev, ours, wkv)
        assert est[dev]["target"] >= wkv + compute, dev  # and the compute allowance covers llama.cpp's buffer
