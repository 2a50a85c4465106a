"""End to end on the real demo pair: Qwen2.5-Coder 1.5B target, 0.5B draft."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.learned import Learned
from specrun.decode.sampling import Sampler
from specrun.llama import LoadOptions, Model

# chat-formatted prompts of at least 64 tokens, of different kinds
SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
PROMPTS = [
    SYSTEM
    + "<|im_start|>user\nWrite a Python function that parses an ISO 8601 date string such as 2024-05-17T08:30:00+02:00 and returns a timezone-aware datetime. Raise ValueError with a helpful message on bad input, add a docstring with two examples, and keep it under thirty lines.<|im_end|>\n<|im_start|>assistant\n",
    SYSTEM
    + "<|im_start|>user\nRename the function `area` to `rect_area` and return the whole file:\n\n```python\ndef area(w, h):\n    return w * h\n\n\ndef total(shapes):\n    return sum(area(w, h) for w, h in shapes)\n```<|im_end|>\n<|im_start|>assistant\n",
    SYSTEM
    + "<|im_start|>user\nExplain in three short sentences what a hash map is, how it finds a key in constant time on average, and when a plain Python list is the better choice for storing and looking up a small number of items.<|im_end|>\n<|im_start|>assistant\n",
]
FLAT = {b: 0.01 for b in (1, 2, 4, 8, 16)}  # makes the adaptive chooser draft


@pytest.fixture(scope="module")
def pair(demo):
    opts = LoadOptions(n_ctx=1024, n_threads=2)
    t, d = Model(demo["target"], opts), Model(demo["draft"], opts)
    yield t, d
    t.close()
    d.close()


def run(t, d, settings, prompt, n=64, cost=None):
    # every run starts from empty caches: a prefix cached by an earlier batch of another
    # shape differs by llama.cpp's batch-size noise, and that alone can flip a near-tie
    t.reset()
    if d is not None:
        d.reset()
    e = Engine(t, d, settings, Sampler(0.0), learned=Learned(CostModel(dict(cost or FLAT)), {"model": {"per_token": 0.001}}))
    toks = t.tokenize(prompt, add_special=False)
    assert len(toks) >= 64
    out, stats = [], None
    for step in e.generate(toks, n):
        out.extend(step.tokens)
        stats = step.stats
    return out, stats


# llama.cpp's batched kernels differ from its one-token kernels by up to ~0.5 logit on this
# Q4_K_M target, and a KV cache filled by batches differs slightly from one filled token by
# token. specrun leaves near-ties (gap < --tie-margin) to a one-token step, but a tie closer
# than the KV noise can still flip. So: identical, or the first difference sits at a position
# where the plain run's own top-two gap is below the measured batch noise. A real bug (a
# wrong accept, a bad rollback) shows up at a confident position and fails this.
BATCH_NOISE = 0.5


def plain_gaps(t, prompt, plain):
    """Top-1 minus top-2 logit at each generated position, on the plain one-token path."""
    toks = t.tokenize(prompt, add_special=False)
    t.reset()
    t.eval(toks[:-1], logits="none")
    gaps = []
    for x in (toks + plain)[len(toks) - 1 : len(toks) + len(plain) - 1]:
        row = t.eval([x], logits="last")[0]
        top2 = np.partition(row, -2)[-2:]
        gaps.append(float(abs(top2[1] - top2[0])))
    return gaps


def check_same(label, out, plain, gaps):
    """0 if ``out`` is ``plain``; 1 if it differs first at a near-tie. ``gaps()`` is the plain
    run's gaps, computed (one more pass of the target) only when a run differs."""
    i = next((j for j, (a, b) in enumerate(zip(out, plain)) if a != b), None)
    if i is None:
        assert len(out) == len(plain), label
        return 0
    gap = gaps()[i]
    assert gap < BATCH_NOISE, f"{label}: differs at {i}, where the plain gap is {gap:.3f} (confident)"
    return 1


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_qwen_pair_matches_plain_up_to_llama_cpp_batch_noise(pair, i):
    t, d = pair
    plain, _ = run(t, None, Settings("none"), PROMPTS[i])
    fixed, fs = run(t, d, Settings("model", draft_max=4, p_min=0.0, fixed=True), PROMPTS[i])
    hybrid, hs = run(t, d, Settings("hybrid", draft_max=8), PROMPTS[i])
    ngram, _ = run(t, None, Settings("ngram", draft_max=8), PROMPTS[i])
    found: list[list[float]] = []

    def gaps() -> list[float]:
        if not found:
            found.append(plain_gaps(t, PROMPTS[i], plain))
        return found[0]

    flips = sum(check_same(n, o, plain, gaps) for n, o in (("fixed", fixed), ("hybrid", hybrid), ("ngram", ngram)))
    assert fs.n_drafted > 0 and fs.acceptance_rate > 0.4
    print(f"prompt {i}: acceptance {fs.acceptance_rate:.2f}, mean accepted {fs.mean_accept_len:.2f}, {flips}/3 runs flipped one")


def test_qwen_pair_detokenizes_to_sensible_code(pair):
    t, d = pair
    out, stats = run(t, d, Settings("model", draft_max=4, p_min=0.0, fixed=True), PROMPTS[0], n=48)
    text = t.detokenize(out).decode("utf-8", errors="replace")
    assert "def " in text and "datetime" in text
