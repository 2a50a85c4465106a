"""Tiny qwen35 GGUF models with a built-in MTP head that drafts well enough to test with.

Built on tests/tiny_hybrid.py: its 4-block qwen35 (delta-net, attention, delta-net, attention)
with its MTP block (block 4: a full-attention block plus the ``nextn.*`` tensors that llama.cpp's
qwen35 MTP graph reads, ``qwen35.nextn_predict_layers = 1``), written by its ``write_hybrid``.

Nobody trained that head, so it would agree with the target at random. Two changes give it
something to agree on:

* the trunk's blocks write weakly into the residual stream (their output projections scaled by
  TRUNK_SCALE), so the target's next token depends mostly on the current one;
* the head is *taught*: its ``eh_proj`` passes the embedding of the token it is fed straight
  through, and its own block writes little, so it guesses what the target says after that
  token. Over a greedy run it is right about a third of the time, so the tests see accepts,
  rejects and near-ties alike.

    paths = build_mtp(tmp_dir)      # {"mtp": Path, "mtp-stripped": Path}

(An all-attention qwen35, ``full_attention_interval`` 1, is no way around the recurrent state:
llama.cpp aborts on its empty recurrent cache.)
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tiny_hybrid import N_LAYER, TARGET_SEED, qwen35_weights, write_hybrid
from tiny_models import N_EMBD, Weights, bpe_vocab

TRUNK_LAYERS = N_LAYER  # the MTP head is block N_LAYER
MTP_SEED = TARGET_SEED + 40
TRUNK_SCALE = 0.2  # the trunk blocks' output projections, scaled
HEAD_SCALE = 0.2  # the head block's own output projections, scaled
_WRITES = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight")  # what a block adds to the residual


def taught(weights: Weights, head: int = TRUNK_LAYERS) -> Weights:
    """``weights`` (a qwen35 with an MTP block ``blk.{head}``) with a weak trunk and a taught head."""
    out = dict(weights)
    for name, w in weights.items():
        if name.startswith("blk.") and name.endswith(_WRITES):
            out[name] = w * (HEAD_SCALE if int(name.split(".")[1]) == head else TRUNK_SCALE)
    eh = weights[f"blk.{head}.nextn.eh_proj.weight"] * 0.3  # [normed embedding ; normed state] -> n_embd
    eh[:, :N_EMBD] += np.eye(N_EMBD, dtype=np.float32)
    out[f"blk.{head}.nextn.eh_proj.weight"] = eh.astype(np.float32)
    return out


def mtp_block(weights: Weights, head: int = TRUNK_LAYERS) -> Weights:
    """The MTP block's own tensors."""
    return {k: w for k, w in weights.items() if k.startswith(f"blk.{head}.")}


def mtp_variants() -> dict[str, Weights]:
    full = taught(qwen35_weights(MTP_SEED, len(bpe_vocab()), mtp=True))
    return {"mtp": full, "mtp-stripped": {k: w for k, w in full.items() if not k.startswith(f"blk.{TRUNK_LAYERS}.")}}


def build_mtp(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """The MTP variants, as ``<directory>/<name>.gguf`` (idempotent):

    mtp           the taught qwen35 with one MTP head
    mtp-stripped  the same trunk with the head (and so nextn_predict_layers) removed, as a
                  conversion or quant that drops the heads leaves it
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = bpe_vocab()
    return {
        name: write_hybrid(directory / f"{name}.gguf", "qwen35", vocab=vocab, weights=w, name=f"tiny-{name}")
        for name, w in mtp_variants().items()
    }


if __name__ == "__main__":
    import sys

    for variant, written in build_mtp(sys.argv[1] if len(sys.argv) > 1 else ".").items():
        print(f"{variant:14} {written}  {written.stat().st_size:,} bytes")
