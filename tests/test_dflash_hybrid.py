"""Block drafters (DFlash, DSpark, DFlash2) beside a hybrid M-RoPE target: tiny_hybrid's qwen35
(gated delta-net + attention, rope sections: llama.cpp ropes it with four positions a token),
with the tiny drafters of tests/tiny_dflash.py's ``build_hybrid_dflash``, through the real
llama.cpp.

A drafter made for such a target carries M-RoPE sections too, so llama.cpp reads four positions
for each row of its embeddings-only injection batch (a token batch's one position is broadcast):
the target's text position three times, then 0, as llama.cpp's draft-dflash writes them. The
target rolls back through state snapshots (a checkpoint and a replay where a snapshot cannot
serve), and the drafter follows every rollback: exact greedy output, alone and through the
chooser, and after every round the drafter's cache holds what one that caught up from scratch
holds. The tiny drafters spread their sections over the height and width positions as well, and
attend to the injected rows by position, so a row injected with one position (the others left
0) drafts otherwise than a drafter whose sections are the temporal one alone: that is checked."""

from __future__ import annotations

import json
from pathlib import Path

import heads_run
import llama_cpp as ll
import pytest
from heads_run import N_TOKENS, PROMPTS
from test_dflash import check_in_step, cli
from tiny_dflash import BLOCK_SIZE, HYBRID_TARGET_LAYERS, build_hybrid_dflash
from tiny_hybrid import build_hybrid

from specrun.decode.engine import Settings
from specrun.gguf.facts import model_info
from specrun.gguf.heads import head_file_of
from specrun.llama import DFlashHead, LoadOptions, Model

KINDS = ("dflash", "dspark", "dflash2")
K = 6  # drafts per round, fixed


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("dflash-hybrid")
    return {"qwen35": build_hybrid(directory)["qwen35"]} | build_hybrid_dflash(directory)


def load(files: dict[str, Path], drafter: str) -> Model:
    m = Model(files["qwen35"], LoadOptions(n_ctx=1024, n_threads=1, n_batch=64))
    DFlashHead(m, files[drafter])
    return m


@pytest.fixture(scope="module")
def targets(files):
    """The qwen35 target with each kind of drafter attached, and a second copy of each (to catch
    up from scratch and compare with): kind -> (model, fresh model); and "temporal": the DFlash
    drafter with temporal sections alone."""
    out = {kind: (load(files, f"qwen35-{kind}"), load(files, f"qwen35-{kind}")) for kind in KINDS}
    out["temporal"] = (load(files, "qwen35-dflash-temporal"),)
    yield out
    for pair in out.values():
        for m in pair:
            m.close()


@pytest.fixture(scope="module")
def plain(targets):
    target, _ = targets["dflash"]
    return {p: heads_run.run(target, Settings("none"), target.tokenize(p), N_TOKENS)[0] for p in PROMPTS}


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_drafts_beside_the_hybrid_target(targets, kind):
    """llama.cpp 0.3.36 loads the drafter (M-RoPE: four positions a row) beside the qwen35 target
    (snapshots), takes the target's layer inputs after its delta-net layers and drafts a block;
    a snapshot rollback of the target takes the drafter's rows past it too."""
    target, fresh = targets[kind]
    h = target.dflash
    assert target.rollback_method == "snapshots" and h.layers == HYBRID_TARGET_LAYERS
    assert ll.llama_model_rope_type(h._model) == ll.LLAMA_ROPE_TYPE_MROPE
    prompt = target.tokenize(PROMPTS[0])
    target.reset()
    target.eval(prompt[:-1], logits="none")
    b = h.draft(prompt[-1], h.n_past, h.max_draft)
    assert len(b) == h.max_draft == (BLOCK_SIZE if kind == "dspark" else BLOCK_SIZE - 1)
    assert h.cached == h.n_past == len(prompt) - 1
    target.checkpoint()
    target.eval([prompt[-1], *b.tokens], logits="all")  # a verify
    h.draft(prompt[-1], h.n_past, 2)  # (an injection of its rows)
    assert h.cached == h.n_past == len(prompt) + len(b)
    snapshots = target.rollback_stats.snapshots
    target.rollback(len(prompt) + 1)  # the target kept one draft
    assert target.rollback_stats.snapshots == snapshots + 1
    assert h.cached == h.n_past == len(prompt) + 1
    check_in_step(target, fresh, [*prompt, b.tokens[0], 0])


def test_injected_rows_carry_four_positions(targets):
    """The DFlash drafter with sections over the height and width positions too drafts what the
    same drafter with the temporal section alone does, after a prompt and after every round of
    a generation (its rows rolled back and injected again): each injected row is roped at (p, p,
    p, 0), as the block's rows are. Had a row one position (the others 0), its keys would turn
    otherwise on the height and width pairs, and the blocks' logits would differ."""
    target, _ = targets["dflash"]
    (temporal,) = targets["temporal"]
    for prompt in PROMPTS:
        tokens = target.tokenize(prompt)
        for m in (target, temporal):
            m.reset()
            m.eval(tokens[:-1], logits="none")
        got = target.dflash.draft(tokens[-1], target.n_past, K)
        want = temporal.dflash.draft(tokens[-1], temporal.n_past, K)
        heads_run.same_rows(got, want)
    s = Settings("dflash", draft_max=K, p_min=0.0, fixed=True)
    prompt = target.tokenize(PROMPTS[1])
    heads_run.run(target, s, prompt, 24, on_step=lambda e, step: check_in_step(target, temporal, e.tokens))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_dflash_equals_plain_on_the_hybrid_target(targets, plain, kind, prompt):
    """64 tokens with the drafter alone: plain decoding's, some drafts kept and some not, the
    target rolled back through its snapshots, and the drafter in step after every round."""
    target, fresh = targets[kind]
    snapshots = target.rollback_stats.snapshots
    s = Settings("dflash", draft_max=K, p_min=0.0, fixed=True)
    heads_run.exact_and_in_step(target, s, target.tokenize(prompt), plain[prompt], lambda seq: check_in_step(target, fresh, seq))
    assert target.rollback_stats.snapshots > snapshots


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_chooses_among_ngram_and_the_drafter_on_the_hybrid_target(targets, plain, kind):
    target, _ = targets[kind]
    heads_run.hybrid_weighs_the_heads(target, "dflash", K, plain)


def test_restores_and_replays_keep_the_drafter_in_step(targets):
    """Where a snapshot cannot serve, the target restores a checkpoint and replays tokens: a
    near-tie deferring the pending token, a chat turn going back into the prompt. The drafter
    takes none of the replayed rows twice and stays in step; the output is plain decoding's."""
    target, fresh = targets["dflash"]
    s = Settings("dflash", draft_max=K, p_min=0.0, fixed=True)
    restores = target.rollback_stats.restores + target.rollback_stats.full_replays
    prompt = PROMPTS[0]
    want = heads_run.run(target, Settings("none"), target.tokenize(prompt), N_TOKENS)[0]
    heads_run.near_ties_in_step(target, s, target.tokenize(prompt), want, lambda seq: check_in_step(target, fresh, seq))
    heads_run.chat_turns_in_step(target, s, lambda seq: check_in_step(target, fresh, seq))
    assert target.rollback_stats.restores + target.rollback_stats.full_replays > restores


@pytest.mark.parametrize("kind", KINDS)
def test_generate_with_the_drafter_of_a_hybrid_target_from_the_cli(files, kind, capsys):
    """`generate -m qwen35.gguf -d drafter.gguf`: check-pair's header rules let it through, and
    the text is plain decoding's, with the drafter alone and chosen by hybrid."""
    drafter = files[f"qwen35-{kind}"]
    assert head_file_of(model_info(drafter)).mismatch(model_info(files["qwen35"])) is None
    base = ["generate", "-m", str(files["qwen35"]), "-t", "1", "-p", PROMPTS[1], "-n", "32", "--json"]
    code, out, err = cli([*base, "-d", str(drafter), "--draft", "dflash", "--draft-max", str(K), "--fixed"], capsys)
    assert code == 0, err
    drafted = json.loads(out)
    assert drafted["stats"]["by_source"]["dflash"]["rounds"] > 0
    code, out, _ = cli([*base, "--draft", "none"], capsys)
    assert code == 0 and json.loads(out)["tokens"] == drafted["tokens"]
    code, out, err = cli([*base, "-d", str(drafter)], capsys)
    assert code == 0 and json.loads(out)["tokens"] == drafted["tokens"], err
