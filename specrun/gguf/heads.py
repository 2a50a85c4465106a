"""A model's own draft heads, from its GGUF header: what they are, and what they cost.

A model trained with multi-token prediction (MTP) ships its heads inside its own GGUF, as the
last ``{arch}.nextn_predict_layers`` of its ``{arch}.block_count`` blocks, each with
``blk.N.nextn.*`` tensors (``eh_proj``, ``enorm``, ``hnorm``, ...). llama.cpp loads them only
when asked (``load_mtp``) and runs them in a second context on the same model, whose KV cache
holds only those blocks. The trunk's own cache leaves them out, so a header's KV estimate over
every block (``ModelInfo.kv_bytes``) already counts the heads' cache, and its weights count
their tensors: :class:`Heads` says which part of each is theirs.

An EAGLE-3 head (arch ``eagle3``), Gemma 4's MTP assistant (arch ``gemma4-assistant``) and a
block drafter (arch ``dflash``: DFlash, DSpark or DFlash2) are files of their own, each trained
for one target: :class:`HeadFile` says for which (its hidden size, the layers it reads), so a
wrong pairing is refused before anything loads, and so is a file llama.cpp would fail or abort on.

Nothing here loads weights (of an EAGLE-3 head's tensors, only its ``d2t``, a list of token
ids, is read, to check it): ``check-pair``, ``drafts``, ``inspect`` and ``models --scan`` read
it in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrun.gguf.architecture import LIST_VERSION, hands_out_layer_inputs
from specrun.gguf.header import TensorInfo, tensor_bytes

if TYPE_CHECKING:
    from specrun.gguf.facts import ModelFacts, ModelInfo

# architectures llama.cpp (at the vendored commit) has an MTP graph for; their released
# checkpoints usually ship the heads, so a file of one of them without heads lost them in
# conversion or quantization
MTP_ARCHS = frozenset(
    {
        "qwen35", "qwen35moe", "qwen3next", "glm4moe", "glm-dsa", "glm5-next", "deepseek2", "deepseek32",
        "deepseek4", "step35", "mimo2", "hy_v3", "bailingmoe3", "cohere2moe", "nemotron_h_moe",
    }
)  # fmt: skip


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
        """Several heads run as a chain, head i making a draft's guess i, so a draft is at most
        ``count`` long (llama.cpp's rule, common/speculative.cpp: more than one head, in the
        target's file; step35, mimo2 and hy_v3 ship several)."""
        return self.count > 1

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
        return f"built-in MTP: {n}" + (", chained (one per draft position)" if self.chained else "")

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
    """The MTP heads ``m``'s header declares (their bytes from the tensors of those blocks). A
    head file (an assistant is all MTP blocks) has none of a trunk's: see :class:`HeadFile`."""
    count = max(0, min(m.n_nextn, m.n_layer)) if m.architecture not in HEAD_FILE_ARCHS else 0
    first = m.n_layer - count
    prefixes = tuple(f"blk.{i}." for i in range(first, m.n_layer))
    weights = sum(t.nbytes for t in m.header.tensors if count and t.name.startswith(prefixes))
    per = m.head_dim_k + m.head_dim_v
    kv = sum(int(h * per * 2) for h in m.n_head_kv[first : m.n_layer]) if count else 0
    return Heads(m.architecture, count, first, weights, kv, m.architecture in MTP_ARCHS)


# --- draft heads in a file of their own, for one target -----------------------------------------

# architecture -> (the draft source it is, the target architecture it serves; None: any)
HEAD_FILE_ARCHS = {"eagle3": ("eagle3", None), "gemma4-assistant": ("mtp", "gemma4"), "dflash": ("dflash", None)}
MAX_D2T = 1 << 22  # a d2t longer than this maps more tokens than any vocabulary has: not read
# block drafters, by the tensor that marks each (llama.cpp's common/speculative.cpp tells DSpark
# by its Markov head; src/models/dflash.cpp runs DFlash2's selector where it has one)
BLOCK_KINDS = {"dspark": "markov_w1.weight", "dflash2": "selector_hidden.weight"}
BLOCK_NAMES = {"dflash": "DFlash", "dspark": "DSpark", "dflash2": "DFlash2"}
DEFAULT_BLOCK = 16  # dflash.block_size where a file has none, as llama.cpp's loop assumes
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # each required, > 0
BESIDE = ("dflash", "dspark")  # a block drafter put beside its target is named so (any case), as llama.cpp looks for one


def named_beside(target: Path) -> list[Path]:
    """The GGUF files in ``target``'s folder named as block drafters are (``dflash*.gguf``,
    ``dspark*.gguf``), in name order; their headers say whether they are, and for which target.
    None where the folder cannot be read."""
    try:
        return sorted(p for p in target.parent.iterdir() if p.suffix.lower() == ".gguf" and p.name.lower().startswith(BESIDE))
    except OSError:
        return []


@dataclass(frozen=True)
class HeadFile:
    """What the header of a draft head shipped as a GGUF of its own says about the target it
    was trained for: an EAGLE-3 head (arch ``eagle3``) or Gemma 4's MTP assistant (arch
    ``gemma4-assistant``).

    An EAGLE-3 head drafts from three of its target's layer inputs at each position, fused by
    its own encoder, and borrows the target's token embeddings and output head where the file
    has none: it serves a target of the hidden size it was trained on
    (``eagle3.target_hidden_size``) that has the layers it reads (``eagle3.target_layers``).
    Gemma 4's assistant reads the target's final state (``{arch}.embedding_length_out`` wide)
    and attends over its KV cache: it serves a Gemma 4 target of that width. A block drafter
    (``kind`` dflash, dspark or dflash2) reads the target's inputs to the layers it names
    (``dflash.target_layers``), each as wide as the drafter itself, and drafts a block of
    ``block_size`` rows, all but the first the mask token: it serves a target of its own width
    that has those layers. Any of them, like any draft, needs the target's vocabulary."""

    architecture: str
    target_hidden: int
    target_layers: tuple[int, ...] = ()  # EAGLE-3: the target's layers it reads
    own_embeddings: bool = False  # token_embd in the file (EAGLE-3: else the target's)
    own_output: bool = False  # output in the file (EAGLE-3: else the target's head)
    draft_vocab: int | None = None  # EAGLE-3's d2t: it guesses among this many tokens, mapped to the target's
    d2t_top: int | None = None  # the largest target token id its d2t maps to
    d2t_fault: str | None = None  # what is wrong with its d2t by itself (llama.cpp would abort on it)
    # block drafters
    variant: str = ""  # dflash | dspark | dflash2
    block_size: int = 0  # rows of one block (dflash.block_size, else DEFAULT_BLOCK)
    mask_token: int | None = None  # tokenizer.ggml.mask_token_id
    n_vocab: int = 0  # tokens in its own tokenizer: each row of logits it hands out is this long
    anchor: bool = False  # DSpark sampling from the anchor: a block's first row guesses too
    fault: str | None = None  # what is wrong with the file by itself (llama.cpp would refuse or abort on it)

    @property
    def source(self) -> str:
        """The draft source it is: ``eagle3``, ``dflash``, or ``mtp`` (an assistant is MTP heads
        in a file)."""
        return HEAD_FILE_ARCHS[self.architecture][0]

    @property
    def kind(self) -> str:
        if self.source == "dflash":
            return f"a {BLOCK_NAMES.get(self.variant, 'DFlash')} drafter"
        return "an EAGLE-3 head" if self.source == "eagle3" else "Gemma 4's MTP assistant"

    @property
    def max_draft(self) -> int:
        """A block drafter's most drafts from one block: every row but the first (the last
        token's), or every row where the first guesses too (a DSpark drafter that samples from
        the anchor, llama.cpp's default for it)."""
        return self.block_size if self.anchor else max(0, self.block_size - 1)

    def describe(self) -> str:
        """'EAGLE-3 head for a 4096-wide target (reads its layers 2, 16, 29; guesses among 32000
        of its tokens, d2t)'."""
        layers = ", ".join(str(i) for i in self.target_layers)
        d2t = f"; guesses among {self.draft_vocab} of its tokens, d2t" if self.draft_vocab is not None else ""
        if self.source == "eagle3":
            return f"EAGLE-3 head for a {self.target_hidden}-wide target (reads its layers {layers}{d2t})"
        if self.source == "dflash":
            return (
                f"{BLOCK_NAMES.get(self.variant, 'DFlash')} block drafter for a {self.target_hidden}-wide target "
                f"(reads its layers {layers or 'none'}; blocks of {self.block_size}, up to {self.max_draft} drafts each{d2t})"
            )
        return f"Gemma 4 MTP assistant for a {self.target_hidden}-wide {HEAD_FILE_ARCHS[self.architecture][1]} target"

    def mismatch(self, t: ModelFacts) -> str | None:
        """Why this head cannot draft for target ``t`` (from headers), or None. (llama.cpp can
        also give an EAGLE-3 head a target's final state as the layer n_layer, through its MTP
        output; specrun reads layer inputs only.)"""
        want = HEAD_FILE_ARCHS[self.architecture][1]
        if self.fault is not None:
            return self.fault
        if t.architecture in HEAD_FILE_ARCHS:
            return f"{t.path.name} is a draft head itself, not a target"
        if want is not None and t.architecture != want:
            return f"it drafts for {want} targets, and {t.path.name} is {t.architecture}"
        if self.target_hidden != t.n_embd:
            return f"it was trained for a {self.target_hidden}-wide target, and {t.path.name} is {t.n_embd} wide"
        if self.source in ("eagle3", "dflash") and hands_out_layer_inputs(t.architecture) is False:
            return (
                f"it reads the target's layer inputs, which llama.cpp (llama-cpp-python {LIST_VERSION}) hands out only from some "
                f"architectures' graphs, not {t.architecture}'s (it would stop in an assert at the first decode)"
            )
        if self.source == "eagle3":
            if len(self.target_layers) != 3:
                return f"it names {len(self.target_layers)} target layers (llama.cpp's EAGLE-3 reads exactly 3)"
            if not all(0 <= i < t.n_layer for i in self.target_layers):
                return f"it reads the target's layers {list(self.target_layers)}, and {t.path.name} has {t.n_layer} (0..{t.n_layer - 1})"
            if self.draft_vocab is not None:
                return self._d2t_mismatch(t)
        if self.source == "dflash":
            if not all(0 <= i < t.n_layer for i in self.target_layers):
                return f"it reads the target's layers {list(self.target_layers)}, and {t.path.name} has {t.n_layer} (0..{t.n_layer - 1})"
            if self.n_vocab != t.n_vocab:  # llama.cpp would read rows of this length from the target's output head
                return f"it has {self.n_vocab} tokens, and {t.path.name} has {t.n_vocab}"
            if self.draft_vocab is not None:
                return self._d2t_mismatch(t)
        return None

    def _d2t_mismatch(self, t: ModelFacts) -> str | None:
        """Why llama.cpp could not scatter this head's guesses into ``t``'s vocabulary through its
        d2t (src/models/eagle3.cpp: one target id per row of its output head, written with
        ``ggml_set_rows`` into a row of -inf; an id past the row, or a row count that is not the
        head's, is an assert that ends the process), or None."""
        n = self.draft_vocab
        if self.d2t_fault is not None:
            return f"its d2t {self.d2t_fault}"
        if n is not None and n > t.n_vocab:
            return f"its d2t maps {n} tokens, more than the {t.n_vocab} of {t.path.name}"
        if self.d2t_top is not None and self.d2t_top >= t.n_vocab:
            return f"its d2t maps to token {self.d2t_top}, past the {t.n_vocab} tokens of {t.path.name}"
        if not self.own_output and n != t.n_vocab:
            return f"its d2t maps {n} tokens, and it has no output head of its own (the target's has {t.n_vocab} rows)"
        return None

    def to_json(self) -> dict:
        return {
            "architecture": self.architecture,
            "source": self.source,
            "target_hidden_size": self.target_hidden,
            "target_layers": list(self.target_layers),
            "own_embeddings": self.own_embeddings,
            "own_output": self.own_output,
            "draft_vocab": self.draft_vocab,
            "d2t_top": self.d2t_top,
            "d2t_fault": self.d2t_fault,
            "variant": self.variant,
            "block_size": self.block_size,
            "mask_token": self.mask_token,
            "n_vocab": self.n_vocab,
            "anchor": self.anchor,
            "fault": self.fault,
        }

    @classmethod
    def from_json(cls, d: dict) -> HeadFile:
        vocab, top, fault = d["draft_vocab"], d["d2t_top"], d["d2t_fault"]
        mask, own = d.get("mask_token"), d.get("fault")  # (a catalog entry from before block drafters has none)
        return cls(str(d["architecture"]), int(d["target_hidden_size"]), tuple(int(i) for i in d["target_layers"]),
                   bool(d["own_embeddings"]), bool(d["own_output"]), None if vocab is None else int(vocab),
                   None if top is None else int(top), None if fault is None else str(fault),
                   str(d.get("variant", "")), int(d.get("block_size", 0)), None if mask is None else int(mask),
                   int(d.get("n_vocab", 0)), bool(d.get("anchor", False)), None if own is None else str(own))  # fmt: skip


def head_file_of(m: ModelInfo) -> HeadFile | None:
    """The draft head ``m``'s header describes (None: ``m`` is not one)."""
    if m.architecture not in HEAD_FILE_ARCHS:
        return None
    arch = m.architecture
    tensors = {t.name: t for t in m.header.tensors}
    if HEAD_FILE_ARCHS[arch][0] == "mtp":  # the assistant's states are the target's final ones
        hidden = m.header.get(f"{arch}.embedding_length_out")
        return HeadFile(arch, int(hidden) if isinstance(hidden, (int, np.integer)) else 0, own_embeddings=True, own_output=True)
    layers = _ints(m.header.get(f"{arch}.target_layers"))
    hidden = m.header.get(f"{arch}.target_hidden_size")
    d2t = tensors.get("d2t")
    top, fault = _read_d2t(m, d2t, tensors.get("output.weight")) if d2t is not None else (None, None)
    head = HeadFile(
        arch,
        int(hidden) if isinstance(hidden, (int, np.integer)) else 0,
        layers or (),
        "token_embd.weight" in tensors,
        "output.weight" in tensors,
        int(d2t.shape[0]) if d2t is not None else None,
        top,
        fault,
    )
    return _block_drafter(m, head, layers, tensors) if HEAD_FILE_ARCHS[arch][0] == "dflash" else head


def _ints(raw: object) -> tuple[int, ...] | None:
    """An array of integers from the header (None: absent, or not integers)."""
    if raw is None or isinstance(raw, (str, bytes)):
        return None
    try:
        return tuple(int(i) for i in raw)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return None


def _block_drafter(m: ModelInfo, head: HeadFile, layers: tuple[int, ...] | None, tensors: dict[str, TensorInfo]) -> HeadFile:
    """``head`` (a dflash file read as any head file) as the block drafter it is: its kind, block,
    mask token, and what llama.cpp would refuse or abort on in it (the first such thing)."""
    h = m.header
    variant = next((v for v, marker in BLOCK_KINDS.items() if marker in tensors), "dflash")
    block, mask = h.get("dflash.block_size"), h.get("tokenizer.ggml.mask_token_id")
    anchor = variant == "dspark" and bool(h.get("dflash.sample_from_anchor", True))
    fc = tensors.get("fc.weight")
    fault = None
    if not layers:  # the loader throws without them; an empty list leaves the fusion nothing to read
        fault = "it names no target layers (dflash.target_layers), which llama.cpp needs to load it"
    elif not isinstance(mask, (int, np.integer)) or not 0 <= int(mask) < m.n_vocab:
        fault = "it has no mask token (tokenizer.ggml.mask_token_id) to fill its blocks with"
    elif block is None and variant == "dspark":  # the Markov head's graph asserts on it
        fault = "a DSpark drafter needs dflash.block_size, and it has none"
    elif block is not None and (not isinstance(block, (int, np.integer)) or int(block) < 2):
        fault = f"its blocks are {block} rows long (dflash.block_size): nothing to draft"
    elif fc is not None and tuple(fc.shape) != (len(layers) * m.n_embd, m.n_embd):
        fault = (
            f"its fc takes {fc.shape[0]}-wide features, and {len(layers)} layers of a {m.n_embd}-wide target are {len(layers) * m.n_embd}"
        )
    elif variant == "dflash2":
        fault = _dflash2_fault(m, block)
    return replace(
        head,
        target_hidden=m.n_embd,  # the fusion reads the target's layers at the drafter's own width
        variant=variant,
        block_size=int(block) if isinstance(block, (int, np.integer)) else DEFAULT_BLOCK,
        mask_token=int(mask) if isinstance(mask, (int, np.integer)) else None,
        n_vocab=m.n_vocab,
        anchor=anchor,
        fault=fault,
    )


def _dflash2_fault(m: ModelInfo, block: object) -> str | None:
    """What llama.cpp's loader refuses in a DFlash2 file (src/models/dflash.cpp), or None."""
    got = {k: m.header.get(f"dflash.{k}") for k in DFLASH2_KEYS}
    missing = [k for k, v in got.items() if not isinstance(v, (int, np.integer)) or v <= 0]
    if missing or block is None:
        return f"a DFlash2 drafter needs dflash.{', dflash.'.join(missing or ['block_size'])}, and it lacks them"
    group, top_k = int(got["conv_group_size"]), int(got["selector_top_k"])
    if m.n_embd % group:
        return f"its width {m.n_embd} is not a multiple of its conv_group_size {group}"
    if m.n_embd < top_k * (top_k + 1):
        return f"its width {m.n_embd} is too small for a selector of top-{top_k} (needs {top_k * (top_k + 1)})"
    return None


def _read_d2t(m: ModelInfo, d2t: TensorInfo, output: TensorInfo | None) -> tuple[int | None, str | None]:
    """(the largest target id, what is wrong) of an EAGLE-3 head's d2t, read from the file (a
    few hundred KB). llama.cpp's converter writes it as I64 absolute target ids, one per row
    of the head's output, all distinct (HF's offsets plus their row numbers)."""
    n = d2t.shape[0]
    if d2t.type_name != "I64" or len(d2t.shape) != 1:
        return None, f"is {d2t.type_name} of shape {list(d2t.shape)}, and llama.cpp reads a list of I64 token ids"
    if output is not None and (len(output.shape) != 2 or output.shape[1] != n):
        return None, f"maps {n} tokens, and its output head has {output.shape[-1]} rows"
    if n > MAX_D2T:
        return None, f"maps {n} tokens, more than any vocabulary"
    ids = np.frombuffer(tensor_bytes(m.header, d2t), dtype="<i8")
    if ids.min() < 0:
        return None, f"holds a negative token id ({int(ids.min())})"
    if len(np.unique(ids)) != n:
        return None, "maps two of its tokens to one target token"
    return int(ids.max()), None


def model_json(m: ModelInfo) -> dict:
    """What ``inspect --json`` says of ``m``: its header's facts and the draft heads it declares."""
    h = head_file_of(m)
    return {**m.to_json(), "mtp_heads": heads_of(m).to_json(), "draft_head": h.to_json() if h is not None else None}
