"""Tiny, deterministic GGUF models that the real llama.cpp loads, for tests and scripts.

Every model is a 64-wide `llama` network (4 query heads, 2 KV heads, FFN 128, context 4096)
with random F32 weights drawn from a seed, so a file is about 0.6 MB and takes milliseconds
to write. The same seed always gives the same bytes.

The tokenizer is real: byte-level BPE (`gpt2` model, `qwen2` pre-tokenizer) with the 256 byte
tokens, merges trained on the small corpus below (English, Python, Japanese), and the ChatML
control tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` at the end of the vocabulary, as in
Qwen. Text of any language round-trips exactly; rare multi-byte characters span two or more
tokens.

Greedy decoding must pick the same tokens whether logits come from a batched eval or one
token at a time, which differ slightly (here: mean 1.5e-5, worst seen 1e-3 with llama.cpp's
default F16 KV cache; under 1e-5 with an F32 one). So logits are wide (std LOGIT_STD, median
top-1 minus top-2 gap 1.4) and attention is soft (QK_STD), which keeps near-ties rare.

    paths = build_all(tmp_dir)          # {"target": Path, "draft-perturbed": Path, ...}
    write_model(path, vocab=bpe_vocab(), weights=make_weights(seed=7, n_vocab=...))

Variants made by `build_all` (see VARIANTS):
    target            seed 1, 2 layers
    draft-copy        the target's exact weights, in another file
    draft-perturbed   target + small noise: greedy agrees with the target most of the time
    draft-unrelated   same vocabulary, another seed: rarely agrees
    draft-small       1 layer: the target's embeddings, output and layer 0
    vocab-changed     draft-perturbed, with the text of token VOCAB_CHANGED_ID replaced
    vocab-plus100     draft-perturbed, with 100 control tokens appended to the vocabulary
    eos-changed       the target's weights, with EOS set to <|endoftext|> instead of <|im_end|>
    other-family      SentencePiece (`llama`) tokenizer with scores, own seed
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType

N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
CONTEXT_LENGTH = 4096
HEAD_DIM = N_EMBD // N_HEAD
RMS_EPS = 1e-6
ROPE_FREQ_BASE = 10000.0

N_MERGES = 381  # 256 bytes + 381 merges + 3 control tokens = 640 tokens
TARGET_SEED = 1
VOCAB_CHANGED_ID = 300  # the first id at or above this whose token no merge builds on

# A character absent from CORPUS whose three bytes tokenize as two tokens: [E3 81] [AC].
SPLIT_CHAR = "ぬ"

# Standard deviation of each logit, in units, for a unit-RMS final hidden state.
LOGIT_STD = 6.0
# Query and key weights are small, so attention is close to uniform over the context yet
# still depends on positions (RoPE). Sharp attention amplifies the F16 rounding of the KV
# cache: at 4x this scale, batched and one-token logits differ by up to 1e-2 instead of 7e-4.
QK_STD = 0.5
# The second block writes into the residual stream at half strength, so a one-block draft
# built from the first block (draft-small) still agrees with the target often.
LATER_LAYER_SCALE = 0.5
# Relative noise added to every tensor of draft-perturbed (and its vocab-* relatives).
PERTURB_SCALE = 0.07

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran
back into the forest. In the morning the sun rose over the hills, and the people of the
town went to work. Some of them worked in the fields, some in the shops, and some in the
old mill by the river. When the day was over they came home, had dinner with their
families, and talked about what they had seen and heard. It is a simple life, but it is a
good one, and they would not change it for anything in the world.

Speculative decoding lets a small draft model propose several tokens that a large target
model then verifies in a single batch. When the draft is right, the target accepts many
tokens at once and the generation is faster; when the draft is wrong, the target rejects
the rest and samples a new token itself. The output is exactly the same as if the target
had generated every token on its own. This is why the method is popular: it makes models
faster without changing what they say. The acceptance rate depends on how well the two
models agree, which is why they must share the same vocabulary and tokenizer.

Please write a short story about a robot who learns to cook. The robot should be kind,
curious and a little clumsy. At the end of the story, the robot makes a delicious soup for
its friends, and everyone is happy. Thank you! What is the capital of France? The capital
of France is Paris. How many days are there in a week? There are seven days in a week.

A language model reads a sequence of tokens and predicts the next one. Each token is a
small piece of text: a word, part of a word, a number, or a single byte. The model turns
the tokens into vectors, mixes them with attention, and produces a score for every token
in the vocabulary. The highest score wins when we decode greedily, and a random choice
weighted by the scores is made when we sample with a temperature above zero.

def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


def hello(name: str = "world") -> str:
    return f"Hello, {name}!"


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


for i in range(10):
    if i % 2 == 0:
        print(i, fibonacci(i))
    else:
        print(hello(str(i)))

import os
import sys
from pathlib import Path

def read_lines(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]

result = {"name": "specrun", "version": 1, "items": [1, 2, 3], "ok": True, "value": None}
assert result["ok"] is True and len(result["items"]) == 3


def tokenize(text: str, vocab: dict[str, int]) -> list[int]:
    tokens = []
    for word in text.split():
        if word in vocab:
            tokens.append(vocab[word])
        else:
            tokens.extend(vocab[char] for char in word if char in vocab)
    return tokens


class Model:
    def __init__(self, path: str, n_ctx: int = 512) -> None:
        self.path = path
        self.n_ctx = n_ctx
        self.tokens: list[int] = []

    def generate(self, prompt: str, max_tokens: int = 16) -> str:
        for _ in range(max_tokens):
            self.tokens.append(self.sample())
        return "".join(str(token) for token in self.tokens)

今日はとても良い天気です。私は公園で散歩をしました。
こんにちは、世界。日本語のテキストもトークンに分けます。
東京は日本の首都です。今日は東京でとても楽しい一日でした。
猫が好きです。犬も好きです。私の家には猫が二匹います。
ありがとうございます。どういたしまして。おはようございます。
これはテストです。これは日本語の文章です。明日も良い天気でしょう。
私は毎朝コーヒーを飲みます。駅まで歩いて十分です。電車はとても混んでいます。
この本はとても面白いです。友達と一緒に映画を見に行きました。
週末は家でゆっくり休みます。日本の夏は暑いですが、冬は寒いです。
"""


# ---------------------------------------------------------------------------------------------
# Tokenizers


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Everything the GGUF tokenizer metadata says. Token texts are in the model's own form."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str | None
    tokens: tuple[str, ...]
    types: tuple[int, ...]
    merges: tuple[str, ...] = ()
    scores: tuple[float, ...] | None = None
    bos: int | None = None
    eos: int | None = None
    eot: int | None = None
    pad: int | None = None
    unk: int | None = None
    add_bos: bool = False
    chat_template: str | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def id_of(self, text: str) -> int:
        return self.tokens.index(text)


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (space -> 'Ġ', ...)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_encode(text: str) -> str:
    """The byte-level form of `text`, as token texts are stored."""
    table = _byte_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


# Qwen2's pre-tokenizer, with \p{L} written as [^\W\d_] and \p{N} as \d for Python's `re`.
# Training only needs an approximation: llama.cpp applies the merges by rank either way.
_PRETOKENIZE = re.compile(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|(?:[^\r\n\w]|_)?[^\W\d_]+|\d| ?(?:[^\s\w]|_)+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@functools.cache
def _train_bpe(n_merges: int) -> tuple[tuple[str, str], ...]:
    """Plain BPE on CORPUS: repeatedly merge the most frequent adjacent pair (ties by text)."""
    counts = Counter(byte_encode(w) for w in _PRETOKENIZE.findall(CORPUS))
    words = [(list(w), n) for w, n in counts.items()]
    pairs: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}  # pair -> indices of the words holding it
    for i, (parts, n) in enumerate(words):
        for pair in zip(parts, parts[1:]):
            pairs[pair] += n
            where.setdefault(pair, set()).add(i)
    # A lazy max-heap: stale entries (count changed since pushed) are skipped when popped.
    heap = [(-n, pair) for pair, n in pairs.items()]
    heapq.heapify(heap)

    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        while heap and -heap[0][0] != pairs[heap[0][1]]:
            heapq.heappop(heap)
        if not heap or -heap[0][0] < 2:
            raise ValueError(f"CORPUS is too small for {n_merges} merges")
        best = heapq.heappop(heap)[1]
        merges.append(best)
        changed = set()
        for i in sorted(where.pop(best)):
            parts, n = words[i]
            for pair in zip(parts, parts[1:]):  # forget this word's pairs, then recount
                pairs[pair] -= n
                changed.add(pair)
            merged, j = [], 0
            while j < len(parts):
                if j < len(parts) - 1 and (parts[j], parts[j + 1]) == best:
                    merged.append(parts[j] + parts[j + 1])
                    j += 2
                else:
                    merged.append(parts[j])
                    j += 1
            words[i] = (merged, n)
            for pair in zip(merged, merged[1:]):
                pairs[pair] += n
                changed.add(pair)
                where.setdefault(pair, set()).add(i)
        for pair in changed:
            if pairs[pair] > 0:
                heapq.heappush(heap, (-pairs[pair], pair))
    return tuple(merges)


@functools.cache
def bpe_vocab() -> Vocab:
    """The shared byte-level BPE vocabulary: 256 bytes, the merges, then ChatML tokens."""
    merges = _train_bpe(N_MERGES)
    tokens = list(_byte_to_unicode().values()) + [a + b for a, b in merges]
    assert len(set(tokens)) == len(tokens)
    types = [TokenType.NORMAL] * len(tokens)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials
    types += [TokenType.CONTROL] * len(specials)
    endoftext, im_end = len(tokens) - 3, len(tokens) - 1
    return Vocab(
        model="gpt2",
        pre="qwen2",
        tokens=tuple(tokens),
        types=tuple(int(t) for t in types),
        merges=tuple(f"{a} {b}" for a, b in merges),
        bos=endoftext,
        eos=im_end,
        eot=im_end,
        pad=endoftext,
        add_bos=False,
        chat_template=CHATML_TEMPLATE,
    )


def with_changed_token(vocab: Vocab, at_least: int = VOCAB_CHANGED_ID) -> tuple[Vocab, int]:
    """`vocab` with one merged token's text replaced by a new string; returns it and the id.

    The token chosen is the first at or above `at_least` that no other merge builds on; its
    own merge is dropped, so the tokenizer stays consistent (it just never produces that id).
    """
    n_bytes = 256
    parts = {p for merge in vocab.merges for p in merge.split(" ")}
    token_id = next(i for i in range(at_least, n_bytes + len(vocab.merges)) if vocab.tokens[i] not in parts)
    tokens = list(vocab.tokens)
    tokens[token_id] = byte_encode(" vocab-changed")
    merges = vocab.merges[: token_id - n_bytes] + vocab.merges[token_id - n_bytes + 1 :]
    return dataclasses.replace(vocab, tokens=tuple(tokens), merges=merges), token_id


def with_extra_tokens(vocab: Vocab, n: int) -> Vocab:
    """`vocab` with `n` control tokens appended; every existing id keeps its text."""
    extra = tuple(f"<|extra_{i}|>" for i in range(n))
    return dataclasses.replace(vocab, tokens=vocab.tokens + extra, types=vocab.types + (int(TokenType.CONTROL),) * n)


@functools.cache
def spm_vocab() -> Vocab:
    """A SentencePiece vocabulary (a different family): <unk> <s> </s>, byte pieces, words."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    pieces: list[str] = ["▁"] + [chr(c) for c in range(ord("!"), ord("~") + 1)]
    decode = {c: b for b, c in _byte_to_unicode().items()}
    for a, b in _train_bpe(N_MERGES):
        try:
            text = bytes(decode[c] for c in a + b).decode("utf-8")
        except UnicodeDecodeError:
            continue  # a partial character; SentencePiece falls back to byte pieces there
        pieces.append(text.replace(" ", "▁"))
    pieces = list(dict.fromkeys(p for p in pieces if "\n" not in p))
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    return Vocab(
        model="llama",
        pre=None,
        tokens=tuple(tokens),
        types=tuple(int(t) for t in types),
        scores=tuple(scores),
        bos=1,
        eos=2,
        unk=0,
        add_bos=True,
    )


# ---------------------------------------------------------------------------------------------
# Weights


Weights = dict[str, np.ndarray]


def make_weights(
    seed: int,
    n_vocab: int,
    n_layer: int = 2,
    *,
    n_embd: int = N_EMBD,
    n_ff: int = N_FF,
    n_head: int = N_HEAD,
    n_head_kv: int = N_HEAD_KV,
    later_scale: float = LATER_LAYER_SCALE,
    dtype: type = np.float32,
) -> Weights:
    """Random llama weights, keyed by GGUF tensor name, shapes in NumPy (rows, cols) order; the
    matrices in ``dtype``, the norms in F32. The keywords give other shapes (see
    scripts/tools/sized_models.py); their defaults are the tiny models'."""
    rng = np.random.default_rng(seed)

    def normal(rows: int, cols: int, std: float) -> np.ndarray:
        return rng.normal(0.0, std, size=(rows, cols)).astype(np.float32).astype(dtype, copy=False)

    n_kv = n_head_kv * (n_embd // n_head)
    weights: Weights = {"token_embd.weight": normal(n_vocab, n_embd, 1.0)}
    for i in range(n_layer):
        out_scale = 1.0 if i == 0 else later_scale
        weights |= {
            f"blk.{i}.attn_norm.weight": np.ones(n_embd, np.float32),
            f"blk.{i}.attn_q.weight": normal(n_embd, n_embd, QK_STD / n_embd**0.5),
            f"blk.{i}.attn_k.weight": normal(n_kv, n_embd, QK_STD / n_embd**0.5),
            f"blk.{i}.attn_v.weight": normal(n_kv, n_embd, 1.0 / n_embd**0.5),
            f"blk.{i}.attn_output.weight": normal(n_embd, n_embd, out_scale / n_embd**0.5),
            f"blk.{i}.ffn_norm.weight": np.ones(n_embd, np.float32),
            f"blk.{i}.ffn_gate.weight": normal(n_ff, n_embd, 1.0 / n_embd**0.5),
            f"blk.{i}.ffn_up.weight": normal(n_ff, n_embd, 1.0 / n_embd**0.5),
            f"blk.{i}.ffn_down.weight": normal(n_embd, n_ff, out_scale / n_ff**0.5),
        }
    weights["output_norm.weight"] = np.ones(n_embd, np.float32)
    # The final hidden state has unit RMS, so each logit has standard deviation LOGIT_STD.
    weights["output.weight"] = normal(n_vocab, n_embd, LOGIT_STD / n_embd**0.5)
    return weights


def perturbed(weights: Weights, seed: int, scale: float = PERTURB_SCALE) -> Weights:
    """Each tensor plus Gaussian noise of `scale` times its own standard deviation."""
    rng = np.random.default_rng(seed)
    out: Weights = {}
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            out[name] = w.copy()
            continue
        noise = rng.normal(0.0, scale * float(w.std()), size=w.shape)
        out[name] = (w + noise).astype(np.float32)
    return out


def truncated(weights: Weights, n_layer: int) -> Weights:
    """The first `n_layer` blocks of `weights`, with the same embeddings and output."""
    return {name: w for name, w in weights.items() if not name.startswith("blk.") or int(name.split(".")[1]) < n_layer}


def with_extra_rows(weights: Weights, n: int, seed: int) -> Weights:
    """Weights for a vocabulary grown by `n` tokens: new embeddings, zero output rows."""
    rng = np.random.default_rng(seed)
    out = dict(weights)
    embd = rng.normal(0.0, 1.0, size=(n, N_EMBD)).astype(np.float32)
    out["token_embd.weight"] = np.concatenate([weights["token_embd.weight"], embd])
    out["output.weight"] = np.concatenate([weights["output.weight"], np.zeros((n, N_EMBD), np.float32)])
    return out


# ---------------------------------------------------------------------------------------------
# Writing


def add_vocab(writer: GGUFWriter, vocab: Vocab) -> None:
    """The tokenizer metadata of `vocab` (any architecture's writer takes the same keys)."""
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.types))
    if vocab.scores is not None:
        writer.add_token_scores(list(vocab.scores))
    if vocab.merges:
        writer.add_token_merges(list(vocab.merges))
    for token_id, add in (
        (vocab.bos, writer.add_bos_token_id),
        (vocab.eos, writer.add_eos_token_id),
        (vocab.eot, writer.add_eot_token_id),
        (vocab.pad, writer.add_pad_token_id),
        (vocab.unk, writer.add_unk_token_id),
    ):
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(False)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)


def write_model(
    path: str | os.PathLike[str],
    *,
    vocab: Vocab,
    weights: Weights,
    name: str = "tiny",
    split_max_tensors: int = 0,
    n_head: int = N_HEAD,
    n_head_kv: int = N_HEAD_KV,
) -> Path:
    """Write one GGUF file; rewrites `path` only if its bytes would change. With
    `split_max_tensors`, write a split model instead, as llama.cpp's gguf-split does:
    `<stem>-00001-of-0000N.gguf`, ...; returns the first part. The width, FFN and layer count
    are read off `weights` (F32, or F16 as `make_weights(dtype=np.float16)` gives them)."""
    path = Path(path)
    n_layer = sum(1 for k in weights if k.endswith("attn_q.weight"))
    n_vocab, n_embd = weights["token_embd.weight"].shape
    n_ff = next((w.shape[0] for k, w in weights.items() if k.endswith("ffn_gate.weight")), N_FF)
    if n_vocab != len(vocab):
        raise ValueError(f"weights are for {n_vocab} tokens, the vocabulary has {len(vocab)}")

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if split_max_tensors:
        tmp = path
        path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(tmp, "llama", split_max_tensors=split_max_tensors)
    writer.add_name(name)
    f16 = weights["token_embd.weight"].dtype == np.float16
    writer.add_file_type(LlamaFileType.MOSTLY_F16 if f16 else LlamaFileType.ALL_F32)
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    writer.add_layer_norm_rms_eps(RMS_EPS)

    write_tensors(writer, vocab, weights)
    if split_max_tensors:
        return next(iter(sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))))
    return settle(tmp, path)


# integer tensors (an EAGLE-3 head's d2t token map) keep their type
_RAW_INT = {np.dtype(np.int64): GGMLQuantizationType.I64, np.dtype(np.int32): GGMLQuantizationType.I32}


def begin(path: Path, arch: str, name: str, n_vocab: int, n_embd: int = N_EMBD) -> tuple[GGUFWriter, Path]:
    """A GGUF writer for ``arch`` on a temporary file beside ``path`` (``settle`` moves it
    there), with the keys every tiny model starts with."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = GGUFWriter(tmp, arch)
    w.add_name(name)
    w.add_file_type(LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(n_embd)
    return w, tmp


def write_tensors(writer: GGUFWriter, vocab: Vocab, weights: Weights) -> None:
    """The vocabulary and the tensors after the header keys already added (F16 ones as F16, other
    float ones as F32, int64 and int32 ones as I64 and I32); the file is written and closed."""
    add_vocab(writer, vocab)
    for tensor_name, w in weights.items():
        if w.dtype in _RAW_INT:
            writer.add_tensor(tensor_name, np.ascontiguousarray(w), raw_dtype=_RAW_INT[w.dtype])
        else:
            writer.add_tensor(tensor_name, np.ascontiguousarray(w, dtype=np.float16 if w.dtype == np.float16 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def settle(tmp: Path, path: Path) -> Path:
    """Move a freshly written ``tmp`` to ``path``, unless ``path`` already holds the same bytes
    (then ``path`` is left as it was and ``tmp`` removed)."""
    if path.exists() and path.read_bytes() == tmp.read_bytes():
        tmp.unlink()
    else:
        os.replace(tmp, path)
    return path


def variants() -> dict[str, tuple[Vocab, Weights]]:
    """Every variant's vocabulary and weights, by name."""
    bpe = bpe_vocab()
    target = make_weights(TARGET_SEED, len(bpe))
    close = perturbed(target, seed=TARGET_SEED + 100)
    changed, _ = with_changed_token(bpe)
    spm = spm_vocab()
    return {
        "target": (bpe, target),
        "draft-copy": (bpe, target),
        "draft-perturbed": (bpe, close),
        "draft-unrelated": (bpe, make_weights(TARGET_SEED + 1, len(bpe))),
        "draft-small": (bpe, truncated(target, 1)),
        "vocab-changed": (changed, close),
        "vocab-plus100": (with_extra_tokens(bpe, 100), with_extra_rows(close, 100, seed=2)),
        "eos-changed": (dataclasses.replace(bpe, eos=bpe.id_of("<|endoftext|>")), target),
        "other-family": (spm, make_weights(TARGET_SEED + 2, len(spm))),
    }


VARIANTS = (
    "target",
    "draft-copy",
    "draft-perturbed",
    "draft-unrelated",
    "draft-small",
    "vocab-changed",
    "vocab-plus100",
    "eos-changed",
    "other-family",
)


def build_all(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Write every variant as `<directory>/<name>.gguf` (idempotent); return name -> path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return {
        name: write_model(directory / f"{name}.gguf", vocab=vocab, weights=weights, name=f"tiny-{name}")
        for name, (vocab, weights) in variants().items()
    }


if __name__ == "__main__":
    import sys

    for variant, written in build_all(sys.argv[1] if len(sys.argv) > 1 else ".").items():
        print(f"{variant:16} {written}  {written.stat().st_size:,} bytes")
