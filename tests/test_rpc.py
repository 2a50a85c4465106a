"""Past one GPU and one machine: placement settings, the per-device fit, and llama.cpp RPC workers.

Three tiers:

* pure: parsing and checking the placement settings, and the placement and fit on hand-built
  Llama-shaped headers against NVML's answer (the one fake: ``memory.query_gpus``);
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
import time
from pathlib import Path

import psutil
import pytest
from serve_helpers import Server

from specrun import rpc
from specrun.errors import EXIT_FAIL, EXIT_INPUT, EXIT_USAGE, UsageError, WorkerMismatch, WorkerUnreachable
from specrun.gguf_header import GGUFHeader, TensorInfo
from specrun.memory import HEADROOM_FRACTION, Dev, Gpu, GpuQuery, estimate, layer_devices
from specrun.modelinfo import model_info
from specrun.pair import check_pair
from specrun.placement import PlacementSettings, fit, parse_device_list, parse_tensor_split, plan
from specrun.session import PairConfig, cost_key

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


def test_placement_settings_are_checked_without_devices():
    assert parse_device_list("CUDA0, RPC0") == ("CUDA0", "RPC0")
    assert parse_device_list("none") == ()
    assert parse_tensor_split("3/1") == (3.0, 1.0)
    cases = [
        (lambda: parse_tensor_split("1,-2"), "tensor_split", ">= 0"),
        (lambda: parse_tensor_split("0,0"), "tensor_split", "all zeros"),
        (lambda: parse_tensor_split("1,x"), "tensor_split", "numbers"),
        (lambda: parse_device_list("CUDA0,none"), "devices", "'none'"),
        (lambda: parse_device_list("CUDA0,,CUDA1"), "devices", "commas"),
        (lambda: parse_device_list("CUDA0,cuda0"), "devices", "twice"),
        (lambda: PairConfig(split_mode="rows"), "split_mode", "layer, row, none"),
        (lambda: PairConfig(main_gpu=-1), "main_gpu", ">= 0"),
        (lambda: PairConfig(main_gpu=1), "main_gpu", "not layer"),
        (lambda: PairConfig(split_mode="none", tensor_split=(1.0, 1.0)), "tensor_split", "no effect"),
        (lambda: PairConfig(devices=(), tensor_split=(1.0,)), "tensor_split", "CPU alone"),
        (lambda: PairConfig(rpc=("nohost",)), "rpc", "HOST:PORT"),
    ]
    for make, field, needle in cases:
        with pytest.raises(UsageError) as e:
            make()
        assert e.value.field == field and needle in str(e.value), str(e.value)


def test_placement_flags_from_the_command_line(tiny):
    """Each bad value is one line naming the flag, exit 2, before anything loads."""
    base = ["check-pair", "-m", str(tiny["target"]), "-d", str(tiny["draft-copy"])]
    for extra, flag in [
        (["-dev", "CUDA7"], "--device"),
        (["-devd", "RPC3"], "--device-draft"),
        (["-ts", "1,-1"], "--tensor-split"),
        (["-ts", "1,1"], "--tensor-split"),  # two values for the CPU alone: this machine has no device
        (["-sm", "diagonal"], "--split-mode"),
        (["-mg", "-1"], "--main-gpu"),
        (["--rpc", "localhost"], "--rpc"),
    ]:
        p = specrun(*base, *extra)
        assert p.returncode == EXIT_USAGE, (extra, p.stderr)
        assert flag in error_line(p.stderr), (extra, p.stderr)
    p = specrun(*base, "-dev", "CUDA7")
    assert "this machine has no GPU or RPC device" in p.stderr and "specrun devices" in p.stderr


# --- layers and memory per device, on hand-built headers -----------------------------------------

Q4_K, Q6_K, F32 = 12, 14, 0
BLOCK = {Q4_K: (256, 144), Q6_K: (256, 210), F32: (1, 4)}


def llama_like(name: str, n_layer: int, n_embd: int, n_ff: int, n_head: int, n_kv: int, tokens: list[str]) -> GGUFHeader:
    """A Llama-3-shaped GGUF header (Q4_K_M-like types), with no file behind it."""
    hd = n_embd // n_head
    tensors: list[TensorInfo] = []

    def add(tname: str, shape: tuple[int, ...], t: int) -> None:
        per, size = BLOCK[t]
        n = 1
        for d in shape:
            n *= d
        tensors.append(TensorInfo(tname, shape, t, 0, n // per * size))

    add("token_embd.weight", (n_embd, len(tokens)), Q4_K)
    for i in range(n_layer):
        add(f"blk.{i}.attn_norm.weight", (n_embd,), F32)
        add(f"blk.{i}.attn_q.weight", (n_embd, n_embd), Q4_K)
        add(f"blk.{i}.attn_k.weight", (n_embd, n_kv * hd), Q4_K)
        add(f"blk.{i}.attn_v.weight", (n_embd, n_kv * hd), Q6_K)
        add(f"blk.{i}.attn_output.weight", (n_embd, n_embd), Q4_K)
        add(f"blk.{i}.ffn_norm.weight", (n_embd,), F32)
        add(f"blk.{i}.ffn_gate.weight", (n_embd, n_ff), Q4_K)
        add(f"blk.{i}.ffn_up.weight", (n_embd, n_ff), Q4_K)
        add(f"blk.{i}.ffn_down.weight", (n_ff, n_embd), Q6_K)
    add("output_norm.weight", (n_embd,), F32)
    add("output.weight", (n_embd, len(tokens)), Q6_K)
    meta = {
        "general.architecture": "llama",
        "general.name": name,
        "general.file_type": 15,  # Q4_K_M
        "llama.block_count": n_layer,
        "llama.embedding_length": n_embd,
        "llama.feed_forward_length": n_ff,
        "llama.attention.head_count": n_head,
        "llama.attention.head_count_kv": n_kv,
        "llama.context_length": 131072,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    size = sum(t.nbytes for t in tensors)
    return GGUFHeader(Path(f"{name}.gguf"), 3, size, 32, 0, meta, tensors)


@pytest.fixture(scope="module")
def big():
    tokens = [f"t{i}" for i in range(128256)]
    return {
        "70b": model_info(llama_like("llama-70b", 80, 8192, 28672, 64, 8, tokens)),
        "8b": model_info(llama_like("llama-8b", 32, 4096, 14336, 32, 8, tokens)),
        "1b": model_info(llama_like("llama-1b", 16, 2048, 8192, 32, 8, tokens)),
    }


def gpus(*free_total: tuple[float, float]) -> GpuQuery:
    return GpuQuery([Gpu(i, "RTX 4090", int(t * GiB), int(f * GiB)) for i, (f, t) in enumerate(free_total)], driver="555.0")


def test_the_synthetic_models_are_the_sizes_of_the_real_ones(big):
    assert 40e9 < big["70b"].weights_bytes < 45e9  # Llama-3.1-70B Q4_K_M is about 42.5 GB
    assert 4.3e9 < big["8b"].weights_bytes < 5.3e9  # 8B Q4_K_M: about 4.9 GB


def test_layers_are_cut_as_llama_cpp_cuts_them():
    # every layer offloaded, 3:1 over two devices: the first three quarters to the first
    assert layer_devices(3, -1, ("A", "B"), (3.0, 1.0)) == ["A", "A", "A", "B"]
    # the last gpu_layers are offloaded; the rest (from layer 0) stay on the CPU
    assert layer_devices(5, 2, ("A",), (1.0,)) == ["CPU", "CPU", "CPU", "CPU", "A", "A"]
    assert layer_devices(4, -1, (), ()) == ["CPU"] * 5
    # a device given 0 gets nothing
    assert "B" not in layer_devices(9, -1, ("A", "B", "C"), (1.0, 0.0, 1.0))


def test_per_device_estimate_adds_up(big):
    m = big["70b"]
    one = estimate(m, "target", 4096, -1)  # all on the CPU
    two = estimate(m, "target", 4096, -1, ("CUDA0", "CUDA1"), (0.5, 0.5))
    assert one.weights == m.weights_bytes and one.on_devices == 0
    # the same weights and KV, moved; each device gets its own compute buffer and runtime
    assert two.weights == one.weights and two.kv_cache == one.kv_cache
    assert abs(two.by_device["CUDA0"] - two.by_device["CUDA1"]) < 0.06 * two.by_device["CUDA0"]
    assert two.on_host < 0.03 * two.total  # the token embeddings and the runtime
    tied = model_info(llama_like("tied", 2, 256, 512, 4, 2, [f"t{i}" for i in range(1000)]))
    tied.header.tensors[:] = [t for t in tied.header.tensors if t.name != "output.weight"]
    on_gpu = estimate(tied, "target", 512, -1, ("CUDA0",), (1.0,))
    embd = next(t.nbytes for t in tied.header.tensors if t.name == "token_embd.weight")
    assert on_gpu.weights == tied.weights_bytes + embd  # tied embeddings are copied to the output layer's device


def shares(report) -> dict[str, tuple[int, int, int]]:
    return {s.device.name: (s.target, s.draft, s.device.free) for s in report.fit.shares}


def test_two_24gb_gpus_cannot_hold_a_70b_and_an_8b_whole_and_it_says_what_would(big):
    """NVML says: two 24 GB GPUs, nearly all free. 42 GB + 5 GB + caches is more than they hold."""
    gq = gpus((23.5, 24), (23.5, 24))
    r = check_pair(big["70b"], big["8b"], gpu_query=gq, available_ram=128 * GiB)
    assert r.compat.compatible and not r.fit.fits
    # the draft is wholly on one GPU, the target over both
    assert len(r.placement.draft.devices) == 1 and r.placement.target.devices == ("CUDA0", "CUDA1")
    (p,) = r.fit.proposals
    ngl = int(p.settings["gpu_layers"])
    assert 0 < ngl < 81 and p.settings["gpu_layers_draft"] == "-1"
    # the proposal fits when planned again, and one more layer would not: it is the largest
    inv = [Dev(f"CUDA{i}", "gpu", g.free, g.total, g.name) for i, g in enumerate(gq.gpus)] + [Dev("CPU", "cpu", 128 * GiB, 128 * GiB)]
    for n, fits in ((ngl, True), (ngl + 1, False)):
        s = PlacementSettings(gpu_layers=n, gpu_layers_draft=-1)
        assert fit(plan(s, inv, big["70b"], big["8b"]), inv, big["70b"], big["8b"], 4096).fits is fits
    # ...and keeps the draft whole on one GPU
    again = check_pair(big["70b"], big["8b"], PlacementSettings(gpu_layers=ngl, gpu_layers_draft=-1), gpu_query=gq, available_ram=128 * GiB)
    assert again.fit.fits and len(again.placement.draft.devices) == 1
    on = shares(again)
    d = again.placement.draft.devices[0]
    assert on[d][1] >= estimate(big["8b"], "draft", 4096, -1).total - estimate(big["8b"], "draft", 4096, -1).on_host - 2 * 64 * 2**20


def test_with_room_the_target_leaves_the_draft_its_own_gpu(big):
    """Three 48 GB GPUs and a 42 GB target: the target fits on two, the draft gets the third."""
    r = check_pair(big["70b"], big["8b"], gpu_query=gpus((40, 48), (47, 48), (44, 48)), available_ram=128 * GiB)
    assert r.fit.fits
    (d,) = r.placement.draft.devices
    assert d == "CUDA1"  # the most free
    assert d not in r.placement.target.devices and len(r.placement.target.devices) == 2
    assert shares(r)[d][0] == 0


def test_three_gpus_with_the_users_tensor_split(big):
    gq = gpus((23, 24), (23, 24), (23, 24))
    s = PlacementSettings(tensor_split=(3.0, 2.0, 2.0))
    r = check_pair(big["70b"], big["8b"], s, gpu_query=gq, available_ram=128 * GiB)
    assert r.placement.target.devices == ("CUDA0", "CUDA1", "CUDA2")
    assert r.placement.target.split == pytest.approx((3 / 7, 2 / 7, 2 / 7))
    on = shares(r)
    t0, t1, t2 = (on[f"CUDA{i}"][0] for i in range(3))
    assert 1.3 < t0 / t1 < 1.7 and 0.85 < t1 / t2 < 1.15  # the layers follow the split
    # the draft goes where the most is left after the target's share, and the split is kept
    left = {n: free - t for n, (t, _, free) in on.items() if n.startswith("CUDA")}
    assert r.placement.draft.devices == (max(left, key=left.get),) and r.placement.draft.devices != ("CUDA0",)
    assert r.fit.fits
    # a split of the wrong length names both counts
    with pytest.raises(UsageError) as e:
        check_pair(big["70b"], big["8b"], PlacementSettings(tensor_split=(1.0, 1.0)), gpu_query=gq)
    assert "2 values" in str(e.value) and "3 devices" in str(e.value) and e.value.field == "tensor_split"


def test_a_split_that_overfills_one_gpu_gets_a_balanced_one_proposed(big):
    gq = gpus((23, 24), (23, 24), (23, 24))
    r = check_pair(big["70b"], big["8b"], PlacementSettings(tensor_split=(6.0, 1.0, 1.0)), gpu_query=gq, available_ram=128 * GiB)
    assert not r.fit.fits and "CUDA0" in r.fit.short()
    (p,) = r.fit.proposals
    ts = tuple(float(x) for x in p.settings["tensor_split"].split(","))
    assert len(ts) == 3
    assert check_pair(big["70b"], big["8b"], PlacementSettings(tensor_split=ts), gpu_query=gq, available_ram=128 * GiB).fit.fits


def test_one_gpu_almost_full(big):
    # beside a free GPU: the draft takes the free one, the full one gets (almost) nothing
    r = check_pair(big["8b"], big["1b"], gpu_query=gpus((0.3, 24), (23, 24)), available_ram=64 * GiB)
    assert r.fit.fits and r.placement.draft.devices == ("CUDA1",)
    assert shares(r)["CUDA0"][0] <= 0.3 * GiB * (1 - HEADROOM_FRACTION)
    # alone: nothing fits whole; the proposals fit, and the first is the most on the GPU that fits
    r = check_pair(big["8b"], big["1b"], gpu_query=gpus((2.0, 24)), available_ram=64 * GiB)
    assert not r.fit.fits and r.fit.proposals
    p = r.fit.proposals[0]
    assert p.fit is not None and p.fit.fits
    ngl = int(p.settings["gpu_layers"])
    inv = [Dev("CUDA0", "gpu", 2 * GiB, 24 * GiB), Dev("CPU", "cpu", 64 * GiB, 64 * GiB)]
    assert not fit(
        plan(PlacementSettings(gpu_layers=ngl + 1, gpu_layers_draft=-1), inv, big["8b"], big["1b"]), inv, big["8b"], big["1b"], 4096
    ).fits


def test_nothing_fits_says_so(big):
    r = check_pair(big["70b"], big["8b"], gpu_query=gpus((1, 24)), available_ram=8 * GiB)
    assert not r.fit.fits and r.fit.proposals == []


def test_user_devices_are_checked_against_what_exists(big):
    gq = gpus((20, 24), (20, 24))
    with pytest.raises(UsageError) as e:
        check_pair(big["8b"], big["1b"], PlacementSettings(devices=("CUDA0", "CUDA5")), gpu_query=gq)
    assert "'CUDA5'" in str(e.value) and "CUDA0, CUDA1" in str(e.value) and e.value.field == "devices"
    with pytest.raises(UsageError) as e:
        check_pair(big["8b"], big["1b"], PlacementSettings(devices_draft=("RPC0",)), gpu_query=gq)
    assert "{rpc}" in e.value.message and e.value.field == "devices_draft"
    with pytest.raises(UsageError) as e:
        check_pair(big["8b"], big["1b"], PlacementSettings(split_mode="none", main_gpu=2), gpu_query=gq)
    assert "out of range" in str(e.value) and e.value.field == "main_gpu"
    r = check_pair(big["8b"], big["1b"], PlacementSettings(split_mode="none", main_gpu=1), gpu_query=gq)
    assert r.placement.target.devices == ("CUDA1",)


def test_rpc_devices_join_the_target_and_the_draft_stays_local(big):
    worker = [Dev("RPC0", "rpc", 23 * GiB, 24 * GiB, "10.0.0.2:50052")]
    r = check_pair(big["70b"], big["8b"], gpu_query=gpus((23.5, 24)), remote=worker, available_ram=128 * GiB)
    # llama.cpp's order: the workers first, so the output layer (and the logits) stay here
    assert r.placement.target.devices == ("RPC0", "CUDA0") and r.placement.draft.devices == ("CUDA0",)
    assert shares(r)["RPC0"][1] == 0 and shares(r)["RPC0"][0] > 15 * GiB
    r = check_pair(big["70b"], big["8b"], PlacementSettings(devices_draft=("10.0.0.2:50052",)), gpu_query=gpus((23.5, 24)), remote=worker)
    assert r.placement.draft.devices == ("RPC0",)
    assert any("round trip" in n for n in r.placement.notes)


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
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerUnreachable) as e:
            rpc.handshake(silent.endpoint, hello_timeout=1.0)
    finally:
        silent.close()
    assert time.monotonic() - t0 < 3 and "one client at a time" in str(e.value)
    http = FakePeer(lambda size: b"HTTP/1.1 400 Bad Request\r\n\r\n")
    try:
        with pytest.raises(WorkerUnreachable) as e:
            rpc.handshake(http.endpoint)
        assert "not as a llama.cpp RPC worker" in str(e.value)
    finally:
        http.close()


# --- real workers on loopback --------------------------------------------------------------------


def test_unreachable_worker_is_exit_3_within_5_seconds(tiny):
    port = free_port()  # nothing listens there
    for argv in (
        ["generate", "-m", str(tiny["target"]), "-p", "hi", "-n", "4"],
        ["check-pair", "-m", str(tiny["target"]), "-d", str(tiny["draft-copy"])],
        ["devices"],
    ):
        t0 = time.monotonic()
        p = specrun(*argv, "--rpc", f"127.0.0.1:{port}", timeout=30)
        took = time.monotonic() - t0
        assert p.returncode == EXIT_INPUT, p.stderr
        assert took < 5, f"{argv[0]} took {took:.1f} s"
        line = error_line(p.stderr)
        assert f"127.0.0.1:{port}" in line and "specrun worker" in line


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
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        w.stop()
    assert took < 5, f"it took {took:.1f} s to notice"
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
        assert status == 200 and body["usage"]["completion_tokens"] == 8, body
        w.proc.kill()
        w.proc.wait(10)
        try:
            status, _, body = s.post("/v1/completions", {"prompt": "Another prompt", "max_tokens": 8}, timeout=30)
            answered = status
        except (OSError, http.client.HTTPException):
            answered = None  # the process ended under the request
        rc = s.proc.wait(30)
    finally:
        s.kill()
        w.stop()
    assert answered != 200
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
def test_greedy_output_through_a_worker_equals_local_demo(demo, worker):
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
