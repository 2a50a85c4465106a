"""Bounded reading of GGUF headers: metadata and tensor descriptors, never weights (bar one
small tensor asked for by name, :func:`tensor_bytes`).

GGUF files come from strangers, and llama.cpp's loader has a history of memory-safety bugs
on crafted files. So specrun walks the header itself before anything else touches the file,
and every count and length is checked against the bytes that are really left before it is
used. A file that fails is refused with :class:`~specrun.errors.BadModelFile` and one line
that says what is wrong.

Layout (little-endian), as in ggml's ``docs/gguf.md``::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x  (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment, then the tensor data

The constants (value types, quantisation block sizes, file-type names) come from the
``gguf`` package, so new quant types are picked up by upgrading it.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from specrun.errors import BadModelFile, InputError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml tensors have at most 4 dimensions
MAX_ARRAY_DEPTH = 2  # arrays of arrays exist in the spec, deeper nesting does not in practice
MAX_KEY_LEN = 65_536

# numpy dtypes of the fixed-size value types
_NUMERIC = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
    GGUFValueType.BOOL: np.dtype("<u1"),
}
_STRUCT = {t: struct.Struct("<" + d.char) for t, d in _NUMERIC.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # relative to the start of the data section
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"


@dataclass
class GGUFHeader:
    path: Path
    version: int
    file_size: int
    alignment: int
    data_offset: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Reader:
    """A cursor over the file's bytes that refuses to read past the end."""

    def __init__(self, buf, name: str):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.name = name

    def fail(self, what: str) -> BadModelFile:
        return BadModelFile(
            f"{self.name} is not a valid GGUF file: {what} (at byte {self.pos})",
            "re-download or re-convert the model",
        )

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.left():
            raise self.fail(f"{what} needs {n} bytes but only {self.left()} remain (truncated?)")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(what + " length")
        if limit is not None and n > limit:
            raise self.fail(f"{what} claims {n} bytes, more than the limit of {limit}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
            return self.array(what, depth + 1)
        try:
            st = _STRUCT[GGUFValueType(vtype)]
        except (ValueError, KeyError):
            raise self.fail(f"{what} has unknown value type {vtype}") from None
        self.need(st.size, what)
        (v,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return bool(v) if vtype == GGUFValueType.BOOL else v

    def array(self, what: str, depth: int) -> Any:
        etype = self.u32(what + " element type")
        count = self.u64(what + " count")
        if etype == GGUFValueType.STRING:
            # each string is at least its 8-byte length: bound the count before the loop
            if count > self.left() // 8:
                raise self.fail(f"{what} claims {count} strings, more than the file can hold")
            return self._strings(count, what)
        if etype == GGUFValueType.ARRAY:
            if count > self.left() // 12:
                raise self.fail(f"{what} claims {count} arrays, more than the file can hold")
            return [self.value(etype, what, depth) for _ in range(count)]
        try:
            dt = _NUMERIC[GGUFValueType(etype)]
        except (ValueError, KeyError):
            raise self.fail(f"{what} has unknown element type {etype}") from None
        if count > self.left() // dt.itemsize:
            raise self.fail(f"{what} claims {count} elements, more than the file can hold")
        arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
        self.pos += count * dt.itemsize
        return arr.astype(bool) if etype == GGUFValueType.BOOL else arr

    def _strings(self, count: int, what: str) -> StringArray:
        # walk the lengths only; the texts are decoded lazily, on access
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        start = pos
        starts = [0] * count
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"{what} is truncated")
            n = unpack(buf, pos)[0]
            starts[i] = pos - start
            pos += 8 + n
            if pos > size:
                self.pos = pos - n
                raise self.fail(f"{what} has a string of {n} bytes, past the end of the file")
        self.pos = pos
        return StringArray(buf[start:pos], starts)


class StringArray(Sequence):
    """A GGUF array of strings, kept as its raw bytes and decoded one element at a time.

    Vocabularies hold 150k+ strings; decoding them all costs more than reading the file.
    """

    def __init__(self, raw: bytes, starts: list[int]):
        self._raw = raw
        self._starts = starts

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        s = self._starts[i] + 8
        (n,) = _U64.unpack_from(self._raw, s - 8)
        return self._raw[s : s + n].decode("utf-8", errors="surrogateescape")

    def raw_span(self, i: int, j: int) -> bytes:
        """The encoded bytes of elements i..j-1, for fast equality tests of whole ranges."""
        end = self._starts[j] if j < len(self) else len(self._raw)
        return self._raw[self._starts[i] : end]

    def __eq__(self, other) -> bool:
        if isinstance(other, StringArray):
            return self._raw == other._raw
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int | None:
    """Bytes a tensor of this type and shape occupies, or None for an unknown type."""
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    n = 1
    for d in shape:
        n *= d
    if shape and shape[0] % block:
        return None
    return n // block * type_size


def tensor_bytes(h: GGUFHeader, t: TensorInfo) -> bytes:
    """The data of one tensor of ``h`` (which the header's checks place inside the file); for
    small tensors only, such as an EAGLE-3 head's token map. Raises InputError."""
    try:
        with open(h.path, "rb") as f:
            f.seek(h.data_offset + t.offset)
            data = f.read(t.nbytes)
    except OSError as e:
        raise InputError(f"cannot read {h.path}: {e.strerror or e}", "check the path") from None
    if len(data) != t.nbytes:
        raise BadModelFile(f"{h.path.name} ends inside tensor {t.name!r} (truncated?)", "re-download or re-convert the model")
    return data


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and validate a GGUF header. Raises InputError/BadModelFile, never anything else."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"model file not found: {p}", "check the path or run `specrun models`")
    if p.is_dir():
        raise InputError(f"{p} is a directory, not a GGUF file", "point at the .gguf file inside it")
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise BadModelFile(f"{p} is not a GGUF file: only {size} bytes", "re-download the model")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse(p, mm, size)
    except PermissionError:
        raise InputError(f"cannot read {p}: permission denied", "check the file's permissions") from None
    except OSError as e:
        raise InputError(f"cannot read {p}: {e.strerror or e}", "check the path") from None


def _parse(p: Path, mm, size: int) -> GGUFHeader:
    return _parse_body(p, _Reader(mm, p.name), size)


def _parse_body(p: Path, r: _Reader, size: int) -> GGUFHeader:
    magic = r.buf[:4]
    if magic != MAGIC:
        raise BadModelFile(
            f"{p} is not a GGUF file (starts with {magic!r})",
            "specrun needs a .gguf model; convert with llama.cpp's convert_hf_to_gguf.py",
        )
    r.pos = 4
    version = r.u32("version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise r.fail(f"unsupported GGUF version {version}{hint}")
    n_tensors = r.u64("tensor count")
    n_kv = r.u64("metadata count")
    # the smallest metadata entry is a 1-byte key plus type plus a 1-byte value: 14 bytes;
    # the smallest tensor descriptor is an empty name, 1 dim and type and offset: 32 bytes
    if n_kv > r.left() // 14:
        raise r.fail(f"header claims {n_kv} metadata entries, more than the file can hold")
    if n_tensors > r.left() // 32:
        raise r.fail(f"header claims {n_tensors} tensors, more than the file can hold")

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string("metadata key", limit=MAX_KEY_LEN)
        vtype = r.u32(f"type of {key!r}")
        meta[key] = r.value(vtype, repr(key))

    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise r.fail(f"general.alignment {alignment!r} is not a power of two")

    infos = []
    for _ in range(n_tensors):
        name = r.string("tensor name", limit=MAX_KEY_LEN)
        n_dims = r.u32(f"dimensions of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions")
        shape = tuple(r.u64(f"shape of {name!r}") for _ in range(n_dims))
        gtype = r.u32(f"type of {name!r}")
        offset = r.u64(f"offset of {name!r}")
        infos.append((name, shape, gtype, offset))

    data_offset = -(-r.pos // alignment) * alignment
    data_size = size - data_offset
    tensors = []
    for name, shape, gtype, offset in infos:
        if any(d == 0 or d > 1 << 40 for d in shape):
            raise r.fail(f"tensor {name!r} has an impossible shape {list(shape)}")
        nbytes = tensor_nbytes(gtype, shape)
        if nbytes is None:
            raise r.fail(f"tensor {name!r} has unknown type {gtype} or a shape its blocks do not divide")
        if offset % alignment:
            raise r.fail(f"tensor {name!r} is not aligned to {alignment} bytes")
        if offset + nbytes > data_size:
            raise r.fail(f"tensor {name!r} ends {offset + nbytes - data_size} bytes past the end of the file (truncated download?)")
        tensors.append(TensorInfo(name, shape, gtype, offset, nbytes))
    return GGUFHeader(p, version, size, alignment, data_offset, meta, tensors)
