"""Tiny block drafters (arch ``dflash``: DFlash, DSpark, DFlash2) over tiny_models' llama target,
for the real llama.cpp.

A block drafter is a small decoder beside the target. After every target decode the target's
inputs to a few of its layers (``dflash.target_layers``), fused by the drafter's ``fc`` and
normed into ``g``, are written into the drafter's KV cache at the target's positions, as keys and
values only. To draft, one decode of ``[last token, mask x (B - 1)]`` (non-causal: every row sees
every other and the whole cache) reads the block: row i guesses the token at its own position.
Like the released drafters, these borrow the target's token embeddings and output head through
``ctx_other`` and carry its tokenizer (with ``tokenizer.ggml.mask_token_id``).

Nobody trained them, so they are *taught* (as tests/tiny_eagle3.py's head is) to guess what the
target says after the last token:

* the block's rows attend to the last token's row and to nothing else, through two heads whose
  only key dimension is a projection of the fed token's normed embedding that is zero on the mask
  token (and on every injected row, which lives in other dimensions, G_DIMS): the projection's
  sign varies by token, so one head has a query of +1 on it and the other of -1, and whichever
  agrees in sign takes that row (a score of +-QK_SCORE), while the other spreads over cells whose
  values are zero. The values are the fed token's normed embedding with the mask token's
  direction taken out, so the mask rows carry the last token's embedding, ATTN_GAIN times over;
* a third head averages the injected rows (queries and keys zero), whose values are ``g``, and
  writes that average into the residual stream at G_GAIN: the guesses depend on the target's
  layer inputs, so injections at the wrong positions, missing or left over change them;
* the FFN is the target's first block's, scaled as the residual is, so a row guesses what the
  target's first block, without its attention, says after the last token.

The target's next token also depends on the context (its attention, its second block), which
the drafter does not see: the first guess is right a good part of the time, not always, and the
later rows of a DFlash block repeat it (they see the same things), so the tests see accepts and
rejects.

* **DSpark** adds its Markov head: each row's logits are biased by ``markov_w2 @ markov_w1[prev]``,
  ``prev`` the argmax of the row before (the last token, for the first), which here is the
  target's first-block guess after ``prev`` (MARKOV_GAIN times it): a chain, so its later rows
  are right more often than DFlash's. It samples from the anchor (its first row guesses the
  token after the last one) and has a confidence head (``conf_proj``).
* **DFlash2** adds depthwise convolutions over the block (identity here: a base of one on the
  first tap, no dynamic part) and a selector: per row, the top SELECTOR_TOP_K candidates and a
  score for each pair (previous row's pick, this one), walked on the CPU; its pairwise part is
  small and random, so it mostly walks the argmaxes.

    paths = build_dflash(tmp_dir)   # {"dflash": Path, "dspark": Path, "dflash2": Path, ...}
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tiny_models import (
    N_EMBD,
    N_FF,
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

TARGET_LAYERS = (0, 1)  # the target's layer inputs the drafter reads (the tiny target has 2 blocks)
BLOCK_SIZE = 8  # dflash.block_size: a DFlash block drafts BLOCK_SIZE - 1 tokens
MASK_TOKEN = "<|endoftext|>"  # the tiny vocabulary has no mask token of its own: this one stands in
DFLASH_SEED = TARGET_SEED + 70
N_HEAD = 3  # heads A and B carry the last token, head C averages the injections
HEAD_DIM = 64  # each head as wide as the embedding, so one head carries it whole
N_ROT = 16  # rotary dimensions per head (the rest, the selecting one among them, are not rotated)
G_DIMS = 8  # g lives in the last G_DIMS dimensions, the fed tokens' embeddings in the others
KEY_DIM = HEAD_DIM - 1  # heads A and B: the one query and key dimension
QK_NORM = 1.5  # q_norm and k_norm weights: a selected row scores 8 * QK_NORM**2 (18) above the rest
ATTN_GAIN = 4.0  # how much stronger than the fed token's own embedding the carried one is written
G_GAIN = 0.3  # the injections' average, in the residual stream
MARKOV_GAIN = 3.0  # DSpark: the Markov bias against the rows' own logits
SELECTOR_RANK, SELECTOR_TOP_K = 16, 4  # DFlash2's selector
CONV_KERNEL, CONV_GROUP = 2, 8  # DFlash2's convolutions
WIDE = 2 * N_EMBD  # the width of a drafter for another target


def _rms_norm(v: np.ndarray) -> np.ndarray:
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + RMS_EPS)


def first_block_guess(target: Weights, tokens: np.ndarray) -> np.ndarray:
    """The normed hidden state the target's first block, without its attention, gives each of
    ``tokens``: what its output head turns into the guess of the next token, (n, N_EMBD)."""
    e = target["token_embd.weight"][tokens]
    x = _rms_norm(e)
    gate, up = x @ target["blk.0.ffn_gate.weight"].T, x @ target["blk.0.ffn_up.weight"].T
    ffn = (gate / (1.0 + np.exp(-gate)) * up) @ target["blk.0.ffn_down.weight"].T
    return _rms_norm(e + ffn).astype(np.float32)


def dflash_weights(target: Weights, vocab: Vocab, seed: int = DFLASH_SEED, n_embd: int = N_EMBD) -> Weights:
    """The taught DFlash drafter over ``target`` (tiny_models' weights), keyed by GGUF tensor
    name, shapes in NumPy (rows, cols) order. (``n_embd`` other than the target's: a drafter of
    the same design for a wider target, its weights random.)"""
    rng = np.random.default_rng(seed)
    n_feat = len(TARGET_LAYERS) * n_embd
    if n_embd != N_EMBD:
        return _random_dflash(rng, n_embd, n_feat)
    keep = n_embd - G_DIMS  # the fed tokens' dimensions
    block = np.zeros(n_embd, np.float32)
    block[:keep] = 1.0
    x_mask = (_rms_norm(target["token_embd.weight"][vocab.id_of(MASK_TOKEN)]) * block).astype(np.float64)
    unit = x_mask / np.linalg.norm(x_mask)
    a = rng.normal(size=n_embd) * block
    a -= (a @ unit) * unit
    a *= 10.0 / np.linalg.norm(a)  # far from zero on any token but the mask
    wq, wk, wv = (np.zeros((N_HEAD * HEAD_DIM, n_embd)) for _ in range(3))
    for head, sign in ((0, 1.0), (1, -1.0)):
        wq[head * HEAD_DIM + KEY_DIM] = sign * x_mask / (x_mask @ x_mask)  # the mask row's query: +-1
        wk[head * HEAD_DIM + KEY_DIM] = a
        wv[head * HEAD_DIM : head * HEAD_DIM + n_embd, :] = (np.eye(n_embd) - np.outer(unit, unit)) * block
    wv[2 * HEAD_DIM : 2 * HEAD_DIM + G_DIMS, keep:] = np.eye(G_DIMS)  # head C: g's dimensions
    wo = np.zeros((n_embd, N_HEAD * HEAD_DIM))
    for head in (0, 1):
        wo[:, head * HEAD_DIM : head * HEAD_DIM + n_embd] = ATTN_GAIN * np.eye(n_embd)
    wo[:, 2 * HEAD_DIM : 2 * HEAD_DIM + G_DIMS] = G_GAIN * rng.normal(size=(n_embd, G_DIMS)) / G_DIMS**0.5
    enc = np.zeros(n_embd, np.float32)
    enc[keep:] = 1.0
    w = {
        "fc.weight": rng.normal(0.0, 1.0 / n_feat**0.5, size=(n_embd, n_feat)),
        "enc.output_norm.weight": enc,
        "blk.0.attn_norm.weight": block,
        "blk.0.attn_q.weight": wq,
        "blk.0.attn_k.weight": wk,
        "blk.0.attn_v.weight": wv,
        "blk.0.attn_output.weight": wo,
        "blk.0.attn_q_norm.weight": np.full(HEAD_DIM, QK_NORM),
        "blk.0.attn_k_norm.weight": np.full(HEAD_DIM, QK_NORM),
        "blk.0.ffn_norm.weight": np.ones(n_embd),
        "blk.0.ffn_gate.weight": target["blk.0.ffn_gate.weight"],
        "blk.0.ffn_up.weight": target["blk.0.ffn_up.weight"],
        "blk.0.ffn_down.weight": ATTN_GAIN * target["blk.0.ffn_down.weight"],
        "output_norm.weight": np.ones(n_embd),
    }
    return {k: np.asarray(v, dtype=np.float32) for k, v in w.items()}


def _random_dflash(rng: np.random.Generator, n_embd: int, n_feat: int) -> Weights:
    """A DFlash drafter of the taught one's shapes, ``n_embd`` wide, with random weights."""
    shapes = {
        "fc.weight": (n_embd, n_feat),
        "blk.0.attn_q.weight": (N_HEAD * HEAD_DIM, n_embd),
        "blk.0.attn_k.weight": (N_HEAD * HEAD_DIM, n_embd),
        "blk.0.attn_v.weight": (N_HEAD * HEAD_DIM, n_embd),
        "blk.0.attn_output.weight": (n_embd, N_HEAD * HEAD_DIM),
        "blk.0.ffn_gate.weight": (N_FF, n_embd),
        "blk.0.ffn_up.weight": (N_FF, n_embd),
        "blk.0.ffn_down.weight": (n_embd, N_FF),
    }
    w = {k: rng.normal(0.0, 1.0 / s[1] ** 0.5, size=s).astype(np.float32) for k, s in shapes.items()}
    for k in ("enc.output_norm", "blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w[f"{k}.weight"] = np.ones(n_embd, np.float32)
    for k in ("attn_q_norm", "attn_k_norm"):
        w[f"blk.0.{k}.weight"] = np.ones(HEAD_DIM, np.float32)
    return w


def dspark_weights(base: Weights, target: Weights, seed: int = DFLASH_SEED) -> Weights:
    """``base`` with DSpark's Markov head (rank N_EMBD: ``markov_w1`` holds the target's
    first-block guess of each token, ``markov_w2`` its output head) and a confidence head."""
    rng = np.random.default_rng(seed + 1)
    n_vocab = target["output.weight"].shape[0]
    return {
        **base,
        "markov_w1.weight": first_block_guess(target, np.arange(n_vocab)),
        "markov_w2.weight": (MARKOV_GAIN * target["output.weight"]).astype(np.float32),
        "conf_proj.weight": (rng.normal(0.0, 0.3, size=(1, 2 * N_EMBD)) / N_EMBD**0.5).astype(np.float32),
        "conf_proj.bias": np.array([0.5], np.float32),
    }


def dflash2_weights(base: Weights, seed: int = DFLASH_SEED) -> Weights:
    """``base`` with DFlash2's convolutions (identity) and a small random selector."""
    rng = np.random.default_rng(seed + 2)
    n_vocab = len(bpe_vocab())
    conv_base = np.zeros((2, CONV_KERNEL, N_EMBD), np.float32)  # (side, tap, channel)
    conv_base[:, 0, :] = 1.0
    projected = 2 * CONV_KERNEL * (N_EMBD // CONV_GROUP)
    out = dict(base)
    for part in ("attn", "ffn"):
        out[f"blk.0.{part}_conv_base"] = conv_base.copy()
        out[f"blk.0.{part}_conv_proj.weight"] = np.zeros((projected, N_EMBD), np.float32)
    small = 0.2 / SELECTOR_RANK**0.5
    out["selector_predecessor.weight"] = rng.normal(0.0, small, size=(n_vocab, SELECTOR_RANK)).astype(np.float32)
    out["selector_successor.weight"] = rng.normal(0.0, small, size=(n_vocab, SELECTOR_RANK)).astype(np.float32)
    out["selector_hidden.weight"] = rng.normal(0.0, small, size=(SELECTOR_RANK, N_EMBD)).astype(np.float32)
    return out


def write_dflash(
    path: str | os.PathLike[str],
    *,
    vocab: Vocab,
    weights: Weights,
    target_layers: tuple[int, ...] | None = TARGET_LAYERS,
    block_size: int | None = BLOCK_SIZE,
    mask_token: int | None = -1,
    n_embd: int = N_EMBD,
    extra: dict[str, int | bool] | None = None,
    name: str = "tiny-dflash",
    rope_sections: tuple[int, ...] | None = None,
) -> Path:
    """Write one dflash GGUF (the target's tokenizer, as llama.cpp's converter copies it);
    rewrites ``path`` only if its bytes would change. ``target_layers``, ``block_size`` or
    ``mask_token`` None leaves that key out (``mask_token`` -1: MASK_TOKEN's id); ``extra``: more
    ``dflash.*`` keys (DFlash2's, DSpark's); ``rope_sections``: M-RoPE sections (llama.cpp then
    ropes the drafter as M-RoPE, four positions per injected row)."""
    path = Path(path)
    w, tmp = begin(path, "dflash", name, len(vocab), n_embd)
    w.add_block_count(sum(1 for k in weights if k.endswith("attn_q.weight")))
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(N_ROT)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    if rope_sections is not None:
        w.add_rope_dimension_sections(list(rope_sections))
    # the keys of llama.cpp's src/llama-arch.cpp (this gguf package predates them)
    if target_layers is not None:
        w.add_array("dflash.target_layers", list(target_layers))
    if block_size is not None:
        w.add_uint32("dflash.block_size", block_size)
    for key, value in (extra or {}).items():
        (w.add_bool if isinstance(value, bool) else w.add_uint32)(f"dflash.{key}", value)
    if mask_token is not None:
        w.add_mask_token_id(vocab.id_of(MASK_TOKEN) if mask_token == -1 else mask_token)
    write_tensors(w, vocab, weights)
    return settle(tmp, path)


DSPARK_KEYS: dict[str, int | bool] = {"sample_from_anchor": True, "has_confidence_head": True}
DFLASH2_KEYS: dict[str, int | bool] = {
    "conv_kernel_size": CONV_KERNEL, "conv_group_size": CONV_GROUP, "selector_rank": SELECTOR_RANK, "selector_top_k": SELECTOR_TOP_K,
}  # fmt: skip


def build_dflash(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """The drafters, as ``<directory>/<name>.gguf`` (idempotent), for tiny_models' ``target``:

    dflash        the taught DFlash drafter
    dspark        the same with DSpark's Markov and confidence heads
    dflash2       the same with DFlash2's convolutions and selector
    dflash-wide   a DFlash drafter for a target twice as wide: it cannot read this target's layers
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = bpe_vocab()
    target = make_weights(TARGET_SEED, len(vocab))
    base = dflash_weights(target, vocab)
    return {
        "dflash": write_dflash(directory / "dflash.gguf", vocab=vocab, weights=base),
        "dspark": write_dflash(
            directory / "dspark.gguf", vocab=vocab, weights=dspark_weights(base, target), extra=DSPARK_KEYS, name="tiny-dspark"
        ),
        "dflash2": write_dflash(
            directory / "dflash2.gguf", vocab=vocab, weights=dflash2_weights(base), extra=DFLASH2_KEYS, name="tiny-dflash2"
        ),
        "dflash-wide": write_dflash(
            directory / "dflash-wide.gguf",
            vocab=vocab,
            weights=dflash_weights(target, vocab, n_embd=WIDE),
            n_embd=WIDE,
            name="tiny-dflash-wide",
        ),
    }


# --- drafters for tiny_hybrid's qwen35 target (gated delta-net + attention, M-RoPE) -----------

HYBRID_TARGET_LAYERS = (1, 3)  # the inputs of its attention layers, each after a delta-net layer's state
# the drafter's M-RoPE sections over its N_ROT // 2 rotary pairs: pairs 2.. follow the height and
# width positions (released drafters carry TEMPORAL_SECTIONS: every pair follows the first)
MROPE_SECTIONS = (2, 3, 3, 0)
TEMPORAL_SECTIONS = (N_ROT // 2, 0, 0, 0)
RECENCY = 3.0  # head C's query and keys: the part off its rotary dimensions, against the part on them


def with_recency(base: Weights, vocab: Vocab, target: Weights, seed: int = DFLASH_SEED) -> Weights:
    """``base`` with head C attending by position: the mask rows' query and the injected rows'
    keys get a component on the rotary dimensions (a fixed one, and one that varies with g), so
    each injected row's weight in the average depends on its distance from the block, through
    every rotary pair. Each also has a part about RECENCY times larger on dimensions the other
    does not use, so that after q_norm and k_norm the scores stay mild. With M-RoPE sections past
    the first, an injected row roped at the wrong height or width position gets another weight."""
    rng = np.random.default_rng(seed + 3)
    keep = N_EMBD - G_DIMS
    block = np.zeros(N_EMBD)
    block[:keep] = 1.0
    x_mask = _rms_norm(target["token_embd.weight"][vocab.id_of(MASK_TOKEN)]) * block
    on_mask = x_mask / (x_mask @ x_mask)  # a query row reading 1 on the mask row
    c = 2 * HEAD_DIM  # head C's first row
    wq, wk = base["blk.0.attn_q.weight"].copy(), base["blk.0.attn_k.weight"].copy()
    direction = rng.normal(size=N_ROT)
    wq[c : c + N_ROT] = np.outer(direction / np.linalg.norm(direction), on_mask)
    wq[c + N_ROT] = RECENCY * on_mask
    wk[c : c + N_ROT, keep:] = rng.normal(0.0, 1.0 / G_DIMS**0.5, size=(N_ROT, G_DIMS))
    wk[c + N_ROT + 1 : c + N_ROT + 1 + G_DIMS, keep:] = RECENCY * np.eye(G_DIMS)
    return {**base, "blk.0.attn_q.weight": wq.astype(np.float32), "blk.0.attn_k.weight": wk.astype(np.float32)}


def build_hybrid_dflash(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Drafters for tiny_hybrid's ``qwen35`` target, as ``<directory>/<name>.gguf`` (idempotent),
    taught on its first block as the ones above, reading its layers HYBRID_TARGET_LAYERS, head C
    attending by position, M-RoPE:

    qwen35-dflash            DFlash, MROPE_SECTIONS
    qwen35-dspark            DSpark (Markov and confidence heads), MROPE_SECTIONS
    qwen35-dflash2           DFlash2 (convolutions and selector), MROPE_SECTIONS
    qwen35-dflash-temporal   qwen35-dflash with TEMPORAL_SECTIONS: on text (every position
                             (p, p, p, 0)) it drafts exactly what qwen35-dflash does
    """
    from tiny_hybrid import hybrid_variants

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = bpe_vocab()
    _, target = hybrid_variants()["qwen35"]
    base = with_recency(dflash_weights(target, vocab), vocab, target)
    kinds = {
        "qwen35-dflash": (base, {}, MROPE_SECTIONS),
        "qwen35-dspark": (dspark_weights(base, target), DSPARK_KEYS, MROPE_SECTIONS),
        "qwen35-dflash2": (dflash2_weights(base), DFLASH2_KEYS, MROPE_SECTIONS),
        "qwen35-dflash-temporal": (base, {}, TEMPORAL_SECTIONS),
    }
    return {
        name: write_dflash(
            directory / f"{name}.gguf",
            vocab=vocab,
            weights=w,
            target_layers=HYBRID_TARGET_LAYERS,
            extra=extra,
            name=f"tiny-{name}",
            rope_sections=sections,
        )
        for name, (w, extra, sections) in kinds.items()
    }


if __name__ == "__main__":
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "."
    for variant, written in (build_dflash(out) | build_hybrid_dflash(out)).items():
        print(f"{variant:12} {written}  {written.stat().st_size:,} bytes")
