"""`specrun doctor` (specrun/cli/diagnose.py) on this machine: the facts it reports against what the
system says, its exit code against its problems, and what it says of a GPU the build cannot
use and of a worker that does not answer. NVML's answer is the one fake (this machine has no
NVIDIA driver); everything else is the real llama.cpp build, the real psutil, real sockets."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest

from specrun import llama
from specrun.cli.diagnose import CUDA_FIX, diagnose
from specrun.fit.memory import Gpu, GpuQuery

SPECRUN = Path(sys.executable).parent / "specrun"
GiB = 1 << 30


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SPECRUN), "doctor", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def as_json() -> subprocess.CompletedProcess:
    return doctor("--json")


def test_the_facts_are_this_machines_and_the_exit_code_follows_the_problems(as_json):
    p = as_json
    r = json.loads(p.stdout)
    assert "Traceback" not in p.stderr
    assert p.returncode == (1 if r["problems"] else 0) and r["ok"] is (not r["problems"])
    facts = r["facts"]
    assert facts["python"] == platform.python_version()
    assert facts["cpu cores"] == str(os.cpu_count())
    assert facts["platform"].startswith(f"{platform.system()} {platform.release()} {platform.machine()}")
    assert facts["llama_cpp"].startswith(version("llama-cpp-python") + ", GPU offload: ")
    assert facts["system RAM"].endswith(f"of {psutil.virtual_memory().total / GiB:.1f} GiB")
    if shutil.which("nvidia-smi") is None:  # no driver here: NVML finds nothing and says why
        assert facts["nvidia"].startswith("none (")


def test_the_text_report_has_a_line_per_fact_and_per_problem(as_json):
    r = json.loads(as_json.stdout)
    p = doctor()
    assert p.returncode == (1 if r["problems"] else 0)
    lines = p.stdout.splitlines()
    for key in r["facts"]:
        assert any(line.startswith(key) for line in lines), key
    problems = [line for line in lines if line.startswith("problem: ")]
    assert len(problems) == len(r["problems"])
    assert ("no problems found" in p.stdout) is (not r["problems"])


def test_a_gpu_the_build_cannot_use_is_a_problem_with_its_fix():
    gq = GpuQuery([Gpu(0, "RTX 4090", 24 * GiB, int(23.5 * GiB))], driver="555.0")
    r = diagnose(gpu_query=gq)
    facts = dict(r.facts)
    assert facts["nvidia driver"] == "555.0" and facts["gpu 0"] == "RTX 4090: 23.5 GiB free of 24.0 GiB"
    cuda = [x for x in r.problems if "built without CUDA" in x]
    if llama.supports_gpu_offload():
        assert cuda == []
    else:
        assert len(cuda) == 1 and CUDA_FIX in cuda[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_that_refuses_is_a_problem_naming_it_and_how_to_start_one():
    if not llama.supports_rpc():
        pytest.skip("this llama_cpp has no RPC backend")
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    r = diagnose(gpu_query=GpuQuery([], problem="no driver"), rpc_endpoints=(dead,))
    assert dict(r.facts)[f"worker {dead}"] == "not usable"
    (problem,) = [x for x in r.problems if dead in x]
    assert "refused" in problem and "specrun worker" in problem
    assert r.to_json()["ok"] is False
