"""Block drafters (arch ``dflash``: DFlash, DSpark, DFlash2) as the draft (``-d drafter.gguf``), on
tiny taught drafters over tiny_models' llama target (tests/tiny_dflash.py), through the real
llama.cpp: what the header says (inspect, check-pair), the one-line refusals of files llama.cpp
would refuse or abort on, and the drafter drafting through the engine: exact greedy output with
it alone and with the chooser, its cache in step with the target after every round (its KV
positions, and its next block against a drafter that caught up from scratch), and sampling that
keeps the target's distribution."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import heads_run
import llama_cpp as ll
import numpy as np
import pytest
from heads_run import FLAT, N_TOKENS, PROMPTS
from tiny_dflash import (
    BLOCK_SIZE,
    DFLASH2_KEYS,
    DSPARK_KEYS,
    MASK_TOKEN,
    TARGET_LAYERS,
    WIDE,
    build_dflash,
    dflash2_weights,
    dflash_weights,
    dspark_weights,
    write_dflash,
)
from tiny_eagle3 import build_eagle3
from tiny_models import TARGET_SEED, bpe_vocab, make_weights

from specrun.cli.main import main
from specrun.decode.costs import CostModel
from specrun.decode.engine import Settings
from specrun.decode.sampling import Sampler, greedy_confidence
from specrun.decode.sources.dflash import DFlashSource
from specrun.errors import EXIT_FAIL, EXIT_INPUT, EXIT_USAGE, BadModelFile, UsageError
from specrun.gguf.facts import model_info
from specrun.gguf.heads import HeadFile, head_file_of
from specrun.llama import DFlashHead, Eagle3Head, LoadOptions, Model
from specrun.llama import dflash as dflash_backend
from specrun.llama.dflash import BLOCK_TOP_K

KINDS = ("dflash", "dspark", "dflash2")


@pytest.fixture(scope="session")
def drafters(tmp_path_factory) -> dict[str, Path]:
    return build_dflash(tmp_path_factory.mktemp("dflash"))


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line, err
    return line


# --- the header ---------------------------------------------------------------------------


def test_the_header_says_which_kind_and_which_target(tiny, drafters):
    target = model_info(tiny["target"])
    mask = bpe_vocab().id_of(MASK_TOKEN)
    names = {"dflash": "DFlash", "dspark": "DSpark", "dflash2": "DFlash2"}
    for kind, name in names.items():
        h = head_file_of(model_info(drafters[kind]))
        drafts = BLOCK_SIZE if kind == "dspark" else BLOCK_SIZE - 1  # DSpark's first row guesses too
        assert (h.source, h.variant, h.kind, h.block_size, h.mask_token) == ("dflash", kind, f"a {name} drafter", BLOCK_SIZE, mask)
        assert h.max_draft == drafts
        assert h.target_layers == TARGET_LAYERS and not h.own_embeddings and not h.own_output
        assert h.describe() == f"{name} block drafter for a 64-wide target (reads its layers 0, 1; blocks of 8, up to {drafts} drafts each)"
        assert h.mismatch(target) is None
        assert HeadFile.from_json(json.loads(json.dumps(h.to_json()))) == h
    wide = head_file_of(model_info(drafters["dflash-wide"]))
    assert wide.mismatch(target) == f"it was trained for a {WIDE}-wide target, and target.gguf is 64 wide"


def malformed(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A drafter file llama.cpp would refuse to load or abort on, and what refuses it."""
    vocab = bpe_vocab()
    target = make_weights(TARGET_SEED, len(vocab))
    base = dflash_weights(target, vocab)
    path = tmp_path / f"{case.replace(' ', '-')}.gguf"
    kw: dict = {}
    if case == "no target layers":
        kw, why = {"target_layers": None}, "it names no target layers (dflash.target_layers), which llama.cpp needs to load it"
    elif case == "a layer past the target's":
        kw, why = {"target_layers": (0, 5)}, "it reads the target's layers [0, 5], and target.gguf has 2 (0..1)"
    elif case == "no mask token":
        kw, why = {"mask_token": None}, "it has no mask token (tokenizer.ggml.mask_token_id) to fill its blocks with"
    elif case == "a block of one":
        kw, why = {"block_size": 1}, "its blocks are 1 rows long (dflash.block_size): nothing to draft"
    elif case == "DSpark without a block size":
        base, kw = dspark_weights(base, target), {"block_size": None, "extra": DSPARK_KEYS}
        why = "a DSpark drafter needs dflash.block_size, and it has none"
    elif case == "DFlash2 without its selector keys":
        base, kw = dflash2_weights(base), {"extra": {k: v for k, v in DFLASH2_KEYS.items() if k != "selector_top_k"}}
        why = "a DFlash2 drafter needs dflash.selector_top_k, and it lacks them"
    else:
        assert case == "a wrong width"
        return write_dflash(path, vocab=vocab, weights=dflash_weights(target, vocab, n_embd=WIDE), n_embd=WIDE, name="bad"), (
            f"it was trained for a {WIDE}-wide target, and target.gguf is 64 wide"
        )
    return write_dflash(path, vocab=vocab, weights=base, name="bad", **kw), why


MALFORMED = [
    "no target layers",
    "a layer past the target's",
    "a wrong width",
    "no mask token",
    "a block of one",
    "DSpark without a block size",
    "DFlash2 without its selector keys",
]


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_drafter_is_refused_from_its_header(tiny, tmp_path, case):
    path, why = malformed(tmp_path, case)
    assert head_file_of(model_info(path)).mismatch(model_info(tiny["target"])) == why


def test_inspect_shows_the_kind(drafters, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    code, out, _ = cli(["inspect", str(drafters["dspark"])], capsys)
    text = " ".join(out.split())
    assert code == 0 and "DSpark block drafter for a 64-wide target (reads its layers 0, 1; blocks of 8, up to 8 drafts each)" in text
    assert "borrows the target's token embeddings and output head" in text
    code, out, _ = cli(["inspect", str(drafters["dflash2"]), "--json"], capsys)
    head = json.loads(out)["draft_head"]
    assert (head["source"], head["variant"], head["block_size"], head["target_layers"]) == (
        "dflash",
        "dflash2",
        BLOCK_SIZE,
        list(TARGET_LAYERS),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_check_pair_recognises_the_kind(tiny, drafters, kind, capsys):
    code, out, _ = cli(["check-pair", "-m", str(tiny["target"]), "-d", str(drafters[kind])], capsys)
    text = " ".join(out.split())
    assert code == 0 and "block drafter for a 64-wide target" in text and "it fits this target; --draft dflash drafts with it" in text
    code, out, _ = cli(["check-pair", "-m", str(tiny["target"]), "-d", str(drafters["dflash-wide"]), "--json"], capsys)
    report = json.loads(out)
    assert code == EXIT_FAIL and not report["ok"] and not report["draft_head"]["matches"]


def test_check_pair_calls_a_malformed_drafter_unusable(tiny, tmp_path, capsys):
    path, why = malformed(tmp_path, "no mask token")
    code, out, _ = cli(["check-pair", "-m", str(tiny["target"]), "-d", str(path)], capsys)
    assert code == EXIT_FAIL and f"unusable: {why}" in " ".join(out.split())


# --- the drafter beside the target, through the real llama.cpp ---------------------------------


def load(path: Path, drafter: Path, sampled: bool | None = None) -> Model:
    m = Model(path, LoadOptions(n_ctx=1024, n_threads=1, n_batch=64))
    DFlashHead(m, drafter, sampled=sampled)
    return m


# which drafters sample their block's rows in llama.cpp (the default off a GPU is not to): the
# DFlash drafter does and its fresh copy does not, the DSpark one the other way round, so every
# in-step check compares the two ways of reading a block, and the engine's tests run on both
SAMPLED = {"dflash": (True, False), "dspark": (False, True), "dflash2": (None, None)}


@pytest.fixture(scope="module")
def targets(tiny, drafters):
    """The target with each kind of drafter attached, and a second copy of each (to catch up
    from scratch and compare with): kind -> (model, fresh model)."""
    out = {kind: tuple(load(tiny["target"], drafters[kind], s) for s in SAMPLED[kind]) for kind in KINDS}
    yield out
    for pair in out.values():
        for m in pair:
            m.close()


def check_in_step(target: Model, fresh: Model, seq: list[int]) -> None:
    """The drafter accounts for exactly the target's positions (injected, or queued), its cache
    holds positions 0.. and nothing past them (no block's cells, no rejected row's), and its next
    block equals that of a drafter that caught up with the same sequence in one batch."""
    h, f = target.dflash, fresh.dflash
    assert isinstance(h, DFlashHead) and isinstance(f, DFlashHead)
    assert target.n_past == h.n_past == len(seq) - 1 and target.tokens == seq[:-1]
    assert h.cached == h.injected <= h.n_past and h.n_past - h.injected < h.n_batch
    assert int(ll.llama_memory_seq_pos_min(h._mem, 0)) in (0, -1)
    fresh.reset()
    fresh.eval(seq[:-1], logits="none")
    got = h.draft(seq[-1], h.n_past, h.max_draft)
    assert h.cached == h.injected == h.n_past  # the queue went in with the block, whose cells are gone again
    want = f.draft(seq[-1], f.n_past, f.max_draft)
    assert got.tokens == want.tokens
    heads_run.same_rows(got, want)
    if got.stated is not None:
        np.testing.assert_allclose(got.stated, want.stated, atol=1e-3)


def whole_rows(h: DFlashHead, last: int):
    """The block ``h`` would draft now after ``last``, its rows read back whole (no sampler)."""
    ll.llama_set_sampler(h._ctx, 0, None)
    ll.llama_sampler_free(h._chain)  # (a chain is set up for one context once)
    h._chain = None
    try:
        return h.draft(last, h.n_past, h.max_draft)
    finally:
        h._chain = h._sample_rows(h._ctx)
        assert h._chain is not None


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_loads_and_drafts_a_block(targets, kind):
    """llama.cpp 0.3.36 loads the drafter beside the target, takes its layer inputs and drafts a
    block in one decode; the block's cells are removed afterwards, and a rollback of the target
    removes injected rows the drafter held past it."""
    target, fresh = targets[kind]
    h = target.dflash
    prompt = target.tokenize(PROMPTS[0])
    target.reset()
    target.eval(prompt[:-1], logits="none")
    assert h.n_past == len(prompt) - 1 and h.injected == 0  # queued: it goes in with the first block
    decodes = h.decodes
    b = h.draft(prompt[-1], h.n_past, h.max_draft)
    assert h.decodes == decodes + 2  # the injection, then the block
    assert len(b) == h.max_draft == (BLOCK_SIZE if kind == "dspark" else BLOCK_SIZE - 1)
    assert all(0 <= t < target.n_vocab for t in b.tokens) and h.cached == h.n_past
    if kind == "dflash":
        assert b.stated is None
    else:  # DSpark's confidence head, DFlash2's selector
        assert b.stated is not None and all(0.0 < c < 1.0 for c in b.stated)
    assert (h._chain is not None) == bool(SAMPLED[kind][0])
    if kind != "dflash2" and h._chain is None:  # rows read back whole
        assert b.logits is not None and b.tokens == [int(x) for x in np.argmax(b.logits, axis=1)]
    if h._chain is not None:  # rows sampled where the logits are: each row's top k, as the whole rows have them
        assert b.logits is None and b.candidates is not None and b.candidates.shape == (len(b), BLOCK_TOP_K)
        whole = whole_rows(h, prompt[-1])
        assert b.tokens == [int(x) for x in np.argmax(whole.logits, axis=1)]
        for i in range(len(b)):
            order = np.argsort(-whole.logits[i], kind="stable")[:BLOCK_TOP_K]
            assert set(b.candidates[i]) == set(order)
            np.testing.assert_allclose(b.row(i)[order], whole.logits[i][order], atol=1e-4)
            assert np.isneginf(np.delete(b.row(i), order)).all()
            assert b.confidence(i) == pytest.approx(greedy_confidence(b.row(i), b.tokens[i]), rel=1e-6)
    target.eval([prompt[-1], *b.tokens], logits="all")  # a verify: its rows are queued
    h.draft(prompt[-1], h.n_past, 2)  # (an injection of them all)
    assert h.cached == h.n_past == len(prompt) + len(b)
    target.rollback(len(prompt) + 1)  # the target kept one draft
    assert h.cached == h.n_past == len(prompt) + 1
    check_in_step(target, fresh, [*prompt, b.tokens[0], 0])


def test_the_backend_refuses_a_drafter_for_another_target(tiny, tmp_path):
    path, _ = malformed(tmp_path, "a layer past the target's")
    with Model(tiny["target"], LoadOptions(n_ctx=256, n_threads=1, n_batch=64)) as m:
        with pytest.raises(UsageError, match=r"reads the target's layers \[0, 5\]"):
            DFlashHead(m, path)
        assert m.dflash is None
        with pytest.raises(BadModelFile, match="no mask token"):
            DFlashHead(m, malformed(tmp_path, "no mask token")[0])


def test_a_drafter_attached_late_catches_up(tiny, drafters, targets):
    target, _ = targets["dflash"]
    prompt = target.tokenize(PROMPTS[1])
    with Model(tiny["target"], LoadOptions(n_ctx=1024, n_threads=1, n_batch=64)) as late:
        late.eval(prompt[:-1], logits="none")
        h = DFlashHead(late, drafters["dflash"])
        assert late.dflash is h and h.n_past == late.n_past == len(prompt) - 1
        target.reset()
        target.eval(prompt[:-1], logits="none")
        heads_run.same_rows(h.draft(prompt[-1], h.n_past, 3), target.dflash.draft(prompt[-1], h.n_past, 3))
    assert late.dflash is None and h._ctx is None  # closed with its target


def test_closing_one_head_leaves_another_reading_the_same_layers(tiny, drafters, targets, tmp_path):
    """An EAGLE-3 head and a block drafter on one target both read its layers 0 and 1. Closing
    the EAGLE-3 head leaves those layers handed out: the drafter's next block, from a prompt the
    target decoded after the close, is the one a target with the drafter alone drafts."""
    eagle3 = build_eagle3(tmp_path)["eagle3"]
    alone, _ = targets["dflash"]
    prompt = alone.tokenize(PROMPTS[0])
    with Model(tiny["target"], LoadOptions(n_ctx=1024, n_threads=1, n_batch=64)) as both:
        h = DFlashHead(both, drafters["dflash"])
        Eagle3Head(both, eagle3).close()
        assert both.eagle3 is None and both.dflash is h
        both.eval(prompt[:-1], logits="none")
        alone.reset()
        alone.eval(prompt[:-1], logits="none")
        got, want = h.draft(prompt[-1], h.n_past, 4), alone.dflash.draft(prompt[-1], alone.n_past, 4)
        assert got.tokens == want.tokens
        heads_run.same_rows(got, want)


# --- drafting through the engine ------------------------------------------------------------

K = 6  # drafts per round, fixed


@pytest.fixture(scope="module")
def plain(targets):
    target, _ = targets["dflash"]
    return {p: heads_run.run(target, Settings("none"), target.tokenize(p), N_TOKENS)[0] for p in PROMPTS}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_dflash_equals_plain(targets, plain, kind, prompt):
    """64 tokens with the drafter alone (every round drafts K tokens from one block): plain
    decoding's, some drafts kept and some not, and the drafter in step after every round."""
    target, fresh = targets[kind]
    s = Settings("dflash", draft_max=K, p_min=0.0, fixed=True)
    heads_run.exact_and_in_step(target, s, target.tokenize(prompt), plain[prompt], lambda seq: check_in_step(target, fresh, seq))


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_chooses_among_ngram_and_the_drafter(targets, plain, kind):
    target, _ = targets[kind]
    heads_run.hybrid_weighs_the_heads(target, "dflash", K, plain)


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_keeps_the_targets_distribution(targets, kind):
    """Each draft is drawn from its row's law (DFlash2's: the selector's scores given the draft
    before), and that law is the one the exact acceptance is told."""
    heads_run.sampling_follows_the_target(targets[kind][0], "dflash", kept=0.05)


def test_the_law_check_catches_a_wrong_law(targets, monkeypatch):
    """The same check fails a source that tells the engine its rows' laws but drafts their
    argmaxes (sampling forgotten): the output's law is then not the target's. (Telling a one-hot
    law for a sampled draft would not do: that is exact, as an n-gram draft is.)"""
    propose = DFlashSource.propose

    def greedy(self, *a, **kw):
        p = propose(self, *a, **kw)
        return dataclasses.replace(p, tokens=[q.top[0] for q in p.dists])

    monkeypatch.setattr(DFlashSource, "propose", greedy)
    tv, limit, _ = heads_run.sampling_law(targets["dflash"][0], "dflash")
    assert tv > limit, (tv, limit)


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_is_as_long_as_the_round_plans_and_priced_at_that_length(targets, kind, monkeypatch):
    """Every row of a block pays for the target's output head (on a CPU, 16 rows can cost more
    than a target step), so a round planned at k drafts a block of k, never the drafter's longest,
    and the chooser prices it off the block times measured at several lengths."""
    target, _ = targets[kind]
    h = target.dflash
    asked: list[int] = []
    draft = DFlashHead.draft

    def counted(self, last_token, pos, n):
        asked.append(n)
        return draft(self, last_token, pos, n)

    monkeypatch.setattr(DFlashHead, "draft", counted)
    src = DFlashSource(h, Sampler(0.0), np.random.default_rng(0), target.n_vocab, CostModel(dict(FLAT)), h.max_draft)
    prompt = target.tokenize(PROMPTS[1])
    target.reset()
    target.eval(prompt[:-1], logits="none")
    src.begin(prompt, lambda: True)
    assert src.block_s is not None and set(asked) == {int(n) for n in src.sizes} and src.sizes[-1] == h.max_draft
    for i, n in enumerate(src.sizes):  # the curve is what was measured, and read between its points
        assert src.cost(int(n)) == pytest.approx(src.block_s[i])
    assert src.cost(3) == pytest.approx((src.block_s[1] + src.block_s[2]) / 2)
    for k in (1, 3, h.max_draft):
        asked.clear()
        p = src.propose(prompt, k, 0.0)
        assert asked == [k] and len(p.tokens) == k


# --- the CLI --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_drafter_is_one_line_through_the_cli(tiny, tmp_path, case, capsys):
    """Refused from the headers before anything loads: a file llama.cpp would refuse or abort on
    is a bad input (exit 3), one made for another target a usage error (exit 2)."""
    path, why = malformed(tmp_path, case)
    code, out, err = cli(["generate", "-m", str(tiny["target"]), "-d", str(path), "-p", "hi", "-n", "4"], capsys)
    fault = head_file_of(model_info(path)).fault is not None
    assert code == (EXIT_INPUT if fault else EXIT_USAGE) and out == ""
    line = one_line(err)
    assert why in line and line.startswith("specrun: error: "), line
    assert "cannot be used" in line if fault else "cannot draft for target.gguf" in line


def test_the_mode_and_the_file_are_not_mistaken_for_each_other(tiny, drafters, capsys):
    code, out, err = cli(["generate", "-m", str(tiny["target"]), "-d", str(drafters["dflash"]), "--draft", "model", "-p", "hi"], capsys)
    assert code == EXIT_USAGE and out == "" and "--draft model needs a draft model, and dflash.gguf is a DFlash drafter" in one_line(err)
    code, out, err = cli(
        ["generate", "-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "--draft", "dflash", "-p", "hi"], capsys
    )
    assert code == EXIT_USAGE and "--draft dflash needs a block drafter" in one_line(err)
    code, out, err = cli(["generate", "-m", str(tiny["target"]), "--draft", "dflash", "-p", "hi"], capsys)
    assert code == EXIT_USAGE and "no block drafter for" in one_line(err)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_with_the_drafter_from_the_cli(tiny, drafters, kind, capsys):
    """`generate -d drafter.gguf`: the drafter is loaded beside the target, drafts (alone, and
    chosen by hybrid where verifying is dear enough), and the text is plain decoding's."""
    base = ["generate", "-m", str(tiny["target"]), "-t", "1", "-p", PROMPTS[1], "-n", "32", "--json"]
    code, out, err = cli([*base, "-d", str(drafters[kind]), "--draft", "dflash", "--draft-max", str(K), "--fixed"], capsys)
    assert code == 0, err
    drafted = json.loads(out)
    assert f"drafting with the {head_file_of(model_info(drafters[kind])).kind.removeprefix('a ')} {kind}.gguf" in err
    assert drafted["stats"]["by_source"]["dflash"]["rounds"] > 0
    code, out, _ = cli([*base, "--draft", "none"], capsys)
    assert code == 0 and json.loads(out)["tokens"] == drafted["tokens"]
    code, out, err = cli([*base, "-d", str(drafters[kind])], capsys)  # hybrid, the default
    assert code == 0 and json.loads(out)["tokens"] == drafted["tokens"], err


def test_bench_runs_the_drafter_beside_plain_decoding(tiny, drafters, tmp_path, capsys):
    """`bench -d drafter.gguf --draft dflash`: the drafter drafts (counted by source) and the text
    is plain decoding's."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"class": "c", "prompt": p, "chat": False}) + "\n" for p in PROMPTS[:2]), encoding="utf-8")
    argv = ["bench", "-m", str(tiny["target"]), "-d", str(drafters["dspark"]), "-t", "1", "-c", "512", "--runs", "1", "-n", "24"]
    code, out, err = cli([*argv, "--prompts", str(prompts), "--draft", "dflash", "--fixed", "--draft-max", str(K), "--json"], capsys)
    assert code == 0, err
    overall = json.loads(out)["classes"]["overall"]
    assert list(overall) == ["none", "dflash"] and overall["dflash"]["identical_to_plain"] is True
    drafting = {k: v for k, v in overall["dflash"]["by_source"].items() if v["drafted"]}
    assert list(drafting) == ["dflash"] and drafting["dflash"]["drafted"] == overall["dflash"]["drafted"] > 0


def test_a_block_drafter_put_beside_the_target_is_found_and_drafts(tiny, drafters, tmp_path, capsys):
    """As llama.cpp looks for one: a ``dflash*.gguf`` or ``dspark*.gguf`` (any case) in the
    target's folder, made for this target by its header, is the draft of ``--draft hybrid`` (the
    default) and ``--draft dflash`` with no ``-d``, and ``drafts`` lists it. One made for another
    target, or not so named, is left alone; a ``-d`` given wins."""
    folder = tmp_path / "models"
    folder.mkdir()
    target = folder / "target.gguf"
    target.symlink_to(tiny["target"])
    (folder / "dflash-wide.gguf").symlink_to(drafters["dflash-wide"])  # for a wider target
    (folder / "notes.gguf").symlink_to(drafters["dspark"])  # not named as a drafter
    base = ["generate", "-m", str(target), "-t", "1", "-p", PROMPTS[1], "-n", "32", "--json"]
    code, out, err = cli([*base, "--draft", "dflash"], capsys)
    assert code == EXIT_USAGE and "no block drafter for" in one_line(err)

    (folder / "DSpark-Tiny.gguf").symlink_to(drafters["dspark"])
    code, out, err = cli([*base, "--draft", "dflash", "--draft-max", str(K), "--fixed"], capsys)
    assert code == 0, err
    found = json.loads(out)
    assert "DSpark-Tiny.gguf" in err and found["stats"]["by_source"]["dflash"]["rounds"] > 0
    code, out, err = cli(base, capsys)  # hybrid, the default
    assert code == 0 and "DSpark-Tiny.gguf" in err and json.loads(out)["tokens"] == found["tokens"]
    code, out, err = cli([*base, "-d", str(drafters["dflash"])], capsys)
    assert code == 0 and "DSpark-Tiny.gguf" not in err and "dflash.gguf" in err

    code, out, _ = cli(["drafts", str(target), "--json"], capsys)
    listed = json.loads(out)
    assert [d["refs"] for d in listed["drafts"]] == [["DSpark-Tiny.gguf"]]
    assert ["dflash-wide.gguf"] in [c["refs"] for c in listed["cannot_draft"]]


@pytest.mark.parametrize("head", ["dflash", "eagle3"])
def test_a_target_whose_graph_hands_out_no_layer_inputs_is_refused_in_one_line(tiny, drafters, tmp_path, head, capsys):
    """llama.cpp 0.3.36's qwen2 graph (the demo target's architecture) records no layer inputs:
    asked for them, it stops in an assert at the first decode. A block drafter or an EAGLE-3 head
    for such a target is refused from the headers, before anything loads, exit 2; check-pair says
    why."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "tools"))
    import as_llama

    target = as_llama.rewrite(tiny["target"], tmp_path / "qwen2-target.gguf", "qwen2")  # the same network, a qwen2 header
    draft = drafters["dflash"] if head == "dflash" else build_eagle3(tmp_path / "eagle3")["eagle3"]
    code, out, err = cli(["generate", "-m", str(target), "-d", str(draft), "-p", "hi", "-n", "2", "-t", "1"], capsys)
    assert code == EXIT_USAGE and "not qwen2's" in one_line(err) and not out
    code, out, _ = cli(["check-pair", "-m", str(target), "-d", str(draft), "--json"], capsys)
    assert code == EXIT_FAIL and "not qwen2's" in json.dumps(json.loads(out)["draft_head"])
    code, out, err = cli(["generate", "-m", str(tiny["target"]), "-d", str(draft), "-p", "hi", "-n", "2", "-t", "1"], capsys)
    assert code == 0, err  # the llama header of the same network hosts it


@pytest.mark.parametrize(
    "gpu, opts, n_layer, want",
    [
        (False, LoadOptions(), 4, False),  # this machine: rows come back whole
        (True, LoadOptions(), 4, True),  # every layer on the GPU, and so the output head
        (True, LoadOptions(n_gpu_layers=5), 4, True),
        (True, LoadOptions(n_gpu_layers=4), 4, False),  # the layers, not the head
        (True, LoadOptions(devices=()), 4, False),  # the CPU alone
    ],
)
def test_rows_are_sampled_by_default_only_where_the_output_head_is_on_a_gpu(monkeypatch, gpu, opts, n_layer, want):
    monkeypatch.setattr(dflash_backend, "supports_gpu_offload", lambda: gpu)
    assert dflash_backend._output_on_device(opts, n_layer) is want
