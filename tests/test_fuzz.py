"""Fuzzing the GGUF reader through `inspect` and `check-pair`: mutated tiny models (bit flips,
truncations, huge counts and lengths, wrong types). Pass: no crash, no traceback, no case over
2 s, no allocation over 200 MB, and every refusal is exit 3 with one line."""

from __future__ import annotations

import io
import struct
import time
import tracemalloc
from contextlib import redirect_stderr, redirect_stdout

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrun.cli.main import main

N_CASES = 2500


def _mutate(data: bytes, kind: str, pos: int, value: int) -> bytes:
    b = bytearray(data)
    n = len(b)
    if kind == "flip":
        b[pos % n] ^= 1 << (value % 8)
    elif kind == "truncate":
        return bytes(b[: pos % n])
    elif kind == "huge64":  # an absurd count or length at a header position
        p = pos % max(1, min(n - 8, 4096))
        b[p : p + 8] = struct.pack("<Q", (1 << 63) - 1 - (value % 1000))
    elif kind == "type32":  # a wrong value or tensor type
        p = pos % max(1, min(n - 4, 4096))
        b[p : p + 4] = struct.pack("<I", value % 40)
    elif kind == "bytes":
        p = pos % n
        b[p : p + 4] = value.to_bytes(4, "little")
    return bytes(b)


def run_cli(args):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=N_CASES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
@given(
    kind=st.sampled_from(["flip", "truncate", "huge64", "type32", "bytes"]),
    pos=st.integers(0, 1 << 20),
    value=st.integers(0, 1 << 31),
    command=st.sampled_from(["inspect", "check-pair"]),
)
def test_fuzz_inspect_and_check_pair(tiny_fuzz_dir, kind, pos, value, command):
    src, good = tiny_fuzz_dir
    bad = src / "mutant.gguf"
    bad.write_bytes(_mutate(good.read_bytes(), kind, pos, value))
    args = ["inspect", str(bad), "--json"] if command == "inspect" else ["check-pair", "-m", str(good), "-d", str(bad), "--json"]
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        code, out, err = run_cli(args)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.monotonic() - t0
    assert elapsed < 2.0, f"{kind}@{pos}: took {elapsed:.2f} s"
    assert peak < 200 * 2**20, f"{kind}@{pos}: allocated {peak / 2**20:.0f} MB"
    assert "Traceback" not in err and "internal error" not in err, err
    assert code in (0, 1, 3), (code, err)
    if code == 3:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("specrun: error: "), err


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def tiny_fuzz_dir(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    # warm up: the first call imports the command modules, which is not a hang
    for args in (
        ["inspect", str(tiny["target"]), "--json"],
        ["check-pair", "-m", str(tiny["target"]), "-d", str(tiny["target"]), "--json"],
    ):
        run_cli(args)
    return d, tiny["target"]
