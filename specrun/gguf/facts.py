"""What a GGUF header says about a model, as plain numbers: no weights are loaded."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from specrun.errors import BadModelFile
from specrun.gguf.architecture import EVERY_LAYER, Architecture, describe
from specrun.gguf.header import GGUFHeader, read_header

try:  # the file-type names (MOSTLY_Q4_K_M ...) live in gguf's constants
    from gguf import LlamaFileType
except ImportError:  # pragma: no cover - very old gguf
    LlamaFileType = None  # type: ignore[assignment]

MAX_LAYERS = 1024  # more layers than tensors is a corrupt header, beyond this even in a vocabulary-only file
# bytes per element of llama.cpp's KV-cache types (--cache-type-k/-v)
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@dataclass(frozen=True)
class LayerWeights:
    input: int  # stays on the CPU
    blocks: list[int]  # per repeating layer
    output: int
    tied_head: int  # bytes of token embeddings copied to the output layer's device when not the CPU


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """The one model record: what a GGUF header says about a model, as plain numbers.

    A header read now is a :class:`ModelInfo`: these facts and the header itself (token texts,
    tensors, heads per layer). One read on an earlier run is a ``catalog.Summary``: these facts
    and hashes of the vocabulary. The vocabulary rules (``compat``) and the whole-model memory
    estimate (``memory.estimate_local``) read these facts alone, so either serves; a placed
    estimate needs the tensors, so a ModelInfo."""

    path: Path
    file_size: int  # bytes on disk
    architecture: str
    name: str
    quant: str
    n_params: int
    weights_bytes: int
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int  # the largest, where layers differ
    n_ff: int
    kv_elems_per_token: int  # KV-cache elements one context position holds across all layers
    tokenizer_model: str
    tokenizer_pre: str | None
    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    pad_id: int | None
    add_bos: bool | None
    add_eos: bool | None

    def kv_bytes_per_token(self, cache_type: str = "f16") -> int:
        """KV-cache bytes one context position costs across all layers."""
        return int(self.kv_elems_per_token * CACHE_TYPE_BYTES[cache_type])

    def kv_bytes(self, n_ctx: int, cache_type: str = "f16") -> int:
        return self.kv_bytes_per_token(cache_type) * n_ctx

    def facts(self) -> dict[str, Any]:
        """These facts alone, by name: what a record that adds its own is built from."""
        return {f.name: getattr(self, f.name) for f in fields(ModelFacts)}


@dataclass(frozen=True, kw_only=True)
class ModelInfo(ModelFacts):
    """A header read now: the facts and what they come from."""

    n_head_kv: list[int]  # per layer
    head_dim_k: int
    head_dim_v: int
    sliding_window: int | None
    tokens: Any  # Sequence[str]; a StringArray for real files
    token_types: Any
    chat_template: str | None
    header: GGUFHeader
    arch: Architecture  # attention only, hybrid or recurrent; how a rejected draft is undone
    n_nextn: int = 0  # {arch}.nextn_predict_layers: built-in MTP heads, the last of the n_layer blocks (see heads.py)

    @property
    def state_bytes(self) -> int:
        """One copy of the recurrent state of one sequence (0 for attention only)."""
        return self.arch.state_bytes or 0

    def layer_weights(self) -> LayerWeights:
        """Weight bytes as llama.cpp places them: the input layer (token embeddings, always on
        the CPU), each repeating layer ``blk.N``, and the output layer (the output norm and
        head; a model with tied embeddings gets a copy of the token embeddings there)."""
        blocks = [0] * self.n_layer
        inp = out = 0
        has_head = False
        for t in self.header.tensors:
            name = t.name
            if name.startswith("blk."):
                i = name.split(".", 2)[1]
                if i.isdigit() and int(i) < self.n_layer:
                    blocks[int(i)] += t.nbytes
                    continue
            if name.startswith("output"):
                out += t.nbytes
                has_head = has_head or name == "output.weight"
            else:
                inp += t.nbytes  # token embeddings and the odd global tensor (rope factors, ...)
        embd = next((t.nbytes for t in self.header.tensors if t.name == "token_embd.weight"), 0)
        return LayerWeights(inp, blocks, out, 0 if has_head else embd)

    def kv_bytes_per_layer(self, n_ctx: int, cache_type: str = "f16") -> list[int]:
        per = CACHE_TYPE_BYTES[cache_type]
        dims = self.head_dim_k + self.head_dim_v
        cost = {h: int(h * dims * per) * n_ctx for h in set(self.n_head_kv)}  # a header may claim any number of layers
        return [cost[h] for h in self.n_head_kv]

    def special_tokens(self) -> dict[str, Any]:
        def show(i):
            if i is None:
                return None
            text = self.tokens[i] if 0 <= i < self.n_vocab else "<out of range>"
            return {"id": i, "text": text}

        return {
            "bos": show(self.bos_id),
            "eos": show(self.eos_id),
            "eot": show(self.eot_id),
            "pad": show(self.pad_id),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "file_size": self.file_size,
            "architecture": self.architecture,
            "name": self.name,
            "n_params": self.n_params,
            "n_layer": self.n_layer,
            "n_ctx_train": self.n_ctx_train,
            "n_embd": self.n_embd,
            "n_head": self.n_head,
            "n_head_kv": self.n_head_kv[0] if len(set(self.n_head_kv)) == 1 else self.n_head_kv,
            "head_dim": self.head_dim_k,
            "n_ff": self.n_ff,
            "quant": self.quant,
            "weights_bytes": self.weights_bytes,
            "tokenizer": {
                "model": self.tokenizer_model,
                "pre": self.tokenizer_pre,
                "n_vocab": self.n_vocab,
                "add_bos": self.add_bos,
                "add_eos": self.add_eos,
                "special": self.special_tokens(),
            },
            "chat_template": self.chat_template is not None,
            "kv_bytes_per_1k_ctx": self.kv_bytes(1024),
            "memory": self.arch.to_json(),
        }


def _int(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)):
        return int(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    return None


def _bool(v: Any) -> bool | None:
    return None if v is None else bool(v)


def quant_name(header: GGUFHeader) -> str:
    ft = header.get("general.file_type")
    if ft is not None and LlamaFileType is not None:
        try:
            return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    # fall back to the most common type among the 2-D weights
    counts: dict[str, int] = {}
    for t in header.tensors:
        if len(t.shape) >= 2:
            counts[t.type_name] = counts.get(t.type_name, 0) + t.nbytes
    return max(counts, key=counts.get) if counts else "unknown"


def model_info(path_or_header: str | Path | GGUFHeader) -> ModelInfo:
    h = path_or_header if isinstance(path_or_header, GGUFHeader) else read_header(path_or_header)
    arch = str(h.get("general.architecture", "unknown"))

    def a(key: str, default: Any = None) -> Any:
        return h.get(f"{arch}.{key}", default)

    n_layer = _int(a("block_count")) or 0
    if n_layer > max(len(h.tensors), MAX_LAYERS):  # every layer has tensors; the largest models have ~130 layers
        raise BadModelFile(
            f"{h.path.name} is not a valid GGUF file: it claims {n_layer} layers but holds {len(h.tensors)} tensors",
            "re-download or re-convert the model",
        )
    n_embd = _int(a("embedding_length")) or 0
    raw_head = a("attention.head_count", 0)
    n_head = int(np.max(raw_head)) if isinstance(raw_head, np.ndarray) else (_int(raw_head) or 0)
    raw_kv = a("attention.head_count_kv", n_head)
    if isinstance(raw_kv, np.ndarray):
        n_head_kv = [int(x) for x in raw_kv[:n_layer]]
    else:
        n_head_kv = [_int(raw_kv) or n_head] * n_layer
    head_dim = n_embd // n_head if n_head else 0
    arch_info = describe(h, n_layer)
    if arch_info.recurrent_layers is not None and arch_info.kind == "hybrid" and arch not in EVERY_LAYER:
        # only the attention layers of a hybrid have a KV cache (qwen35 writes one head count for all)
        # the MTP blocks after them attend: their cache is the heads' context's (counted here
        # with the target's, as loading the heads adds it; see heads.py)
        recurrent = list(arch_info.recurrent_layers) + [False] * (n_layer - len(arch_info.recurrent_layers))
        n_head_kv = [0 if r else kv for kv, r in zip(n_head_kv, recurrent)]
    head_dim_k = _int(a("attention.key_length")) or head_dim
    head_dim_v = _int(a("attention.value_length")) or head_dim
    tokens = h.get("tokenizer.ggml.tokens", [])
    ff = a("feed_forward_length", 0)
    return ModelInfo(
        path=h.path,
        file_size=h.file_size,
        architecture=arch,
        name=str(h.get("general.name", h.path.stem)),
        n_params=sum(t.n_elements for t in h.tensors),
        n_layer=n_layer,
        n_ctx_train=_int(a("context_length")) or 0,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        kv_elems_per_token=sum(kv * (head_dim_k + head_dim_v) for kv in n_head_kv),
        n_ff=int(np.max(ff)) if isinstance(ff, np.ndarray) else (_int(ff) or 0),
        sliding_window=_int(a("attention.sliding_window")),
        quant=quant_name(h),
        weights_bytes=sum(t.nbytes for t in h.tensors),
        tokenizer_model=str(h.get("tokenizer.ggml.model", "none")),
        tokenizer_pre=h.get("tokenizer.ggml.pre"),
        n_vocab=len(tokens),
        tokens=tokens,
        token_types=h.get("tokenizer.ggml.token_type"),
        bos_id=_int(h.get("tokenizer.ggml.bos_token_id")),
        eos_id=_int(h.get("tokenizer.ggml.eos_token_id")),
        eot_id=_int(h.get("tokenizer.ggml.eot_token_id")),
        pad_id=_int(h.get("tokenizer.ggml.padding_token_id")),
        add_bos=_bool(h.get("tokenizer.ggml.add_bos_token")),
        add_eos=_bool(h.get("tokenizer.ggml.add_eos_token")),
        chat_template=h.get("tokenizer.chat_template"),
        header=h,
        arch=arch_info,
        n_nextn=_int(a("nextn_predict_layers")) or 0,
    )
