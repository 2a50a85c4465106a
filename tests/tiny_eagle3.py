"""A tiny EAGLE-3 head (arch ``eagle3``) over tiny_models' llama target, for the real llama.cpp.

An EAGLE-3 head is a one-block decoder beside the target. At its position P it is fed the token
at P + 1 and ``g[P]``, its encoder's fusion (``fc``) of three of the target's layer inputs at P
(``eagle3.target_layers``), and it guesses the token at P + 2. This one has no token embeddings
or output head of its own: it borrows the target's, through ``ctx_other``, as the released
Llama-3.1-8B heads do.

Nobody trained it, so it is *taught* (as tests/tiny_mtp.py's MTP head is) to guess what the
target says after the token it is fed:

* its attention looks at its own position: the queries and keys are the same large multiple
  of the fed token's normed embedding, so a position scores itself (or an earlier copy of the
  same token) far above the others, and the value passes that embedding through;
* its FFN is the target's first block's FFN, so it adds what the target's first block adds;
* ``g`` (a random ``fc``) enters the residual stream normed and scaled to G_SCALE of the
  embedding's size (``eagle3.norm_before_residual``, the RedHat speculators' form): the head's
  guesses depend on the target's layer inputs, so features read at the wrong rows change them.
  Normed, a guess's own output state, fed back as the next ``g``, weighs no more than the
  target's did, so the head drafts on past its first guess as well as it starts.

The target's next token also depends on the context (its attention, its second block), which
the head does not see: it is right a good part of the time, not always, so the tests see
accepts and rejects.

A head with its own smaller vocabulary (``d2t``, as almost every released head has) guesses
among a subset of the target's tokens: its output head holds the target's output rows of those
tokens, and its ``d2t`` (I64, one absolute target id per row, as llama.cpp's converter writes
it) says which; llama.cpp scatters its logits into a target-wide row of -inf (``with_d2t``).

    paths = build_eagle3(tmp_dir)   # {"eagle3": Path, "eagle3-wide": Path, "eagle3-d2t": Path}
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tiny_models import (
    HEAD_DIM,
    N_EMBD,
    N_FF,
    N_HEAD,
    RMS_EPS,
    ROPE_FREQ_BASE,
    TARGET_SEED,
    Vocab,
    Weights,
    begin,
    bpe_vocab,
    make_weights,
    settle,
    write_tensors,
)

TARGET_LAYERS = (0, 1, 1)  # the target's layer inputs the head reads (the tiny target has 2 blocks)
N_HEAD_KV = N_HEAD  # no grouped queries: the value carries the whole embedding
EAGLE3_SEED = TARGET_SEED + 60
SELF_SCALE = 3.0  # queries and keys: this times the fed token's normed embedding
G_SCALE = 0.2  # normed g's weight in the residual stream, relative to the embedding's
WIDE = 2 * N_EMBD  # the hidden size a mismatched head expects of its target
D2T_EVERY = 2  # eagle3-d2t guesses among every D2T_EVERY-th token of the vocabulary


def eagle3_weights(target: Weights, seed: int = EAGLE3_SEED, n_embd_target: int = N_EMBD) -> Weights:
    """The taught head over ``target`` (tiny_models' weights), keyed by GGUF tensor name, shapes
    in NumPy (rows, cols) order. The attention reads [normed embedding ; normed g]."""
    rng = np.random.default_rng(seed)
    n_feat = len(TARGET_LAYERS) * n_embd_target
    pick = np.zeros((N_EMBD, 2 * N_EMBD), np.float32)
    pick[:, :N_EMBD] = np.eye(N_EMBD, dtype=np.float32)  # the embedding half of the attention input
    return {
        "fc.weight": rng.normal(0.0, 1.0 / n_feat**0.5, size=(N_EMBD, n_feat)).astype(np.float32),
        "blk.0.attn_norm.weight": np.ones(N_EMBD, np.float32),
        "blk.0.attn_norm_2.weight": np.full(N_EMBD, G_SCALE, np.float32),
        "blk.0.attn_q.weight": SELF_SCALE * pick,
        "blk.0.attn_k.weight": SELF_SCALE * pick,
        "blk.0.attn_v.weight": pick.copy(),
        "blk.0.attn_output.weight": np.eye(N_EMBD, dtype=np.float32),
        "blk.0.ffn_norm.weight": np.ones(N_EMBD, np.float32),
        "blk.0.ffn_gate.weight": target["blk.0.ffn_gate.weight"].copy(),
        "blk.0.ffn_up.weight": target["blk.0.ffn_up.weight"].copy(),
        "blk.0.ffn_down.weight": target["blk.0.ffn_down.weight"].copy(),
        "output_norm.weight": np.ones(N_EMBD, np.float32),
    }


def with_d2t(head: Weights, target: Weights, ids) -> Weights:
    """``head`` guessing among the target tokens ``ids`` only: its own output head (the target's
    rows of those tokens) and a ``d2t`` holding the ids (int64: written as I64)."""
    ids = np.asarray(ids, dtype=np.int64)
    return {**head, "output.weight": target["output.weight"][ids].copy(), "d2t": ids}


def write_eagle3(
    path: str | os.PathLike[str],
    *,
    vocab: Vocab,
    weights: Weights,
    target_layers: tuple[int, ...] = TARGET_LAYERS,
    n_embd_target: int = N_EMBD,
    name: str = "tiny-eagle3",
) -> Path:
    """Write one eagle3 GGUF (the target's tokenizer, as llama.cpp's converter copies it);
    rewrites ``path`` only if its bytes would change."""
    path = Path(path)
    w, tmp = begin(path, "eagle3", name, len(vocab))
    w.add_block_count(1)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    # the keys of llama.cpp's src/llama-arch.cpp (this gguf package predates them)
    w.add_array("eagle3.target_layers", list(target_layers))
    w.add_uint32("eagle3.target_hidden_size", n_embd_target)
    w.add_bool("eagle3.norm_before_residual", True)
    write_tensors(w, vocab, weights)
    return settle(tmp, path)


def build_eagle3(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """The heads, as ``<directory>/<name>.gguf`` (idempotent), for tiny_models' ``target``:

    eagle3       the taught head
    eagle3-wide  a head for a target twice as wide (``target_hidden_size`` 128): it cannot
                 read this target's layers
    eagle3-d2t   the taught head guessing among every other token (``d2t``, D2T_EVERY)
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = bpe_vocab()
    target = make_weights(TARGET_SEED, len(vocab))
    head = eagle3_weights(target)
    return {
        "eagle3": write_eagle3(directory / "eagle3.gguf", vocab=vocab, weights=head),
        "eagle3-d2t": write_eagle3(
            directory / "eagle3-d2t.gguf",
            vocab=vocab,
            weights=with_d2t(head, target, range(0, len(vocab), D2T_EVERY)),
            name="tiny-eagle3-d2t",
        ),
        "eagle3-wide": write_eagle3(
            directory / "eagle3-wide.gguf",
            vocab=vocab,
            weights=eagle3_weights(target, n_embd_target=WIDE),
            n_embd_target=WIDE,
            name="tiny-eagle3-wide",
        ),
    }


if __name__ == "__main__":
    import sys

    for variant, written in build_eagle3(sys.argv[1] if len(sys.argv) > 1 else ".").items():
        print(f"{variant:12} {written}  {written.stat().st_size:,} bytes")
