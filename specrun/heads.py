"""A model's own draft heads, from its GGUF header: what they are, and what they cost.

A model trained with multi-token prediction (MTP) ships its heads inside its own GGUF, as the
last ``{arch}.nextn_predict_layers`` of its ``{arch}.block_count`` blocks, each with
``blk.N.nextn.*`` tensors (``eh_proj``, ``enorm``, ``hnorm``, ...). llama.cpp loads them only
when asked (``load_mtp``) and runs them in a second context on the same model, whose KV cache
holds only those blocks. The trunk's own cache leaves them out, so a header's KV estimate over
every block (``ModelInfo.kv_bytes``) already counts the heads' cache, and its weights count
their tensors: :class:`Heads` says which part of each is theirs.

Nothing here loads weights: ``check-pair``, ``drafts``, ``inspect`` and ``models --scan`` read
it in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .modelinfo import ModelInfo

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
