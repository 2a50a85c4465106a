"""The network share of a verify (specrun/bench/network.py): the arithmetic of a row, and the verify
curve on the real llama.cpp with the tiny target (no worker: the traffic is then None). The
split through a real `specrun worker` on 127.0.0.1 is measured end to end in
test_rpc.py::test_bench_through_a_worker_reports_the_network_share (a worker's devices stay
registered for the life of a process, so only a subprocess may use one)."""

from __future__ import annotations

import pytest

from specrun.bench import network
from specrun.bench.network import NetworkReport, VerifyCost
from specrun.fit.memory import Dev
from specrun.llama import LoadOptions, Model

GiB = 1 << 30


@pytest.fixture(scope="module")
def target(tiny):
    with Model(tiny["target"], LoadOptions(n_ctx=64, n_threads=1)) as m:
        yield m


def test_the_network_share_is_what_the_split_adds_over_the_local_run():
    assert VerifyCost(4, split_s=0.004, local_s=0.003, sent=10, received=20).network_share == pytest.approx(0.25)
    assert VerifyCost(4, 0.002, 0.003, None, None).network_share == 0.0  # a faster split adds nothing
    assert VerifyCost(4, 0.002, None, None, None).network_share is None  # no local run to compare with
    assert VerifyCost(4, 0.0, 0.001, None, None).network_share is None


def test_a_row_and_a_report_as_json_in_milliseconds():
    row = VerifyCost(8, 0.0123456, None, 1000, 2000)
    assert row.to_json() == {
        "batch": 8,
        "split_ms": 12.346,
        "local_ms": None,
        "network_share": None,
        "bytes_sent": 1000,
        "bytes_received": 2000,
    }
    r = NetworkReport(("127.0.0.1:5000",), [row], rtt_s=0.0004, note="n")
    assert r.to_json() == {"workers": ["127.0.0.1:5000"], "rtt_ms": 0.4, "verify": [row.to_json()], "note": "n"}
    assert NetworkReport(()).to_json()["rtt_ms"] is None


def test_the_local_run_leaves_the_workers_out():
    inv = [Dev("RPC0", "rpc", GiB, GiB, "10.0.0.2:50052"), Dev("CUDA0", "gpu", GiB, GiB), Dev("CPU", "cpu", GiB, GiB)]
    assert [d.name for d in network.local_devices_only(inv)] == ["CUDA0", "CPU"]


def test_a_verify_is_timed_and_the_cache_left_as_it_was(target):
    prompt = target.tokenize("def fibonacci(n):\n    ", add_special=True, parse_special=True)
    target.reset()
    target.eval(prompt, logits="none")
    before = target.n_past
    seconds, moved = network._verify_time(target, prompt[-1], 4, ())
    assert seconds > 0 and moved is None  # no workers: no traffic to read
    assert target.n_past == before
    target.reset()


def test_the_curve_skips_the_batches_the_context_cannot_hold_and_ends_empty(target):
    prompt = target.tokenize("def fibonacci(n):\n    ", add_special=True, parse_special=True)
    room = target.n_ctx - len(prompt)
    curve = network._curve(target, prompt, network.SIZES + (room + 1,), ())
    assert set(curve) == {b for b in network.SIZES if b <= room}
    assert all(t > 0 and moved is None for t, moved in curve.values())
    assert target.n_past == 0
