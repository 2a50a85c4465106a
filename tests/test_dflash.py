"""Block drafters (arch ``dflash``: DFlash, DSpark, DFlash2) as the draft (``-d drafter.gguf``), on
tiny taught drafters over tiny_models' llama target (tests/tiny_dflash.py), through the real
llama.cpp: what the header says (inspect, check-pair), the one-line refusals of files llama.cpp
would refuse or abort on, and the drafter drafting through the engine: exact greedy output with
it alone and with the chooser, its cache in step with the target after every round (its KV
positions, and its next block against a drafter that caught up from scratch), and sampling that
keeps the target's distribution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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
from tiny_models import TARGET_SEED, bpe_vocab, make_weights

from specrun.cli.main import main
from specrun.errors import EXIT_FAIL
from specrun.gguf.facts import model_info
from specrun.gguf.heads import HeadFile, head_file_of

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
