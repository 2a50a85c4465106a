"""Tiny qwen35 GGUF models with a built-in MTP head, for tests and scripts.

A qwen35 trunk (`TRUNK_LAYERS` blocks: gated-delta-net recurrent blocks and full-attention
blocks, `FULL_ATTENTION_INTERVAL` apart, as in Qwen3.5) followed by `nextn_predict_layers` MTP
blocks: each a full-attention decoder block with the `nextn.*` tensors (`eh_proj` mixes the
normed next-token embedding with the normed trunk state, `enorm`, `hnorm`) that llama.cpp's
qwen35 MTP graph reads (src/models/qwen35.cpp). Same tokenizer as tests/tiny_models.py; F32
weights from a seed, a few hundred KB.

Nobody trained the head, so on its own it would agree with the target at random. To give it
something to agree on, the trunk's blocks write weakly into the residual stream (TRUNK_SCALE),
so the target's next token depends mostly on the current one, and `mtp_weights(teach=True)`
makes the head pass the embedding of the token it is fed through its `eh_proj` while its own
block writes little: it then guesses what the target would say after that token, right about
40% of the time over a greedy run. The tests see accepts, rejects and near-ties alike.

(An all-attention qwen35, `full_attention_interval` 1, is no way around the recurrent state:
llama.cpp aborts on its empty recurrent cache.)

    paths = build_mtp(tmp_dir)      # {"mtp": Path, "mtp-stripped": Path}
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType
from tiny_models import CONTEXT_LENGTH, LOGIT_STD, N_EMBD, N_FF, N_HEAD, N_HEAD_KV, QK_STD, RMS_EPS, Vocab, bpe_vocab

ARCH = "qwen35"
HEAD_DIM = N_EMBD // N_HEAD  # 16
ROPE_SECTIONS = (3, 3, 2, 0)  # IMRoPE sections over the 16 rotated dims (pairs): text uses the first
SSM_STATE = 16  # head_k_dim = head_v_dim
SSM_GROUPS = 2  # key heads
SSM_DT_RANK = 4  # value heads
SSM_CONV = 4
SSM_INNER = SSM_DT_RANK * SSM_STATE  # value_dim
TRUNK_LAYERS = 3
FULL_ATTENTION_INTERVAL = 3  # blocks 0, 1 recurrent; block 2 full attention
TARGET_SEED = 11
# how strongly the trunk's blocks write into the residual stream: weakly, so the next token
# depends mostly on the current one and a head that reads the token's embedding can guess it
TRUNK_SCALE = 0.2


def _normal(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    return rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)


def _attention_block(rng: np.random.Generator, i: int, out_scale: float) -> dict[str, np.ndarray]:
    n_kv = N_HEAD_KV * HEAD_DIM
    return {
        f"blk.{i}.attn_norm.weight": np.ones(N_EMBD, np.float32),
        f"blk.{i}.post_attention_norm.weight": np.ones(N_EMBD, np.float32),
        # qwen35's query projection also yields the output gate: 2 x heads x head_dim
        f"blk.{i}.attn_q.weight": _normal(rng, 2 * N_HEAD * HEAD_DIM, N_EMBD, QK_STD / N_EMBD**0.5),
        f"blk.{i}.attn_k.weight": _normal(rng, n_kv, N_EMBD, QK_STD / N_EMBD**0.5),
        f"blk.{i}.attn_v.weight": _normal(rng, n_kv, N_EMBD, 1.0 / N_EMBD**0.5),
        f"blk.{i}.attn_output.weight": _normal(rng, N_EMBD, N_HEAD * HEAD_DIM, out_scale / N_EMBD**0.5),
        f"blk.{i}.attn_q_norm.weight": np.ones(HEAD_DIM, np.float32),
        f"blk.{i}.attn_k_norm.weight": np.ones(HEAD_DIM, np.float32),
        f"blk.{i}.ffn_gate.weight": _normal(rng, N_FF, N_EMBD, 1.0 / N_EMBD**0.5),
        f"blk.{i}.ffn_up.weight": _normal(rng, N_FF, N_EMBD, 1.0 / N_EMBD**0.5),
        f"blk.{i}.ffn_down.weight": _normal(rng, N_EMBD, N_FF, out_scale / N_FF**0.5),
    }


def _recurrent_block(rng: np.random.Generator, i: int, out_scale: float) -> dict[str, np.ndarray]:
    key_dim = SSM_STATE * SSM_GROUPS
    conv_dim = 2 * key_dim + SSM_INNER
    return {
        f"blk.{i}.attn_norm.weight": np.ones(N_EMBD, np.float32),
        f"blk.{i}.post_attention_norm.weight": np.ones(N_EMBD, np.float32),
        f"blk.{i}.attn_qkv.weight": _normal(rng, conv_dim, N_EMBD, 1.0 / N_EMBD**0.5),
        f"blk.{i}.attn_gate.weight": _normal(rng, SSM_INNER, N_EMBD, 1.0 / N_EMBD**0.5),
        f"blk.{i}.ssm_conv1d.weight": _normal(rng, conv_dim, SSM_CONV, 0.5),
        f"blk.{i}.ssm_dt.bias": np.zeros(SSM_DT_RANK, np.float32),
        f"blk.{i}.ssm_a": -np.ones(SSM_DT_RANK, np.float32),
        f"blk.{i}.ssm_beta.weight": _normal(rng, SSM_DT_RANK, N_EMBD, 1.0 / N_EMBD**0.5),
        f"blk.{i}.ssm_alpha.weight": _normal(rng, SSM_DT_RANK, N_EMBD, 1.0 / N_EMBD**0.5),
        f"blk.{i}.ssm_norm.weight": np.ones(SSM_STATE, np.float32),
        f"blk.{i}.ssm_out.weight": _normal(rng, N_EMBD, SSM_INNER, out_scale / SSM_INNER**0.5),
        f"blk.{i}.ffn_gate.weight": _normal(rng, N_FF, N_EMBD, 1.0 / N_EMBD**0.5),
        f"blk.{i}.ffn_up.weight": _normal(rng, N_FF, N_EMBD, 1.0 / N_EMBD**0.5),
        f"blk.{i}.ffn_down.weight": _normal(rng, N_EMBD, N_FF, out_scale / N_FF**0.5),
    }


def is_recurrent(i: int, interval: int = FULL_ATTENTION_INTERVAL) -> bool:
    return (i + 1) % interval != 0


def trunk_weights(seed: int, n_vocab: int, n_layer: int = TRUNK_LAYERS, interval: int = FULL_ATTENTION_INTERVAL) -> dict[str, np.ndarray]:
    """A qwen35 trunk: token embeddings, ``n_layer`` blocks, output norm and head."""
    rng = np.random.default_rng(seed)
    w = {"token_embd.weight": _normal(rng, n_vocab, N_EMBD, 1.0)}
    for i in range(n_layer):
        scale = TRUNK_SCALE if i == 0 else TRUNK_SCALE / 2
        w |= _recurrent_block(rng, i, scale) if is_recurrent(i, interval) else _attention_block(rng, i, scale)
    w["output_norm.weight"] = np.ones(N_EMBD, np.float32)
    w["output.weight"] = _normal(rng, n_vocab, N_EMBD, LOGIT_STD / N_EMBD**0.5)
    return w


def mtp_weights(seed: int, block: int, teach: bool = True) -> dict[str, np.ndarray]:
    """One MTP block ``blk.{block}``: a full-attention block plus the ``nextn.*`` tensors. With
    ``teach`` it leans on the trunk's state (see the module docstring)."""
    rng = np.random.default_rng(seed)
    w = _attention_block(rng, block, 0.2 if teach else 1.0)
    # eh_proj: [normed embedding ; normed state] (2 x n_embd) -> n_embd
    eh = _normal(rng, N_EMBD, 2 * N_EMBD, 0.3 / (2 * N_EMBD) ** 0.5)
    if teach:
        eh[:, :N_EMBD] += np.eye(N_EMBD, dtype=np.float32)  # pass the next token's embedding through
    w |= {
        f"blk.{block}.nextn.eh_proj.weight": eh,
        f"blk.{block}.nextn.enorm.weight": np.ones(N_EMBD, np.float32),
        f"blk.{block}.nextn.hnorm.weight": np.ones(N_EMBD, np.float32),
    }
    return w


def write_qwen35(
    path: str | os.PathLike[str],
    *,
    vocab: Vocab,
    weights: dict[str, np.ndarray],
    n_nextn: int,
    interval: int = FULL_ATTENTION_INTERVAL,
    name: str = "tiny-qwen35",
) -> Path:
    """Write a qwen35 GGUF (``n_nextn`` of its blocks MTP heads); rewrites only changed bytes."""
    path = Path(path)
    n_layer = len({k.split(".")[1] for k in weights if k.startswith("blk.")})
    arch = ARCH
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = GGUFWriter(tmp, arch)
    w.add_name(name)
    w.add_file_type(LlamaFileType.ALL_F32)
    w.add_vocab_size(len(vocab))
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_array(f"{arch}.rope.dimension_sections", list(ROPE_SECTIONS))
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_uint32(f"{arch}.ssm.conv_kernel", SSM_CONV)
    w.add_uint32(f"{arch}.ssm.inner_size", SSM_INNER)
    w.add_uint32(f"{arch}.ssm.state_size", SSM_STATE)
    w.add_uint32(f"{arch}.ssm.time_step_rank", SSM_DT_RANK)
    w.add_uint32(f"{arch}.ssm.group_count", SSM_GROUPS)
    w.add_uint32(f"{arch}.full_attention_interval", interval)
    if n_nextn:
        w.add_uint32(f"{arch}.nextn_predict_layers", n_nextn)

    w.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(list(vocab.tokens))
    w.add_token_types(list(vocab.types))
    if vocab.merges:
        w.add_token_merges(list(vocab.merges))
    for token_id, add in (
        (vocab.bos, w.add_bos_token_id),
        (vocab.eos, w.add_eos_token_id),
        (vocab.eot, w.add_eot_token_id),
        (vocab.pad, w.add_pad_token_id),
    ):
        if token_id is not None:
            add(token_id)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(False)
    if vocab.chat_template is not None:
        w.add_chat_template(vocab.chat_template)
    for tensor_name, t in weights.items():
        w.add_tensor(tensor_name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if path.exists() and path.read_bytes() == tmp.read_bytes():
        tmp.unlink()
    else:
        os.replace(tmp, path)
    return path


def build_mtp(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """The MTP variants, as ``<directory>/<name>.gguf`` (idempotent):

    mtp           hybrid trunk (2 recurrent + 1 attention block) and one taught MTP head
    mtp-stripped  the same trunk with the head and nextn_predict_layers removed (a stripped quant)
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = bpe_vocab()
    trunk = trunk_weights(TARGET_SEED, len(vocab))
    head = mtp_weights(TARGET_SEED + 1, TRUNK_LAYERS)
    return {
        "mtp": write_qwen35(directory / "mtp.gguf", vocab=vocab, weights=trunk | head, n_nextn=1, name="tiny-mtp"),
        "mtp-stripped": write_qwen35(directory / "mtp-stripped.gguf", vocab=vocab, weights=trunk, n_nextn=0, name="tiny-mtp-stripped"),
    }


if __name__ == "__main__":
    import sys

    for variant, written in build_mtp(sys.argv[1] if len(sys.argv) > 1 else ".").items():
        print(f"{variant:14} {written}  {written.stat().st_size:,} bytes")
