"""What a model's memory is made of, and how a rejected draft is undone, from its GGUF header.

Three classes of architecture, as llama.cpp treats them (src/llama-arch.cpp at the commit that
llama-cpp-python 0.3.36 vendors; the backend finds the same at load time):

* **attention only**: a KV cache; rejected drafts are trimmed from it;
* **hybrid or recurrent with snapshots** (``llm_arch_supports_rs_rollback``): llama.cpp keeps
  ``n_rs_seq`` extra copies of the recurrent state per sequence, so a verify's rejected drafts
  roll back through a snapshot. The state then costs ``1 + n_rs_seq`` times its size
  (src/llama-memory-recurrent.cpp), and a draft is at most ``n_rs_seq`` tokens;
* **hybrid or recurrent without snapshots**: the backend copies the state before a verify (a
  checkpoint) and, after a rejection, restores it and replays the tokens kept.

The recurrent state of one sequence, per recurrent layer, in f32 (llama_hparams::n_embd_r and
n_embd_s): a convolution window ``(d_conv - 1) x (d_inner + 2 n_group d_state)`` plus an SSM
or delta-net state ``d_state x d_inner`` (Mamba, Mamba-2, gated delta-nets), ``(l_cache - 1) x
n_embd`` (LFM2's short convolutions), or ``token_shift_count x n_embd`` plus ``n_embd x
head_size`` (RWKV). An architecture whose state has another shape is reported as unknown.

The list of architecture names is the one compiled into that llama.cpp; with another
llama-cpp-python installed, a name missing from it is only reported, not refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path
from typing import Any

import numpy as np

from specrun.errors import UnsupportedArchitecture
from specrun.gguf.header import GGUFHeader

ROLLBACK_DEPTH = 32  # snapshots asked for: a snapshot target's draft cap (trades: long copies against a
# recurrent state's copy per snapshot)
CHECKPOINTS_KEPT = 2  # copies of the state the backend keeps in RAM (see llama.Model.checkpoint)
STATE_BYTES_PER_ELEM = 4  # llama.cpp keeps recurrent states in f32

LIST_VERSION = "0.3.36"  # the llama-cpp-python whose vendored llama.cpp the names below come from
# LLM_ARCH_NAMES (src/llama-arch.cpp)
KNOWN = frozenset(
    """clip llama llama4 deci falcon grok gpt2 gptj gptneox mpt baichuan starcoder refact bert modern-bert
    nomic-bert nomic-bert-moe neo-bert jina-bert-v2 jina-bert-v3 eurobert bloom stablelm qwen qwen2 qwen2moe
    qwen2vl qwen3 qwen3moe qwen3next qwen3vl qwen3vlmoe qwen35 qwen35moe qwen4exp phi2 phi3 phimoe plamo plamo2
    plamo3 codeshell orion internlm2 minicpm minicpm3 gemma gemma2 gemma3 gemma3n gemma4 gemma4-assistant
    gemma-embedding starcoder2 mamba mamba2 maple jamba falcon-h1 xverse command-r cohere2 cohere2moe dbrx olmo
    olmo2 olmoe muse-glimmer openelm arctic deepseek deepseek2 deepseek2-ocr deepseek32 deepseek4 chatglm glm4
    glm4moe glm-dsa bitnet t5 t5encoder jais jais2 nemotron nemotron_h nemotron_h_moe exaone exaone4 exaone-moe
    rwkv6 rwkv6qwen2 rwkv7 arwkv7 granite granitemoe granitehybrid graniteswitch granite_swa chameleon
    wavtokenizer-dec plm bailingmoe bailingmoe2 bailingmoe3 dots1 dots3note arcee afmoe laguna ernie4_5
    ernie4_5-moe hunyuan-moe hunyuan-dense hunyuan_vl hy_v3 hy_v4 smollm3 gpt-oss lfm2 lfm2moe dream smallthinker
    llada llada-moe seed_oss grovemoe apertus minimax-01 hrm_text minimax-m2 minimax-m3 cogvlm rnd1
    pangu-embedded mistral3 eagle3 dflash mistral4 paddleocr mimo2 step35 spark2_5 llama-embed maincoder
    kimi-linear kimi-k3 glm5-next talkie mellum nanbeige qwen3tts pockettts""".split()
)
RECURRENT = frozenset("mamba mamba2 rwkv6 rwkv6qwen2 rwkv7 arwkv7".split())  # llm_arch_is_recurrent
HYBRID = frozenset(  # llm_arch_is_hybrid
    """jamba falcon-h1 plamo2 granitehybrid lfm2 lfm2moe nemotron_h nemotron_h_moe qwen3next kimi-linear
    bailingmoe3 kimi-k3 glm5-next qwen35 qwen35moe qwen4exp deepseek4 minimax-01""".split()
)
SNAPSHOTS = frozenset(  # llm_arch_supports_rs_rollback
    "kimi-k3 qwen35 qwen35moe qwen4exp deepseek4 glm5-next nemotron_h nemotron_h_moe lfm2 lfm2moe bailingmoe3".split()
)
# the graphs that hand out their layers' inputs (src/models/*.cpp that set res->t_layer_inp, and the
# architectures built by them): what an EAGLE-3 head and a block drafter read. Any other target
# stops llama.cpp in an assert at its first decode once they are asked for (qwen2 among them)
LAYER_INPUTS = frozenset(
    """bailingmoe3 deepseek4 gemma4 gpt-oss hunyuan-dense hunyuan_vl lfm2 lfm2moe llama llama-embed mimo2
    minimax-01 minimax-m2 muse-glimmer nanbeige nemotron_h nemotron_h_moe qwen3 qwen35 qwen35moe qwen3moe
    qwen3next qwen4exp""".split()
)
# how each hybrid marks its recurrent layers (the model loaders in src/models/*.cpp)
_BY_INTERVAL = frozenset("qwen3next qwen35 qwen35moe qwen4exp".split())  # attention every full_attention_interval-th layer
_NO_KV_HEADS = frozenset("granitehybrid jamba plamo2 lfm2 lfm2moe kimi-linear".split())  # n_head_kv == 0
_NO_KV_NO_FF = frozenset("nemotron_h nemotron_h_moe".split())  # n_head_kv == 0 and n_ff == 0 (not an MLP layer)
EVERY_LAYER = frozenset({"falcon-h1"})  # attention and SSM side by side in every layer
# whose state has the shapes below (others: Kimi's KDA, MiniMax's lightning attention, DeepSeek-V4's
# compressed caches, ... are reported as of unknown size)
_STATE_SHAPES = RECURRENT | frozenset(
    "jamba falcon-h1 plamo2 granitehybrid lfm2 lfm2moe nemotron_h nemotron_h_moe qwen3next qwen35 qwen35moe".split()
)

KINDS = {"attention": "attention only", "hybrid": "hybrid", "recurrent": "recurrent"}


@dataclass(frozen=True)
class Architecture:
    """What the header says about a model's memory and its rollback."""

    name: str  # general.architecture
    kind: str  # "attention", "hybrid" or "recurrent"
    rollback: str  # "trim", "snapshots" or "checkpoint" (llama.Model.rollback_method)
    recurrent_layers: tuple[bool, ...] | None  # per layer of the main model; None: not known
    state_bytes: int | None  # one copy of one sequence's recurrent state, all layers; None: not known
    loadable: bool | None  # in the installed llama.cpp's list? None: another version, cannot tell

    @property
    def label(self) -> str:
        return f"{self.name} ({KINDS[self.kind]})"

    def snapshots(self, depth: int = ROLLBACK_DEPTH) -> int:
        return depth if self.rollback == "snapshots" else 0

    def state_total(self, depth: int = ROLLBACK_DEPTH) -> int:
        """Bytes the recurrent state takes in the context: itself and its snapshots."""
        return (self.state_bytes or 0) * (1 + self.snapshots(depth))

    def checkpoint_total(self) -> int:
        """Bytes of RAM the backend's checkpoints take (an anchor too, with snapshots)."""
        return (self.state_bytes or 0) * CHECKPOINTS_KEPT if self.kind != "attention" else 0

    def sentence(self, depth: int = ROLLBACK_DEPTH) -> str:
        """How a rejected draft is undone, and what that costs, in one line."""
        if self.kind == "attention":
            return f"{self.label}: rejected drafts are trimmed from the KV cache, at no extra memory"
        size = "of unknown size" if self.state_bytes is None else mib(self.state_bytes)
        if self.rollback == "snapshots":
            extra = "" if self.state_bytes is None else f", +{mib(self.state_total(depth) - self.state_bytes)}"
            return (
                f"{self.label}: rejected drafts roll back through {depth} state snapshots{extra} "
                f"(the state is {size}; drafts are at most {depth} tokens)"
            )
        return (
            f"{self.label}: llama.cpp keeps no state snapshots for it; a rejected draft restores a checkpoint "
            f"of the state ({size}, copied before each verify) and replays the tokens kept"
        )

    def to_json(self, depth: int = ROLLBACK_DEPTH) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "rollback": self.rollback,
            "snapshots": self.snapshots(depth),
            "recurrent_layers": None if self.recurrent_layers is None else sum(self.recurrent_layers),
            "state_bytes": self.state_bytes,
            "state_total_bytes": self.state_total(depth) if self.state_bytes is not None else None,
            "loadable": self.loadable,
            "rollback_note": self.sentence(depth),
        }


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def installed_version() -> str | None:
    """The installed llama-cpp-python's version, without importing it: from its package
    metadata, or, where it has none (unpacked from an archive, say), from the package's
    ``__version__`` line."""
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        pass
    try:
        spec = util.find_spec("llama_cpp")
        text = Path(spec.origin).read_text(encoding="utf-8") if spec is not None and spec.origin else ""
    except (ImportError, OSError, UnicodeDecodeError, ValueError):
        return None
    m = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.MULTILINE)
    return m.group(1) if m else None


def loadable(name: str) -> bool | None:
    return _listed(name, KNOWN)


def hands_out_layer_inputs(name: str) -> bool | None:
    """Can the installed llama.cpp read a target of this architecture's layer inputs? (None:
    another version is installed, and it is left to llama.cpp to say.)"""
    return _listed(name, LAYER_INPUTS)


def _listed(name: str, names: frozenset[str]) -> bool | None:
    """``name`` in a list read from llama-cpp-python LIST_VERSION's llama.cpp: True; not in it:
    False where that version is installed, else None (another version's list may differ)."""
    if name in names:
        return True
    return False if installed_version() == LIST_VERSION else None


def require_loadable(arch: Architecture, file_name: str) -> None:
    """An architecture the installed llama.cpp cannot load is refused before any load."""
    if arch.loadable is False:
        raise UnsupportedArchitecture(
            f"{file_name} is a {arch.name!r} model, an architecture the installed llama.cpp (llama-cpp-python {LIST_VERSION}) cannot load",
            "pick a model of a supported architecture, or upgrade llama-cpp-python",
        )


def _int(v: Any, default: int = 0) -> int:
    if isinstance(v, np.ndarray):
        return int(v.max()) if v.size else default
    return int(v) if isinstance(v, (int, np.integer)) else default


def _per_layer(v: Any, n: int) -> list[int]:
    if isinstance(v, np.ndarray):
        return [int(x) for x in v[:n]] + [0] * max(0, n - len(v))
    return [_int(v)] * n


def classify(name: str) -> tuple[str, str]:
    """(kind, rollback) of an architecture, from its name alone."""
    kind = "recurrent" if name in RECURRENT else "hybrid" if name in HYBRID else "attention"
    return kind, "trim" if kind == "attention" else "snapshots" if name in SNAPSHOTS else "checkpoint"


def short_label(name: str) -> str:
    """``qwen35 (hybrid, snapshots)``: the class in a table cell."""
    kind, rollback = classify(name)
    return name if kind == "attention" else f"{name} ({kind}, {rollback})"


def describe(header: GGUFHeader, n_layer_all: int) -> Architecture:
    """The architecture of the model whose header this is (``n_layer_all``: block_count)."""
    name = str(header.get("general.architecture", "unknown"))

    def a(key: str, default: Any = None) -> Any:
        return header.get(f"{name}.{key}", default)

    kind, rollback = classify(name)
    if kind == "attention":
        return Architecture(name, kind, rollback, (False,) * n_layer_all, 0, loadable(name))
    n_layer = max(0, n_layer_all - _int(a("nextn_predict_layers")))  # MTP blocks sit outside the main model
    layers = _recurrent_layers(name, a, n_layer)
    per_layer = _state_elems(a) if name in _STATE_SHAPES else None
    state = None if layers is None or per_layer is None else STATE_BYTES_PER_ELEM * per_layer * sum(layers)
    return Architecture(name, kind, rollback, layers, state, loadable(name))


def _recurrent_layers(name: str, a, n_layer: int) -> tuple[bool, ...] | None:
    if name in RECURRENT or name in EVERY_LAYER:
        return (True,) * n_layer
    if name in _BY_INTERVAL:
        marked = a("attention.recurrent_layers")
        if isinstance(marked, np.ndarray) and len(marked) >= n_layer:
            return tuple(bool(x) for x in marked[:n_layer])
        every = _int(a("full_attention_interval"), 4) or 4
        return tuple((i + 1) % every != 0 for i in range(n_layer))
    kv = _per_layer(a("attention.head_count_kv"), n_layer)
    if name in _NO_KV_HEADS:
        return tuple(h == 0 for h in kv)
    if name in _NO_KV_NO_FF:
        ff = _per_layer(a("feed_forward_length"), n_layer)
        return tuple(h == 0 and f == 0 for h, f in zip(kv, ff))
    return None


def _state_elems(a) -> int | None:
    """f32 elements of one recurrent layer's state (conv window + SSM state), or None."""
    n_embd = _int(a("embedding_length"))
    if _int(a("wkv.head_size")):  # RWKV
        return (_int(a("token_shift_count"), 2) or 2) * n_embd + n_embd * _int(a("wkv.head_size"))
    d_state, d_inner = _int(a("ssm.state_size")), _int(a("ssm.inner_size"))
    if _int(a("shortconv.l_cache")):  # LFM2
        return n_embd * (_int(a("shortconv.l_cache")) - 1) + d_state * d_inner
    d_conv, n_group = _int(a("ssm.conv_kernel")), _int(a("ssm.group_count"))
    if not (d_conv and d_inner and d_state):
        return None  # keys missing: a header llama.cpp would refuse anyway
    return (d_conv - 1) * (d_inner + 2 * n_group * d_state) + d_state * d_inner
