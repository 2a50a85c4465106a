"""A DSpark block drafter of a real drafter's size for a real target, whose agreement with the
target is set by a table, for comparing block-drafter loops where no trained drafter exists.

    python scripts/tools/sized_dspark.py TARGET.gguf OUT.gguf [--layers 4] [--block 16]
        [--rank 64] [--keep 1.0] [--corpus PATH ...] [--max-mb 8] [--seed 1]

No DFlash, DSpark or DFlash2 file exists for the demo target, and none can be trained on this
machine. What a comparison of two tools' block-drafter loops needs is a drafter that costs what a
real one costs (its layers at the target's width, its encoder over the target's layer inputs,
its rows through the target's 151,936-token output head) and whose drafts the target accepts
neither never nor always, the same drafts for both tools. This writes one:

* **the body** is a DFlash drafter of ``--layers`` blocks of the target's shapes (its width,
  heads, feed-forward), reading the target's inputs to three of its layers spread over its depth,
  with random weights. Its output norm is zero, so its rows' own logits are zero: it costs a real
  drafter's decode and says nothing;
* **the Markov head** (DSpark's, in the graph: each row's logits are biased by
  ``markov_w2 @ markov_w1[prev]``, ``prev`` the argmax of the row before, the last token for the
  first row) holds a successor table: after token ``a`` it drafts the token that most often
  follows ``a`` in ``--corpus`` as tokenized by the target (default: the Python standard
  library's sources, code and docstrings). ``markov_w2``'s rows are random unit vectors of
  ``--rank`` - 1 dimensions and ``markov_w1[a]`` points at its successor's, so the argmax is
  exactly the table's entry. A block drafts a chain of successors;
* **the confidence head** states, for each draft, how often that successor follows in the
  corpus (a logit in ``markov_w1``'s last dimension, which the bias does not read), so a p-min
  truncates where the table is unsure; a token with no entry states almost zero.

``--keep F`` keeps a random fraction F of the table's entries (the others state almost zero and
draft token 0), which sets how much of the target's text the drafter can guess.

It borrows the target's token embeddings and output head, and carries the target's tokenizer with
``<|fim_pad|>`` (or the last control token) as its mask token, as a converted drafter does. The
defaults write about 420 MB for Qwen2.5-1.5B in about a minute.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, LlamaFileType

sys.path.insert(0, str(Path(__file__).parent))
from as_llama import copy_field  # noqa: E402

CONFIDENCE_GAIN = 20.0  # the successor's bias over every other token's (others fall within +-0.6 of it, times this)
UNKNOWN_LOGIT = -9.0  # the confidence a token with no entry states: sigmoid(-9), 0.0001


def field(r: GGUFReader, name: str):
    f = r.get_field(name)
    if f is None:
        raise SystemExit(f"{name} is missing from the target's header")
    return f.contents()


def corpus_files(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def successor_table(target: Path, paths: list[Path], max_mb: float, n_vocab: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per token: the token that most often follows it in the corpus (-1: none) and how often it
    does, as a share of that token's occurrences; and how many tokens were read."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(target), vocab_only=True, verbose=False)
    ids: list[np.ndarray] = []
    read = 0
    for f in corpus_files(paths):
        text = f.read_bytes()
        if read + len(text) > max_mb * 2**20:
            break
        read += len(text)
        ids.append(np.asarray(vocab.tokenize(text, add_bos=False, special=False), dtype=np.int64))
    pairs = np.concatenate([a[:-1] * n_vocab + a[1:] for a in ids if len(a) > 1])
    keys, counts = np.unique(pairs, return_counts=True)
    prev, nxt = keys // n_vocab, keys % n_vocab
    order = np.lexsort((-counts, prev))  # by token, its most frequent successor first
    prev, nxt, counts = prev[order], nxt[order], counts[order]
    first = np.r_[True, prev[1:] != prev[:-1]]
    totals = np.zeros(n_vocab, np.int64)
    np.add.at(totals, prev, counts)
    succ = np.full(n_vocab, -1, np.int64)
    share = np.zeros(n_vocab, np.float64)
    succ[prev[first]] = nxt[first]
    share[prev[first]] = counts[first] / totals[prev[first]]
    return succ, share, int(sum(len(a) for a in ids))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4, help="the body's blocks (a 5-block drafter is to a 36-layer target as 4 to 28)")
    ap.add_argument("--block", type=int, default=16, help="dflash.block_size: rows per block, each a draft (DSpark drafts from the anchor)")
    ap.add_argument("--rank", type=int, default=64, help="the Markov head's rank")
    ap.add_argument("--keep", type=float, default=1.0, help="the share of the successor table kept")
    ap.add_argument("--corpus", type=Path, nargs="*", help="files or folders (their *.py) to count successors in")
    ap.add_argument("--max-mb", type=float, default=8.0, help="read at most this much of the corpus")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    r = GGUFReader(args.target)
    arch = field(r, "general.architecture")
    n_embd = int(field(r, f"{arch}.embedding_length"))
    n_layer = int(field(r, f"{arch}.block_count"))
    n_ff = int(field(r, f"{arch}.feed_forward_length"))
    n_head = int(field(r, f"{arch}.attention.head_count"))
    n_kv = int(field(r, f"{arch}.attention.head_count_kv"))
    head_dim = n_embd // n_head
    tokens = field(r, "tokenizer.ggml.tokens")
    n_vocab = len(tokens)
    mask = tokens.index("<|fim_pad|>") if "<|fim_pad|>" in tokens else n_vocab - 1
    layers = sorted({1, n_layer // 2, n_layer - 3})  # early, middle and late, as released drafters read

    corpus = args.corpus or [Path(sysconfig.get_paths()["stdlib"])]
    succ, share, n_read = successor_table(args.target, corpus, args.max_mb, n_vocab)
    rng = np.random.default_rng(args.seed)
    known = (succ >= 0) & (rng.random(n_vocab) < args.keep)
    print(f"successors of {known.sum():,} tokens from {n_read:,} corpus tokens (kept {args.keep:.0%})")

    def rand(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)

    w: dict[str, np.ndarray] = {
        "fc.weight": rand(n_embd, len(layers) * n_embd),
        "enc.output_norm.weight": np.ones(n_embd, np.float32),
        "output_norm.weight": np.zeros(n_embd, np.float32),  # the body's own logits: zero
    }
    for i in range(args.layers):
        b = f"blk.{i}."
        w |= {
            b + "attn_norm.weight": np.ones(n_embd, np.float32),
            b + "attn_q.weight": rand(n_head * head_dim, n_embd),
            b + "attn_k.weight": rand(n_kv * head_dim, n_embd),
            b + "attn_v.weight": rand(n_kv * head_dim, n_embd),
            b + "attn_output.weight": rand(n_embd, n_head * head_dim),
            b + "attn_q_norm.weight": np.ones(head_dim, np.float32),
            b + "attn_k_norm.weight": np.ones(head_dim, np.float32),
            b + "ffn_norm.weight": np.ones(n_embd, np.float32),
            b + "ffn_gate.weight": rand(n_ff, n_embd),
            b + "ffn_up.weight": rand(n_ff, n_embd),
            b + "ffn_down.weight": rand(n_embd, n_ff),
        }
    dims = args.rank - 1  # the last dimension carries the confidence
    units = rng.standard_normal((n_vocab, dims), dtype=np.float32)
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    w1 = np.zeros((n_vocab, args.rank), np.float32)
    w1[known, :dims] = CONFIDENCE_GAIN * units[succ[known]]
    p = np.clip(share, 1e-4, 1 - 1e-4)
    w1[:, dims] = np.where(known, np.log(p / (1 - p)), UNKNOWN_LOGIT)
    w2 = np.zeros((n_vocab, args.rank), np.float32)
    w2[:, :dims] = units
    conf = np.zeros((1, n_embd + args.rank), np.float32)
    conf[0, n_embd + dims] = 1.0
    w |= {
        "markov_w1.weight": w1,
        "markov_w2.weight": w2.astype(np.float16),
        "conf_proj.weight": conf,
        "conf_proj.bias": np.zeros(1, np.float32),
    }

    tmp = args.out.with_name(f".{args.out.name}.tmp")
    g = GGUFWriter(tmp, "dflash")
    g.add_name(f"sized DSpark for {args.target.name}")
    g.add_file_type(LlamaFileType.MOSTLY_F16)
    g.add_vocab_size(n_vocab)
    g.add_context_length(int(field(r, f"{arch}.context_length")))
    g.add_embedding_length(n_embd)
    g.add_block_count(args.layers)
    g.add_feed_forward_length(n_ff)
    g.add_head_count(n_head)
    g.add_head_count_kv(n_kv)
    g.add_key_length(head_dim)
    g.add_value_length(head_dim)
    g.add_rope_dimension_count(head_dim)
    g.add_rope_freq_base(float(field(r, f"{arch}.rope.freq_base")))
    g.add_layer_norm_rms_eps(float(field(r, f"{arch}.attention.layer_norm_rms_epsilon")))
    g.add_array("dflash.target_layers", layers)
    g.add_uint32("dflash.block_size", args.block)
    g.add_bool("dflash.sample_from_anchor", True)
    g.add_bool("dflash.has_confidence_head", True)
    for f in r.fields.values():  # the target's tokenizer, as the converter copies it
        if f.name.startswith("tokenizer."):
            copy_field(g, f)
    g.add_mask_token_id(mask)
    for name, t in w.items():
        g.add_tensor(name, np.ascontiguousarray(t))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    tmp.replace(args.out)
    print(f"{args.out}  {args.out.stat().st_size / 2**20:.0f} MiB  layers {layers}, {args.layers} blocks, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
