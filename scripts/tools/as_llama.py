"""A Qwen2 GGUF rewritten as the same network under llama.cpp's ``llama`` architecture.

    python scripts/tools/as_llama.py SRC.gguf DST.gguf

The llama.cpp that llama-cpp-python 0.3.36 vendors hands out a target's layer inputs (what an
EAGLE-3 head and a block drafter read) only from some architectures' graphs, and ``qwen2`` is not
one of them: the demo target cannot host a DFlash or DSpark drafter there. The ``llama`` graph
can, and it computes the same network as ``qwen2`` (the same norms, SwiGLU, grouped attention,
optional q/k/v biases) except for the rotary layout: qwen2 rotates each head's dimension i with
i + d/2 (NEOX), llama rotates 2i with 2i + 1. So this writes every tensor as it is, quantized or
not, but for the rows of ``attn_q`` and ``attn_k`` (weights and biases), which it reorders within
each head so that llama's pairs are qwen2's: row 2i takes row i, row 2i + 1 takes row i + d/2.
Queries and keys are permuted alike, so their dot products, the attention, and the text are
unchanged (up to rounding). The header keys move from ``qwen2.*`` to ``llama.*``.

``rewrite(src, dst, arch, permute=False)`` renames an architecture without touching a tensor (the
tests make a ``qwen2`` header of a tiny llama model with it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, ReaderField


def _neox_to_pairs(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Rows of a q or k projection (n_heads * head_dim of them) reordered within each head."""
    n = rows.shape[0] // head_dim
    half = head_dim // 2
    order = np.empty(head_dim, np.int64)
    order[0::2], order[1::2] = np.arange(half), np.arange(half) + half
    index = (np.arange(n)[:, None] * head_dim + order[None, :]).reshape(-1)
    return rows[index]


def copy_field(w: GGUFWriter, f: ReaderField, name: str | None = None) -> None:
    """Write a header field read from another file (as ``name``, else under its own)."""
    sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
    w.add_key_value(name or f.name, f.contents(), f.types[0], sub_type=sub)


def rewrite(src: Path, dst: Path, arch: str, permute: bool = False) -> Path:
    r = GGUFReader(src)
    old = r.get_field("general.architecture").contents()
    n_head = r.get_field(f"{old}.attention.head_count").contents()
    n_embd = r.get_field(f"{old}.embedding_length").contents()
    head_dim = n_embd // n_head
    tmp = dst.with_name(f".{dst.name}.tmp")
    w = GGUFWriter(tmp, arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        copy_field(w, f, f"{arch}.{f.name[len(old) + 1 :]}" if f.name.startswith(f"{old}.") else None)
    if permute and r.get_field(f"{old}.rope.dimension_count") is None:
        w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    for t in r.tensors:
        data = np.asarray(t.data)
        if permute and (
            t.name.endswith("attn_q.weight") or t.name.endswith("attn_k.weight") or t.name.endswith(("attn_q.bias", "attn_k.bias"))
        ):
            data = _neox_to_pairs(data, head_dim)
        w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)
    return dst


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    arch = GGUFReader(src).get_field("general.architecture").contents()
    if arch != "qwen2":
        print(f"{src.name} is a {arch!r} model; this rewrites qwen2 ones", file=sys.stderr)
        return 2
    rewrite(src, dst, "llama", permute=True)
    print(f"{dst}  {dst.stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
