"""Llama-shaped GGUF headers with no file behind them, the sizes of the real 70B, 8B and 1B
Q4_K_M models, and NVML answers for made-up GPUs: the inputs of the memory and placement
tests (test_memory.py, test_placement.py)."""

from __future__ import annotations

from pathlib import Path

from specrun.fit.memory import Gpu, GpuQuery
from specrun.gguf.facts import ModelInfo, model_info
from specrun.gguf.header import GGUFHeader, TensorInfo

GiB = 1 << 30

Q4_K, Q6_K, F32 = 12, 14, 0
BLOCK = {Q4_K: (256, 144), Q6_K: (256, 210), F32: (1, 4)}


def llama_like(name: str, n_layer: int, n_embd: int, n_ff: int, n_head: int, n_kv: int, tokens: list[str]) -> GGUFHeader:
    """A Llama-3-shaped GGUF header (Q4_K_M-like types), with no file behind it."""
    hd = n_embd // n_head
    tensors: list[TensorInfo] = []

    def add(tname: str, shape: tuple[int, ...], t: int) -> None:
        per, size = BLOCK[t]
        n = 1
        for d in shape:
            n *= d
        tensors.append(TensorInfo(tname, shape, t, 0, n // per * size))

    add("token_embd.weight", (n_embd, len(tokens)), Q4_K)
    for i in range(n_layer):
        add(f"blk.{i}.attn_norm.weight", (n_embd,), F32)
        add(f"blk.{i}.attn_q.weight", (n_embd, n_embd), Q4_K)
        add(f"blk.{i}.attn_k.weight", (n_embd, n_kv * hd), Q4_K)
        add(f"blk.{i}.attn_v.weight", (n_embd, n_kv * hd), Q6_K)
        add(f"blk.{i}.attn_output.weight", (n_embd, n_embd), Q4_K)
        add(f"blk.{i}.ffn_norm.weight", (n_embd,), F32)
        add(f"blk.{i}.ffn_gate.weight", (n_embd, n_ff), Q4_K)
        add(f"blk.{i}.ffn_up.weight", (n_embd, n_ff), Q4_K)
        add(f"blk.{i}.ffn_down.weight", (n_ff, n_embd), Q6_K)
    add("output_norm.weight", (n_embd,), F32)
    add("output.weight", (n_embd, len(tokens)), Q6_K)
    meta = {
        "general.architecture": "llama",
        "general.name": name,
        "general.file_type": 15,  # Q4_K_M
        "llama.block_count": n_layer,
        "llama.embedding_length": n_embd,
        "llama.feed_forward_length": n_ff,
        "llama.attention.head_count": n_head,
        "llama.attention.head_count_kv": n_kv,
        "llama.context_length": 131072,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    size = sum(t.nbytes for t in tensors)
    return GGUFHeader(Path(f"{name}.gguf"), 3, size, 32, 0, meta, tensors)


def big_models() -> dict[str, ModelInfo]:
    tokens = [f"t{i}" for i in range(128256)]
    return {
        "70b": model_info(llama_like("llama-70b", 80, 8192, 28672, 64, 8, tokens)),
        "8b": model_info(llama_like("llama-8b", 32, 4096, 14336, 32, 8, tokens)),
        "1b": model_info(llama_like("llama-1b", 16, 2048, 8192, 32, 8, tokens)),
    }


def gpus(*free_total: tuple[float, float]) -> GpuQuery:
    return GpuQuery([Gpu(i, "RTX 4090", int(t * GiB), int(f * GiB)) for i, (f, t) in enumerate(free_total)], driver="555.0")
