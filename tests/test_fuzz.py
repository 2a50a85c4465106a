"""Fuzzing the GGUF reader through `inspect` and `check-pair`: mutated tiny models (bit flips,
truncations, huge counts and lengths, wrong types). Pass: no crash, no traceback, every refusal
is exit 3 with one line, the reader's work bounded by the file (at most one read per byte of
the mutant: a count or length the bytes cannot hold is refused before any loop over it), and
no allocation over 200 MB. Allocation is traced (tracemalloc, which slows every allocation
several times) on every case of the kind that writes absurd counts and lengths, and on a fixed
one in TRACE_EVERY of the others."""

from __future__ import annotations

import io
import struct
import tracemalloc
import zlib
from contextlib import redirect_stderr, redirect_stdout

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrun.cli.main import main
from specrun.gguf import header as gguf_header

N_CASES = 2500
TRACE_EVERY = 10


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
def test_fuzz_inspect_and_check_pair(tiny_fuzz_dir, reads, kind, pos, value, command):
    src, good = tiny_fuzz_dir
    bad = src / "mutant.gguf"
    mutant = _mutate(good.read_bytes(), kind, pos, value)
    bad.write_bytes(mutant)
    args = ["inspect", str(bad), "--json"] if command == "inspect" else ["check-pair", "-m", str(good), "-d", str(bad), "--json"]
    traced = kind == "huge64" or zlib.crc32(f"{kind} {pos} {value} {command}".encode()) % TRACE_EVERY == 0
    reads.update(need=0, strings=0, parsed=0)
    if traced:
        tracemalloc.start()
    try:
        code, out, err = run_cli(args)
        peak = tracemalloc.get_traced_memory()[1] if traced else 0
    finally:
        if traced:
            tracemalloc.stop()
    assert reads["need"] + reads["strings"] <= reads["parsed"], f"{kind}@{pos}: more reads than bytes: {reads}"
    assert peak < 200 * 2**20, f"{kind}@{pos}: allocated {peak / 2**20:.0f} MB"
    assert "Traceback" not in err and "internal error" not in err, err
    assert code in (0, 1, 3), (code, err)
    if code == 3:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("specrun: error: "), err


@pytest.fixture(scope="module")
def reads():
    """Every read the GGUF reader makes, counted: each fixed-size read and string checks its
    bytes with `need`, and an array of strings walks one length per element; and the bytes of
    the files it parsed."""
    counts = {"need": 0, "strings": 0, "parsed": 0}
    need, strings, parse = gguf_header._Reader.need, gguf_header._Reader._strings, gguf_header._parse

    def counted_parse(p, mm, size):
        counts["parsed"] += size
        return parse(p, mm, size)

    def counted_need(self, n, what):
        counts["need"] += 1
        return need(self, n, what)

    def counted_strings(self, count, what):
        counts["strings"] += count
        return strings(self, count, what)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_header._Reader, "need", counted_need)
        mp.setattr(gguf_header._Reader, "_strings", counted_strings)
        mp.setattr(gguf_header, "_parse", counted_parse)
        yield counts


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
