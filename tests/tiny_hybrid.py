"""Tiny, deterministic hybrid GGUF models (attention plus a recurrent state) that the real
llama.cpp loads, for tests and scripts. They share tiny_models' BPE vocabulary, width (64),
heads (4 query, 2 KV) and FFN (128), so every tiny llama model can draft for them and back.

Each architecture alternates a recurrent layer and an attention layer (4 layers: recurrent,
attention, recurrent, attention), the layout llama.cpp reads from each architecture's keys:

    qwen35         gated delta-net + gated attention (Qwen3.5/3.6). llama.cpp keeps state
                   snapshots for it (``n_rs_seq``). With ``mtp=True`` a fifth block carries
                   one MTP (NextN) head: ``qwen35.nextn_predict_layers = 1``.
    lfm2           short convolutions + attention (LFM2). Snapshots too.
    granitehybrid  Mamba-2 + attention (Granite-4.0-H). No snapshots: rollback needs a
                   checkpoint of the state.

The recurrent state one sequence holds, per recurrent layer, in f32 (what llama.cpp sizes
its ``cache_r``/``cache_s`` rows with; see STATE_BYTES for the figures of these shapes):

    delta-net   conv (d_conv - 1) x (d_inner + 2 n_group d_state)  +  ssm d_state x d_inner
    short conv  (l_cache - 1) x n_embd
    Mamba-2     conv (d_conv - 1) x (d_inner + 2 n_group d_state)  +  ssm d_state x d_inner

    paths = build_hybrid(tmp_dir)   # {"qwen35": Path, "qwen35-draft-copy": Path, ...}
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tiny_models import (
    HEAD_DIM,
    LATER_LAYER_SCALE,
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
    perturbed,
    settle,
    write_tensors,
)

N_LAYER = 4
RECURRENT = (True, False, True, False)  # layer i is recurrent? (attention every second layer)

# qwen35's gated delta-net: 2 key heads and 4 value heads of 16, a 4-wide causal convolution
QWEN35_D_STATE, QWEN35_N_GROUP, QWEN35_DT_RANK, QWEN35_D_CONV = 16, 2, 4, 4
QWEN35_D_INNER = QWEN35_D_STATE * QWEN35_DT_RANK  # 64: value heads x head size
QWEN35_ROPE_SECTIONS = (3, 3, 2, 0)  # multimodal RoPE sections, summing to HEAD_DIM / 2
# lfm2's short convolution: a 3-tap causal filter
LFM2_L_CACHE = 3
# granitehybrid's Mamba-2: inner size 2 x n_embd (the only expansion llama.cpp supports), 8 heads
MAMBA_D_INNER, MAMBA_D_STATE, MAMBA_N_GROUP, MAMBA_DT_RANK, MAMBA_D_CONV = 2 * N_EMBD, 16, 1, 8, 4

ARCHS = ("qwen35", "lfm2", "granitehybrid")
SNAPSHOT_ARCHS = ("qwen35", "lfm2")  # llm_arch_supports_rs_rollback in llama.cpp


def _conv_ssm_state(d_conv: int, d_inner: int, n_group: int, d_state: int) -> int:
    return (d_conv - 1) * (d_inner + 2 * n_group * d_state) + d_state * d_inner


# f32 elements of one recurrent layer's state, worked out by hand from the shapes above
STATE_ELEMS = {
    "qwen35": _conv_ssm_state(QWEN35_D_CONV, QWEN35_D_INNER, QWEN35_N_GROUP, QWEN35_D_STATE),  # 3*128 + 1024
    "lfm2": (LFM2_L_CACHE - 1) * N_EMBD,  # 128
    "granitehybrid": _conv_ssm_state(MAMBA_D_CONV, MAMBA_D_INNER, MAMBA_N_GROUP, MAMBA_D_STATE),  # 3*160 + 2048
}
STATE_BYTES = {arch: 4 * n * sum(RECURRENT) for arch, n in STATE_ELEMS.items()}  # the whole model's, one copy


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return rng.normal(0.0, std, size=shape).astype(np.float32)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, np.float32)


def _ffn(rng: np.random.Generator, i: int, scale: float) -> Weights:
    return {
        f"blk.{i}.ffn_gate.weight": _normal(rng, (N_FF, N_EMBD), 1.0 / N_EMBD**0.5),
        f"blk.{i}.ffn_up.weight": _normal(rng, (N_FF, N_EMBD), 1.0 / N_EMBD**0.5),
        f"blk.{i}.ffn_down.weight": _normal(rng, (N_EMBD, N_FF), scale / N_FF**0.5),
    }


def _attention(rng: np.random.Generator, i: int, scale: float, q_width: int) -> Weights:
    """Q (``q_width`` rows: qwen35's carry a gate too), K, V and the output projection."""
    n_kv = N_HEAD_KV * HEAD_DIM
    return {
        f"blk.{i}.attn_q.weight": _normal(rng, (q_width, N_EMBD), QK_STD / N_EMBD**0.5),
        f"blk.{i}.attn_k.weight": _normal(rng, (n_kv, N_EMBD), QK_STD / N_EMBD**0.5),
        f"blk.{i}.attn_v.weight": _normal(rng, (n_kv, N_EMBD), 1.0 / N_EMBD**0.5),
        f"blk.{i}.attn_output.weight": _normal(rng, (N_EMBD, N_HEAD * HEAD_DIM), scale / N_EMBD**0.5),
    }


def _head(rng: np.random.Generator, n_vocab: int) -> Weights:
    return {"output.weight": _normal(rng, (n_vocab, N_EMBD), LOGIT_STD / N_EMBD**0.5)}


def _decays(rng: np.random.Generator, n: int) -> np.ndarray:
    """A negative rate per head (llama.cpp stores -exp(A_log)): the state decays, never grows."""
    return (-np.exp(rng.uniform(-1.0, 0.5, size=n))).astype(np.float32)


def qwen35_weights(seed: int, n_vocab: int, mtp: bool = False) -> Weights:
    """A 4-block qwen35 (delta-net, attention, delta-net, attention); ``mtp`` adds block 4, an
    MTP head: a full-attention block plus the NextN projections (llama.cpp's qwen35 loader)."""
    rng = np.random.default_rng(seed)
    key_dim, value_dim = QWEN35_D_STATE * QWEN35_N_GROUP, QWEN35_D_INNER
    conv_dim = 2 * key_dim + value_dim
    w: Weights = {"token_embd.weight": _normal(rng, (n_vocab, N_EMBD), 1.0)}

    def attention_block(i: int, scale: float) -> Weights:
        return {
            **_attention(rng, i, scale, 2 * N_HEAD * HEAD_DIM),  # query and its gate
            f"blk.{i}.attn_q_norm.weight": _ones(HEAD_DIM),
            f"blk.{i}.attn_k_norm.weight": _ones(HEAD_DIM),
        }

    for i in range(N_LAYER):
        scale = 1.0 if i == 0 else LATER_LAYER_SCALE
        w |= {f"blk.{i}.attn_norm.weight": _ones(N_EMBD), f"blk.{i}.post_attention_norm.weight": _ones(N_EMBD)}
        if RECURRENT[i]:
            w |= {
                f"blk.{i}.attn_qkv.weight": _normal(rng, (conv_dim, N_EMBD), 1.0 / N_EMBD**0.5),
                f"blk.{i}.attn_gate.weight": _normal(rng, (value_dim, N_EMBD), 1.0 / N_EMBD**0.5),
                f"blk.{i}.ssm_conv1d.weight": _normal(rng, (conv_dim, QWEN35_D_CONV), 1.0 / QWEN35_D_CONV**0.5),
                f"blk.{i}.ssm_dt.bias": _normal(rng, (QWEN35_DT_RANK,), 0.5),
                f"blk.{i}.ssm_a": _decays(rng, QWEN35_DT_RANK),
                f"blk.{i}.ssm_beta.weight": _normal(rng, (QWEN35_DT_RANK, N_EMBD), 1.0 / N_EMBD**0.5),
                f"blk.{i}.ssm_alpha.weight": _normal(rng, (QWEN35_DT_RANK, N_EMBD), 1.0 / N_EMBD**0.5),
                f"blk.{i}.ssm_norm.weight": _ones(QWEN35_D_STATE),
                f"blk.{i}.ssm_out.weight": _normal(rng, (N_EMBD, value_dim), scale / value_dim**0.5),
            }
        else:
            w |= attention_block(i, scale)
        w |= _ffn(rng, i, scale)
    w["output_norm.weight"] = _ones(N_EMBD)
    w |= _head(rng, n_vocab)
    if mtp:
        i = N_LAYER
        w |= {f"blk.{i}.attn_norm.weight": _ones(N_EMBD), f"blk.{i}.post_attention_norm.weight": _ones(N_EMBD)}
        w |= attention_block(i, 1.0)
        w |= _ffn(rng, i, 1.0)
        w |= {
            f"blk.{i}.nextn.eh_proj.weight": _normal(rng, (N_EMBD, 2 * N_EMBD), 1.0 / (2 * N_EMBD) ** 0.5),
            f"blk.{i}.nextn.enorm.weight": _ones(N_EMBD),
            f"blk.{i}.nextn.hnorm.weight": _ones(N_EMBD),
            f"blk.{i}.nextn.shared_head_norm.weight": _ones(N_EMBD),
        }
    return w


def lfm2_weights(seed: int, n_vocab: int) -> Weights:
    """A 4-block lfm2: short convolution, attention, short convolution, attention."""
    rng = np.random.default_rng(seed)
    w: Weights = {"token_embd.weight": _normal(rng, (n_vocab, N_EMBD), 1.0)}
    for i in range(N_LAYER):
        scale = 1.0 if i == 0 else LATER_LAYER_SCALE
        w |= {f"blk.{i}.attn_norm.weight": _ones(N_EMBD), f"blk.{i}.ffn_norm.weight": _ones(N_EMBD)}
        if RECURRENT[i]:
            w |= {
                f"blk.{i}.shortconv.conv.weight": _normal(rng, (N_EMBD, LFM2_L_CACHE), 1.0 / LFM2_L_CACHE**0.5),
                f"blk.{i}.shortconv.in_proj.weight": _normal(rng, (3 * N_EMBD, N_EMBD), 1.0 / N_EMBD**0.5),
                f"blk.{i}.shortconv.out_proj.weight": _normal(rng, (N_EMBD, N_EMBD), scale / N_EMBD**0.5),
            }
        else:
            w |= _attention(rng, i, scale, N_HEAD * HEAD_DIM)
            w |= {f"blk.{i}.attn_q_norm.weight": _ones(HEAD_DIM), f"blk.{i}.attn_k_norm.weight": _ones(HEAD_DIM)}
        w |= _ffn(rng, i, scale)
    w["token_embd_norm.weight"] = _ones(N_EMBD)  # lfm2's output norm
    w |= _head(rng, n_vocab)
    return w


def granite_hybrid_weights(seed: int, n_vocab: int) -> Weights:
    """A 4-block granitehybrid: Mamba-2, attention, Mamba-2, attention."""
    rng = np.random.default_rng(seed)
    xbc = MAMBA_D_INNER + 2 * MAMBA_N_GROUP * MAMBA_D_STATE
    d_in_proj = MAMBA_D_INNER + xbc + MAMBA_DT_RANK  # z, then x B C, then dt
    w: Weights = {"token_embd.weight": _normal(rng, (n_vocab, N_EMBD), 1.0)}
    for i in range(N_LAYER):
        scale = 1.0 if i == 0 else LATER_LAYER_SCALE
        w |= {f"blk.{i}.attn_norm.weight": _ones(N_EMBD), f"blk.{i}.ffn_norm.weight": _ones(N_EMBD)}
        if RECURRENT[i]:
            w |= {
                f"blk.{i}.ssm_in.weight": _normal(rng, (d_in_proj, N_EMBD), 1.0 / N_EMBD**0.5),
                f"blk.{i}.ssm_conv1d.weight": _normal(rng, (xbc, MAMBA_D_CONV), 1.0 / MAMBA_D_CONV**0.5),
                f"blk.{i}.ssm_conv1d.bias": np.zeros(xbc, np.float32),
                f"blk.{i}.ssm_dt.bias": _normal(rng, (MAMBA_DT_RANK,), 0.5),
                f"blk.{i}.ssm_a": _decays(rng, MAMBA_DT_RANK).reshape(MAMBA_DT_RANK, 1),
                f"blk.{i}.ssm_d": _ones(MAMBA_DT_RANK).reshape(MAMBA_DT_RANK, 1),
                f"blk.{i}.ssm_norm.weight": np.ones((MAMBA_N_GROUP, MAMBA_D_INNER // MAMBA_N_GROUP), np.float32),
                f"blk.{i}.ssm_out.weight": _normal(rng, (N_EMBD, MAMBA_D_INNER), scale / MAMBA_D_INNER**0.5),
            }
        else:
            w |= _attention(rng, i, scale, N_HEAD * HEAD_DIM)
        w |= _ffn(rng, i, scale)
    w["output_norm.weight"] = _ones(N_EMBD)
    w |= _head(rng, n_vocab)
    return w


WEIGHTS = {"qwen35": qwen35_weights, "lfm2": lfm2_weights, "granitehybrid": granite_hybrid_weights}


def write_hybrid(path: str | os.PathLike[str], arch: str, *, vocab: Vocab, weights: Weights, name: str = "tiny") -> Path:
    """Write one hybrid GGUF of ``arch``; rewrites ``path`` only if its bytes would change."""
    path = Path(path)
    n_vocab = weights["token_embd.weight"].shape[0]
    if n_vocab != len(vocab):
        raise ValueError(f"weights are for {n_vocab} tokens, the vocabulary has {len(vocab)}")
    n_mtp = sum(1 for k in weights if k.endswith("nextn.eh_proj.weight"))
    w, tmp = begin(path, arch, name, n_vocab)
    w.add_block_count(N_LAYER + n_mtp)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    if arch == "qwen35":
        w.add_head_count_kv(N_HEAD_KV)
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_full_attention_interval(2)  # layers 1, 3 (and an MTP block) attend
        w.add_rope_dimension_sections(list(QWEN35_ROPE_SECTIONS))
        w.add_ssm_conv_kernel(QWEN35_D_CONV)
        w.add_ssm_inner_size(QWEN35_D_INNER)
        w.add_ssm_state_size(QWEN35_D_STATE)
        w.add_ssm_time_step_rank(QWEN35_DT_RANK)
        w.add_ssm_group_count(QWEN35_N_GROUP)
        if n_mtp:
            w.add_nextn_predict_layers(n_mtp)
    else:  # a layer with no KV heads is recurrent (lfm2, granitehybrid)
        w.add_head_count_kv([0 if r else N_HEAD_KV for r in RECURRENT])
    if arch == "lfm2":
        w.add_shortconv_l_cache(LFM2_L_CACHE)
    if arch == "granitehybrid":
        w.add_ssm_conv_kernel(MAMBA_D_CONV)
        w.add_ssm_inner_size(MAMBA_D_INNER)
        w.add_ssm_state_size(MAMBA_D_STATE)
        w.add_ssm_time_step_rank(MAMBA_DT_RANK)
        w.add_ssm_group_count(MAMBA_N_GROUP)
    write_tensors(w, vocab, weights)
    return settle(tmp, path)


def hybrid_variants() -> dict[str, tuple[str, Weights]]:
    """Every hybrid variant: name -> (architecture, weights). For each architecture: the
    target (seed TARGET_SEED + 10), ``-draft-copy`` (its exact weights: every greedy draft is
    accepted) and ``-draft`` (perturbed: accepted often, rejected sometimes)."""
    n_vocab = len(bpe_vocab())
    out: dict[str, tuple[str, Weights]] = {}
    for k, arch in enumerate(ARCHS):
        target = WEIGHTS[arch](TARGET_SEED + 10 + k, n_vocab)
        out[arch] = (arch, target)
        out[f"{arch}-draft-copy"] = (arch, target)
        out[f"{arch}-draft"] = (arch, perturbed(target, seed=TARGET_SEED + 110 + k))
    out["qwen35-mtp"] = ("qwen35", qwen35_weights(TARGET_SEED + 10, n_vocab, mtp=True))
    return out


def build_hybrid(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Write every hybrid variant as ``<directory>/<name>.gguf`` (idempotent); name -> path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = bpe_vocab()
    return {
        name: write_hybrid(directory / f"{name}.gguf", arch, vocab=vocab, weights=w, name=f"tiny-{name}")
        for name, (arch, w) in hybrid_variants().items()
    }


if __name__ == "__main__":
    import sys

    for variant, written in build_hybrid(sys.argv[1] if len(sys.argv) > 1 else ".").items():
        print(f"{variant:24} {written}  {written.stat().st_size:,} bytes")
