"""The bounded GGUF reader: real files parse, hostile headers are refused without allocating."""

from __future__ import annotations

import struct
import tracemalloc

import pytest

from specrun.errors import BadModelFile, InputError
from specrun.gguf.facts import model_info
from specrun.gguf.header import read_header


def header(n_tensors: int, n_kv: int, body: bytes = b"", version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + body


def gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def test_tiny_model_metadata(tiny):
    m = model_info(tiny["target"])
    assert m.architecture == "llama"
    assert m.n_layer == 2 and m.n_embd == 64 and m.n_head == 4 and m.n_head_kv == [2, 2]
    assert m.tokenizer_model == "gpt2" and m.n_vocab == 640
    assert m.chat_template and "<|im_start|>" in m.chat_template
    assert m.weights_bytes == sum(t.nbytes for t in m.header.tensors) > 0
    assert m.header.data_offset + max(t.offset + t.nbytes for t in m.header.tensors) <= m.file_size


@pytest.mark.parametrize(
    "data, needle",
    [
        (b"", "only 0 bytes"),
        (b"PK\x03\x04" + b"\0" * 40, "not a GGUF file"),
        (header(0, 0, version=99) + b"\0" * 8, "unsupported GGUF version 99"),
        (header(0, 0, version=0x03000000) + b"\0" * 8, "big-endian"),
        (header(0, 1 << 60), "metadata entries"),
        (header(1 << 60, 0), "tensors"),
        # a key claiming 2^62 bytes
        (header(0, 1, struct.pack("<Q", 1 << 62) + b"\0" * 16), "limit"),
        # a string value claiming more bytes than remain
        (header(0, 1, gstr(b"k") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 40) + b"ab"), "needs"),
        # an array of 2^50 uint32
        (header(0, 1, gstr(b"k") + struct.pack("<IIQ", 9, 4, 1 << 50) + b"\0" * 8), "more than the file can hold"),
        # an array of 2^40 strings
        (header(0, 1, gstr(b"k") + struct.pack("<IIQ", 9, 8, 1 << 40) + b"\0" * 8), "more than the file can hold"),
        # unknown value type
        (header(0, 1, gstr(b"k") + struct.pack("<I", 77) + b"\0" * 16), "unknown value type 77"),
        # nested arrays too deep
        (
            header(0, 1, gstr(b"k") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 1) + b"\0" * 20),
            "nests arrays",
        ),
        # a tensor with 9 dimensions
        (header(1, 0, gstr(b"t") + struct.pack("<I", 9) + b"\0" * 64), "dimensions"),
        # a tensor of unknown type
        (header(1, 0, gstr(b"t") + struct.pack("<IQIQ", 1, 32, 999, 0) + b"\0" * 64), "unknown type 999"),
        # a tensor that ends past the end of the file
        (header(1, 0, gstr(b"t") + struct.pack("<IQIQ", 1, 1 << 30, 0, 0) + b"\0" * 64), "past the end"),
        # a misaligned tensor
        (header(1, 0, gstr(b"t") + struct.pack("<IQIQ", 1, 4, 0, 3) + b"\0" * 64), "aligned"),
        # alignment that is not a power of two
        (header(0, 1, gstr(b"general.alignment") + struct.pack("<II", 4, 3) + b"\0" * 8), "power of two"),
    ],
)
def test_hostile_headers_are_refused_cheaply(tmp_path, data, needle):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(InputError) as e:
            read_header(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert needle in str(e.value)
    assert peak < 10 * 2**20
    assert "\n" not in str(e.value)


def test_truncated_real_file_is_refused(tiny, tmp_path):
    data = tiny["target"].read_bytes()
    for cut in (10, 100, 5000, len(data) // 2, len(data) - 1):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(BadModelFile):
            read_header(p)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(InputError, match="not found"):
        read_header(tmp_path / "nope.gguf")
    with pytest.raises(InputError, match="directory"):
        read_header(tmp_path)
