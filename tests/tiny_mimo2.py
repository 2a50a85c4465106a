"""A tiny ``mimo2`` GGUF (MiMo-V2) with three chained MTP heads, for the real llama.cpp.

mimo2 is one of the architectures whose several MTP heads llama.cpp runs as a chain (head i
makes a draft's guess i; common/speculative.cpp, ``chain_heads``), and the least work to
write: attention only (no recurrent state), dense FFN blocks (no ``expert_count``), and an
MTP graph (src/models/mimo2.cpp) that reads ``blk.{N_LAYER + i}`` for head i. Here: two trunk
blocks (sliding-window then full attention, the window never full in a test), then three head
blocks, each a full-attention block with fused ``attn_qkv`` (which llama.cpp's mimo2 MTP graph
requires) plus ``nextn.eh_proj``, ``enorm`` and ``hnorm``. The rest is tiny_models': its BPE
vocabulary, width 64, 4 query heads and 2 KV heads of 16, FFN 128.

Nobody trained the heads, so they are *taught* as tests/tiny_mtp.py's is: the trunk writes
weakly into the residual stream (so the target's next token depends mostly on the current
one), and each head's ``eh_proj`` passes the normed embedding of the token it is fed straight
through, beside a little of the state, while its block writes little: each guesses what the
target says after the token it is fed. Each head has weights of its own (its own seed), so a
guess made under the wrong head, or with another head's cache, comes out different.

    paths = build_mimo2(tmp_dir)   # {"mimo2": Path}
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tiny_models import (
    CONTEXT_LENGTH,
    HEAD_DIM,
    LOGIT_STD,
    N_EMBD,
    N_FF,
    N_HEAD,
    N_HEAD_KV,
    QK_STD,
    RMS_EPS,
    ROPE_FREQ_BASE,
    TARGET_SEED,
    Vocab,
    Weights,
    begin,
    bpe_vocab,
    settle,
    write_tensors,
)

N_LAYER = 2  # trunk blocks; the heads are blocks N_LAYER .. N_LAYER + N_HEADS - 1
N_HEADS = 3  # mimo2.nextn_predict_layers
SWA = (True, False) + (False,) * N_HEADS  # sliding window per block: the trunk's first block only
SLIDING_WINDOW = CONTEXT_LENGTH  # never full in a test: rollback never meets an evicted cell
MIMO2_SEED = TARGET_SEED + 90
TRUNK_SCALE = 0.3  # what the trunk blocks write, scaled
HEAD_SCALE = 0.1  # what a head block writes, scaled
STATE_SCALE = 0.2  # the state's share of a head's eh_proj, beside the fed token's embedding


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return rng.normal(0.0, std, size=shape).astype(np.float32)


def _block(rng: np.random.Generator, i: int, scale: float) -> Weights:
    """Block ``i``: fused Q, K, V (rows in that order), the output projection and a dense FFN,
    what it writes into the residual stream scaled by ``scale``."""
    n_kv = N_HEAD_KV * HEAD_DIM
    qkv = np.concatenate(
        [
            _normal(rng, (N_HEAD * HEAD_DIM, N_EMBD), QK_STD / N_EMBD**0.5),
            _normal(rng, (n_kv, N_EMBD), QK_STD / N_EMBD**0.5),
            _normal(rng, (n_kv, N_EMBD), 1.0 / N_EMBD**0.5),
        ]
    )
    return {
        f"blk.{i}.attn_norm.weight": np.ones(N_EMBD, np.float32),
        f"blk.{i}.attn_qkv.weight": qkv,
        f"blk.{i}.attn_output.weight": _normal(rng, (N_EMBD, N_HEAD * HEAD_DIM), scale / N_EMBD**0.5),
        f"blk.{i}.ffn_norm.weight": np.ones(N_EMBD, np.float32),
        f"blk.{i}.ffn_gate.weight": _normal(rng, (N_FF, N_EMBD), 1.0 / N_EMBD**0.5),
        f"blk.{i}.ffn_up.weight": _normal(rng, (N_FF, N_EMBD), 1.0 / N_EMBD**0.5),
        f"blk.{i}.ffn_down.weight": _normal(rng, (N_EMBD, N_FF), scale / N_FF**0.5),
    }


def mimo2_weights(seed: int = MIMO2_SEED, n_vocab: int | None = None, n_heads: int = N_HEADS) -> Weights:
    """The taught mimo2, keyed by GGUF tensor name, shapes in NumPy (rows, cols) order."""
    n_vocab = n_vocab or len(bpe_vocab())
    rng = np.random.default_rng(seed)
    w: Weights = {"token_embd.weight": _normal(rng, (n_vocab, N_EMBD), 1.0)}
    for i in range(N_LAYER):
        w |= _block(rng, i, TRUNK_SCALE)
    w["output_norm.weight"] = np.ones(N_EMBD, np.float32)
    w["output.weight"] = _normal(rng, (n_vocab, N_EMBD), LOGIT_STD / N_EMBD**0.5)
    for i in range(N_LAYER, N_LAYER + n_heads):
        head = np.random.default_rng(seed + 1 + i)  # each head its own weights
        w |= _block(head, i, HEAD_SCALE)
        eh = _normal(head, (N_EMBD, 2 * N_EMBD), STATE_SCALE / (2 * N_EMBD) ** 0.5)  # [normed embedding ; normed state]
        eh[:, :N_EMBD] += np.eye(N_EMBD, dtype=np.float32)
        w |= {
            f"blk.{i}.nextn.eh_proj.weight": eh,
            f"blk.{i}.nextn.enorm.weight": np.ones(N_EMBD, np.float32),
            f"blk.{i}.nextn.hnorm.weight": np.ones(N_EMBD, np.float32),
        }
    return w


def write_mimo2(path: str | os.PathLike[str], *, vocab: Vocab, weights: Weights, name: str = "tiny-mimo2") -> Path:
    """Write one mimo2 GGUF (the keys llama.cpp's loader reads: src/models/mimo2.cpp and
    llama_model_base::load_hparams); rewrites ``path`` only if its bytes would change."""
    path = Path(path)
    n_heads = sum(1 for k in weights if k.endswith("nextn.eh_proj.weight"))
    n_blocks = N_LAYER + n_heads
    w, tmp = begin(path, "mimo2", name, len(vocab))
    w.add_block_count(n_blocks)
    w.add_feed_forward_length(N_FF)
    w.add_uint32("mimo2.expert_feed_forward_length", N_FF)  # required, though no block has experts
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_float32("mimo2.rope.freq_base_swa", ROPE_FREQ_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_uint32("mimo2.attention.sliding_window", SLIDING_WINDOW)
    w.add_array("mimo2.attention.sliding_window_pattern", list(SWA[:n_blocks]))
    if n_heads:
        w.add_uint32("mimo2.nextn_predict_layers", n_heads)
    write_tensors(w, vocab, weights)
    return settle(tmp, path)


def build_mimo2(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """The taught mimo2 with N_HEADS chained heads, as ``<directory>/mimo2.gguf`` (idempotent)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return {"mimo2": write_mimo2(directory / "mimo2.gguf", vocab=bpe_vocab(), weights=mimo2_weights())}


if __name__ == "__main__":
    import sys

    for variant, written in build_mimo2(sys.argv[1] if len(sys.argv) > 1 else ".").items():
        print(f"{variant:8} {written}  {written.stat().st_size:,} bytes")
