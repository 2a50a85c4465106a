"""A tiny Gemma 4 target and its assistant file (arch ``gemma4-assistant``), for the real llama.cpp.

The target is a 4-block ``gemma4`` (sliding-window and full attention in turn, 64 wide, 4 query
heads and 2 KV heads of 16, GELU FFN 128) on tiny_models' BPE vocabulary. Gemma scales its
token embeddings by sqrt(n_embd) and norms what each block writes (``post_attention_norm``,
``post_ffw_norm``), so with unit norm weights the blocks write weakly beside the embedding, and
the target's next token depends mostly on the current one.

The assistant is Gemma 4's MTP drafter, a file of its own: its blocks have queries only and
attend over the target's KV cache (its last sliding-window and its last full layer), shared
through ``ctx_other``. Fed a token (embedded by the *target's* embeddings) and the target's
final state before it, it guesses the next token. This one is taught, as tests/tiny_mtp.py's
head is: its input projection passes the target's embedding of the fed token straight
through (and a little of the state), its blocks write little, and its output head reads the
target's output head off that embedding: it guesses what the target says after that token.

    paths = build_gemma4(tmp_dir)   # {"gemma4": Path, "mtp-gemma4": Path}
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from tiny_models import (
    CONTEXT_LENGTH,
    HEAD_DIM,
    LOGIT_STD,
    N_EMBD,
    N_FF,
    N_HEAD,
    N_HEAD_KV,
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

N_LAYER = 4
SWA = (True, False, True, False)  # the target's layers: sliding window, full, sliding window, full
SLIDING_WINDOW = CONTEXT_LENGTH  # no window is ever full in the tests: rollback never meets an evicted cell
QK_NORM = 0.35  # q and k are RMS-normed per head; this weight keeps their dot products near 0.5 (soft attention)
GEMMA4_SEED = TARGET_SEED + 80
ASSISTANT_EMBD = 2 * N_EMBD  # the assistant's own width (llama.cpp requires it to differ from the target's)
ASSISTANT_SWA = (True, False)  # its blocks: one reads the target's last window layer, one its last full layer
ASSISTANT_FF = 64
STATE_SCALE = 0.1  # how much of the target's state the assistant's input projection passes on
WRITE_SCALE = 0.05  # what the assistant's blocks add, relative to their input


def gemma4_weights(seed: int = GEMMA4_SEED, n_vocab: int | None = None) -> Weights:
    """Random gemma4 weights, keyed by GGUF tensor name, shapes in NumPy (rows, cols) order."""
    n_vocab = n_vocab or len(bpe_vocab())
    rng = np.random.default_rng(seed)

    def normal(rows: int, cols: int, std: float) -> np.ndarray:
        return rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)

    n_kv = N_HEAD_KV * HEAD_DIM
    w: Weights = {
        "token_embd.weight": normal(n_vocab, N_EMBD, 1.0),
        "output_norm.weight": np.ones(N_EMBD, np.float32),
        "output.weight": normal(n_vocab, N_EMBD, LOGIT_STD / N_EMBD**0.5),
        "rope_freqs.weight": np.ones(HEAD_DIM // 2, np.float32),  # the full layers' (plain RoPE here)
    }
    for i in range(N_LAYER):
        w |= {
            f"blk.{i}.attn_norm.weight": np.ones(N_EMBD, np.float32),
            f"blk.{i}.attn_q.weight": normal(N_HEAD * HEAD_DIM, N_EMBD, 1.0 / N_EMBD**0.5),
            f"blk.{i}.attn_k.weight": normal(n_kv, N_EMBD, 1.0 / N_EMBD**0.5),
            f"blk.{i}.attn_v.weight": normal(n_kv, N_EMBD, 1.0 / N_EMBD**0.5),
            f"blk.{i}.attn_output.weight": normal(N_EMBD, N_HEAD * HEAD_DIM, 1.0 / (N_HEAD * HEAD_DIM) ** 0.5),
            f"blk.{i}.attn_q_norm.weight": np.full(HEAD_DIM, QK_NORM, np.float32),
            f"blk.{i}.attn_k_norm.weight": np.full(HEAD_DIM, QK_NORM, np.float32),
            f"blk.{i}.post_attention_norm.weight": np.ones(N_EMBD, np.float32),
            f"blk.{i}.ffn_norm.weight": np.ones(N_EMBD, np.float32),
            f"blk.{i}.ffn_gate.weight": normal(N_FF, N_EMBD, 1.0 / N_EMBD**0.5),
            f"blk.{i}.ffn_up.weight": normal(N_FF, N_EMBD, 1.0 / N_EMBD**0.5),
            f"blk.{i}.ffn_down.weight": normal(N_EMBD, N_FF, 1.0 / N_FF**0.5),
            f"blk.{i}.post_ffw_norm.weight": np.ones(N_EMBD, np.float32),
        }
    return w


def assistant_weights(target: Weights, seed: int = GEMMA4_SEED + 1) -> Weights:
    """The taught assistant for ``target``. Its input is [sqrt(64) x target embedding ; target
    state] (128 wide); its residual stream is ASSISTANT_EMBD wide."""
    rng = np.random.default_rng(seed)
    e, n_vocab = ASSISTANT_EMBD, target["token_embd.weight"].shape[0]

    def normal(rows: int, cols: int, std: float) -> np.ndarray:
        return rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)

    pre = np.zeros((e, 2 * N_EMBD), np.float32)
    pre[:N_EMBD, :N_EMBD] = np.eye(N_EMBD, dtype=np.float32)  # the embedding, as it is
    pre[N_EMBD:, N_EMBD:] = STATE_SCALE * np.eye(N_EMBD, dtype=np.float32)  # and a little of the state
    out = np.zeros((n_vocab, e), np.float32)
    out[:, :N_EMBD] = target["output.weight"]  # the target's head, read off the embedding half
    out[:, N_EMBD:] = normal(n_vocab, N_EMBD, LOGIT_STD / N_EMBD**0.5)  # the state half moves the guess a little
    w: Weights = {
        "token_embd.weight": out,  # the assistant's output head (tied)
        "output_norm.weight": np.ones(e, np.float32),
        "nextn.pre_projection.weight": pre,
        "nextn.post_projection.weight": normal(N_EMBD, e, 1.0 / e**0.5),
        "rope_freqs.weight": np.ones(HEAD_DIM // 2, np.float32),
    }
    for i in range(len(ASSISTANT_SWA)):
        w |= {
            f"blk.{i}.attn_norm.weight": np.ones(e, np.float32),
            f"blk.{i}.attn_q.weight": normal(N_HEAD * HEAD_DIM, e, 1.0 / e**0.5),
            f"blk.{i}.attn_output.weight": normal(e, N_HEAD * HEAD_DIM, 1.0 / (N_HEAD * HEAD_DIM) ** 0.5),
            f"blk.{i}.attn_q_norm.weight": np.full(HEAD_DIM, QK_NORM, np.float32),
            f"blk.{i}.post_attention_norm.weight": np.full(e, WRITE_SCALE, np.float32),
            f"blk.{i}.layer_output_scale.weight": np.ones(1, np.float32),
            f"blk.{i}.ffn_norm.weight": np.ones(e, np.float32),
            f"blk.{i}.ffn_gate.weight": normal(ASSISTANT_FF, e, 1.0 / e**0.5),
            f"blk.{i}.ffn_up.weight": normal(ASSISTANT_FF, e, 1.0 / e**0.5),
            f"blk.{i}.ffn_down.weight": normal(e, ASSISTANT_FF, 1.0 / ASSISTANT_FF**0.5),
            f"blk.{i}.post_ffw_norm.weight": np.full(e, WRITE_SCALE, np.float32),
        }
    return w


def _write(path: Path, arch: str, vocab: Vocab, weights: Weights, name: str, n_embd: int, swa: tuple[bool, ...], n_ff: int, extra) -> Path:
    w, tmp = begin(path, arch, name, len(vocab), n_embd)
    w.add_block_count(len(swa))
    w.add_feed_forward_length(n_ff)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_uint32(f"{arch}.attention.key_length_swa", HEAD_DIM)
    w.add_uint32(f"{arch}.attention.value_length_swa", HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_uint32(f"{arch}.rope.dimension_count_swa", HEAD_DIM)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_float32(f"{arch}.rope.freq_base_swa", ROPE_FREQ_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_uint32(f"{arch}.attention.sliding_window", SLIDING_WINDOW)
    w.add_array(f"{arch}.attention.sliding_window_pattern", list(swa))
    w.add_uint32(f"{arch}.attention.shared_kv_layers", 0)
    extra(w)
    write_tensors(w, vocab, weights)
    return settle(tmp, path)


def build_gemma4(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """The target and its assistant, as ``<directory>/<name>.gguf`` (idempotent):

    gemma4        the tiny Gemma 4 target
    mtp-gemma4    its taught assistant (arch gemma4-assistant)
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = bpe_vocab()
    target = gemma4_weights(n_vocab=len(vocab))

    def per_layer(w: GGUFWriter) -> None:
        w.add_uint32("gemma4.embedding_length_per_layer_input", 0)

    def assistant(w: GGUFWriter) -> None:
        w.add_uint32("gemma4-assistant.embedding_length_out", N_EMBD)  # the target's width
        w.add_uint32("gemma4-assistant.nextn_predict_layers", len(ASSISTANT_SWA))

    return {
        "gemma4": _write(directory / "gemma4.gguf", "gemma4", vocab, target, "tiny-gemma4", N_EMBD, SWA, N_FF, per_layer),
        "mtp-gemma4": _write(
            directory / "mtp-gemma4.gguf",
            "gemma4-assistant",
            vocab,
            assistant_weights(target),
            "tiny-gemma4-assistant",
            ASSISTANT_EMBD,
            ASSISTANT_SWA,
            ASSISTANT_FF,
            assistant,
        ),
    }


if __name__ == "__main__":
    import sys

    for variant, written in build_gemma4(sys.argv[1] if len(sys.argv) > 1 else ".").items():
        print(f"{variant:12} {written}  {written.stat().st_size:,} bytes")
