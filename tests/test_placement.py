"""Placement (specrun/fit/placement.py): the settings checked on their own and from the command line,
and the placement and fit of big pairs over made-up GPUs and RPC workers (NVML's answer is the
one fake: ``memory.query_gpus``; the headers are hand-built, see big_models.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from big_models import GiB, big_models, gpus

from specrun.errors import EXIT_USAGE, UsageError
from specrun.fit.memory import HEADROOM_FRACTION, Dev, estimate
from specrun.fit.placement import PlacementSettings, fit, parse_device_list, parse_tensor_split, plan
from specrun.run.config import PairConfig
from specrun.run.pair import check_pair

SPECRUN = Path(sys.executable).parent / "specrun"


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")


@pytest.fixture(scope="module")
def big():
    return big_models()


def error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("specrun: error:")]
    assert len(lines) == 1, err
    return lines[0]


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


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SPECRUN), *args], capture_output=True, text=True, timeout=300)


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
        p = run(*base, *extra)
        assert p.returncode == EXIT_USAGE, (extra, p.stderr)
        assert flag in error_line(p.stderr), (extra, p.stderr)
    p = run(*base, "-dev", "CUDA7")
    assert "this machine has no GPU or RPC device" in p.stderr and "specrun devices" in p.stderr


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
