"""A target and draft of real sizes with random weights, for cost curves where no real model can travel.

    python scripts/tools/sized_models.py DIR [--embd 1536 --layers 28 --ff 8960 --heads 12 --kv-heads 2]
        [--draft-layers 2] [--vocab 151936] [--later-scale 0.02]

The device machine has no network and a call carries at most 64 MiB, so the demo pair cannot go
there. What decides speculation's pay-off there is not the text but the costs: a verify of K
tokens against one step, and a draft token's time inside and around its own decode. Those depend
on the shapes (layers, width, a 151,936-token output layer) and the weight type, not on the
weights' values. So this writes `DIR/target.gguf`, a llama network of Qwen2.5-1.5B's shapes in
F16 (3.1 GB at the defaults), and `DIR/draft.gguf`, its first `--draft-layers` blocks with the
same embeddings and output layer (so the draft token costs what a small model's does, output
layer included). Blocks after the first write into the residual stream at `--later-scale`, so
the truncated draft agrees with the target often enough for rounds to be accepted (about half to
nine tenths of its tokens, by seed and text). The weights are drawn as the tiny models' are
(`tests/tiny_models.make_weights`, in other shapes); writing the defaults takes about a minute
and 6 GB of memory on a 2-core CPU.

The tokenizer is the tiny models' real byte-level BPE (tests/tiny_models.py), grown to `--vocab`
with control tokens whose output rows are zero (as are the end-of-generation tokens'), so the
text never ends early and never lands on a padding token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests")]

from tiny_models import bpe_vocab, make_weights, truncated, with_extra_tokens, write_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--embd", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--ff", type=int, default=8960)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--later-scale", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    base = bpe_vocab()
    vocab = with_extra_tokens(base, args.vocab - len(base))
    tensors = make_weights(
        args.seed,
        args.vocab,
        args.layers,
        n_embd=args.embd,
        n_ff=args.ff,
        n_head=args.heads,
        n_head_kv=args.kv_heads,
        later_scale=args.later_scale,
        dtype=np.float16,
    )
    # control tokens (the padding and the end-of-generation ones) are never the top logit
    out = tensors["output.weight"]
    out[[i for i, kind in enumerate(vocab.types) if kind != 1]] = 0  # 1: a normal token
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, n_layer in (("target", args.layers), ("draft", args.draft_layers)):
        path = args.dir / f"{name}.gguf"
        write_model(path, vocab=vocab, weights=truncated(tensors, n_layer), name=name, n_head=args.heads, n_head_kv=args.kv_heads)
        print(f"{name:6} {path}  {n_layer} layers  {path.stat().st_size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
