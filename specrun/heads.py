"""A model's own draft heads, from its GGUF header: what they are, and what they cost.

A model trained with multi-token prediction (MTP) ships its heads inside its own GGUF, as the
last ``{arch}.nextn_predict_layers`` of its ``{arch}.block_count`` blocks, each with
``blk.N.nextn.*`` tensors (``eh_proj``, ``enorm``, ``hnorm``, ...). llama.cpp loads them only
when asked (``load_mtp``) and runs them in a second context on the same model, whose KV cache
holds only those blocks. The trunk's own cache leaves them out, so a header's KV estimate over
every block (``ModelInfo.kv_bytes``) already counts the heads' cache, and its weights count
their tensors: :class:`Heads` says which part of each is theirs.

An EAGLE-3 head is a file of its own (arch ``eagle3``), trained for one target: :class:`Eagle3`
says for which (its hidden size and the layers it reads), so a wrong pairing is refused before
anything loads.

Nothing here loads weights: ``check-pair``, ``drafts``, ``inspect`` and ``models --scan`` read
it in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .modelinfo import ModelFacts, ModelInfo

# architectures llama.cpp (at the vendored commit) has an MTP graph for; their released
# checkpoints usually ship the heads, so a file of one of them without heads lost them in
# conversion or quantization
MTP_ARCHS = frozenset(
    {
        "qwen35", "qwen35moe", "qwen3next", "glm4moe", "glm-dsa", "glm5-next", "deepseek2", "deepseek32",
        "deepseek4", "step35", "mimo2", "hy_v3", "bailingmoe3", "cohere2moe", "nemotron_h_moe",
    }
)  # fmt: skip
# of those, the ones whose several heads are chained, one per draft position (llama.cpp's
# chain mode: a draft is at most as long as the heads are many)
CHAINED_ARCHS = frozenset({"step35", "mimo2", "hy_v3"})


@dataclass(frozen=True)
class Heads:
    """The MTP heads a target carries (``count`` 0: none)."""

    architecture: str
    count: int  # {arch}.nextn_predict_layers
    first_block: int  # blk.N of the first head (the heads are the last blocks)
    weights_bytes: int  # their tensors
    kv_bytes_per_token: int  # their KV cache (f16), per context position
    supported: bool  # llama.cpp has an MTP graph for this architecture

    @property
    def chained(self) -> bool:
        """Several heads run one per draft position (so a draft is at most ``count`` long)."""
        return self.count > 1 and self.architecture in CHAINED_ARCHS

    @property
    def max_draft(self) -> int | None:
        """The longest draft the heads can make; None: no bound (one head fed back its own state)."""
        return self.count if self.chained else None

    def kv_bytes(self, n_ctx: int) -> int:
        return self.kv_bytes_per_token * n_ctx

    def memory(self, n_ctx: int) -> int:
        """Weights plus KV cache at ``n_ctx``: what loading them adds to the target."""
        return self.weights_bytes + self.kv_bytes(n_ctx)

    @property
    def usable(self) -> bool:
        return self.count > 0 and self.supported

    def describe(self) -> str:
        """'built-in MTP: 1 head', or why there are none to use."""
        if self.count == 0:
            return "built-in MTP: none"
        n = f"{self.count} head{'s' if self.count > 1 else ''}"
        if not self.supported:
            return f"built-in MTP: {n}, but llama.cpp has no MTP graph for {self.architecture}"
        return f"built-in MTP: {n}" + (" (chained, one per draft position)" if self.chained else "")

    def stripped_note(self) -> str | None:
        """For a file of a family that usually ships heads but has none, a note saying so."""
        if self.count == 0 and self.supported:
            return (
                f"{self.architecture} models usually ship MTP heads, but this file has none "
                "(nextn_predict_layers is 0): the conversion or quant may have stripped them"
            )
        return None

    def to_json(self) -> dict:
        return {
            "count": self.count,
            "first_block": self.first_block if self.count else None,
            "weights_bytes": self.weights_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "supported": self.supported,
            "chained": self.chained,
            "note": self.stripped_note(),
        }


def heads_of(m: ModelInfo) -> Heads:
    """The MTP heads ``m``'s header declares (their bytes from the tensors of those blocks)."""
    count = max(0, min(m.n_nextn, m.n_layer))
    first = m.n_layer - count
    prefixes = tuple(f"blk.{i}." for i in range(first, m.n_layer))
    weights = sum(t.nbytes for t in m.header.tensors if count and t.name.startswith(prefixes))
    per = m.head_dim_k + m.head_dim_v
    kv = sum(int(h * per * 2) for h in m.n_head_kv[first : m.n_layer]) if count else 0
    return Heads(m.architecture, count, first, weights, kv, m.architecture in MTP_ARCHS)


# --- EAGLE-3 heads: a file of their own, for one target ----------------------------------------

EAGLE3_ARCH = "eagle3"


@dataclass(frozen=True)
class Eagle3:
    """What an EAGLE-3 head's header (arch ``eagle3``) says about the target it was trained for.

    Such a head drafts from three of its target's layer inputs at each position, fused by its
    own encoder (``fc``); its decoder borrows the target's token embeddings and output head
    where the file has none. So it serves only a target of the hidden size it was trained on
    (``eagle3.target_hidden_size``) with the layers it reads (``eagle3.target_layers``), and,
    like any draft, the target's vocabulary."""

    target_layers: tuple[int, ...]
    target_hidden: int
    own_embeddings: bool  # token_embd in the file (else the target's)
    own_output: bool  # output in the file (else the target's head)
    draft_vocab: int | None  # d2t: the head guesses among this many tokens, mapped to the target's (None: all)

    def describe(self) -> str:
        """'EAGLE-3 head for a 4096-wide target (reads its layers 2, 16, 29)'."""
        layers = ", ".join(str(i) for i in self.target_layers)
        return f"EAGLE-3 head for a {self.target_hidden}-wide target (reads its layers {layers})"

    def mismatch(self, t: ModelFacts) -> str | None:
        """Why this head cannot draft for target ``t`` (from headers), or None. llama.cpp can
        also read a target's final state as the layer n_layer, through its MTP output; specrun
        reads layer inputs only."""
        if t.architecture == EAGLE3_ARCH:
            return f"{t.path.name} is an EAGLE-3 head itself, not a target"
        if self.target_hidden != t.n_embd:
            return f"it was trained for a {self.target_hidden}-wide target, and {t.path.name} is {t.n_embd} wide"
        if len(self.target_layers) != 3:
            return f"it names {len(self.target_layers)} target layers (llama.cpp's EAGLE-3 reads exactly 3)"
        beyond = [i for i in self.target_layers if not 0 <= i < t.n_layer]
        if beyond:
            return f"it reads the target's layers {list(self.target_layers)}, and {t.path.name} has {t.n_layer} (0..{t.n_layer - 1})"
        return None

    def to_json(self) -> dict:
        return {
            "target_layers": list(self.target_layers),
            "target_hidden_size": self.target_hidden,
            "own_embeddings": self.own_embeddings,
            "own_output": self.own_output,
            "draft_vocab": self.draft_vocab,
        }

    @classmethod
    def from_json(cls, d: dict) -> Eagle3:
        return cls(tuple(int(i) for i in d["target_layers"]), int(d["target_hidden_size"]), bool(d["own_embeddings"]),
                   bool(d["own_output"]), None if d["draft_vocab"] is None else int(d["draft_vocab"]))  # fmt: skip


def eagle3_of(m: ModelInfo) -> Eagle3 | None:
    """The EAGLE-3 head ``m``'s header describes (None: ``m`` is not one)."""
    if m.architecture != EAGLE3_ARCH:
        return None
    raw = m.header.get(f"{EAGLE3_ARCH}.target_layers")
    layers = tuple(int(i) for i in raw) if raw is not None and not isinstance(raw, (str, bytes)) else ()
    hidden = m.header.get(f"{EAGLE3_ARCH}.target_hidden_size")
    tensors = {t.name: t for t in m.header.tensors}
    d2t = tensors.get("d2t")
    return Eagle3(
        layers,
        int(hidden) if isinstance(hidden, (int, np.integer)) else 0,
        "token_embd.weight" in tensors,
        "output.weight" in tensors,
        int(d2t.shape[0]) if d2t is not None else None,
    )
