"""Gemma 4's MTP assistant (arch ``gemma4-assistant``) as the draft (``-d mtp-*.gguf``), on a tiny
Gemma 4 target and its taught assistant (tests/tiny_gemma4.py), through the real llama.cpp:
what the headers say, the one-line refusals, and the assistant drafting as the source ``mtp``:
exact greedy output, in step with the target after every round (the state it starts from, and
its next guess against an assistant beside a target that decoded the sequence in one batch),
chat turns, the chooser weighing it with the n-gram lookup, sampling in distribution. The
assistant attends over the target's own KV cache, so the target's cache must come out of its
drafts untouched: the exact output says so, and so does a target whose assistant was reset."""

from __future__ import annotations

import json
from pathlib import Path

import heads_run
import numpy as np
import pytest
from heads_run import N_TOKENS, PROMPTS
from tiny_gemma4 import N_EMBD, build_gemma4

from specrun.cli.main import main
from specrun.decode.engine import Settings
from specrun.errors import EXIT_FAIL, EXIT_USAGE
from specrun.gguf.facts import model_info
from specrun.gguf.heads import HeadFile, head_file_of, heads_of
from specrun.llama import Gemma4Assistant, LoadOptions, Model

K = 6


@pytest.fixture(scope="session")
def gemma4(tmp_path_factory) -> dict[str, Path]:
    return build_gemma4(tmp_path_factory.mktemp("gemma4"))


def load(paths: dict[str, Path]) -> Model:
    m = Model(paths["gemma4"], LoadOptions(n_ctx=1024, n_threads=1, n_batch=64))
    Gemma4Assistant(m, paths["mtp-gemma4"])
    return m


@pytest.fixture(scope="module")
def target(gemma4):
    m = load(gemma4)
    yield m
    m.close()


@pytest.fixture(scope="module")
def fresh(gemma4):
    m = load(gemma4)
    yield m
    m.close()


def run(target: Model, settings: Settings, prompt: list[int], n: int = N_TOKENS, **kw):
    return heads_run.run(target, settings, prompt, n, **kw)


def check_in_step(target: Model, fresh: Model, seq: list[int]) -> None:
    """The assistant accounts for the target's positions (all in the target's cache, none
    queued), starts from the target's state at the last cached position, and guesses what an
    assistant beside a target that decoded the sequence in one batch guesses."""
    h, f = target.heads, fresh.heads
    assert isinstance(h, Gemma4Assistant) and isinstance(f, Gemma4Assistant)
    assert target.n_past == h.n_past == h.cached == len(seq) - 1 and h.queued == 0
    fresh.reset()
    fresh.eval(seq[:-1], logits="none")
    np.testing.assert_allclose(h.state_before(h.n_past), f.state_before(f.n_past), atol=2e-3)
    got = h.draft_step(seq[-1]).copy()
    h.end_draft()
    want = f.draft_step(seq[-1]).copy()
    f.end_draft()
    np.testing.assert_allclose(got, want, atol=2e-2)


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line
    return line


# --- the headers ----------------------------------------------------------------------------


def test_the_header_says_which_target_the_assistant_is_for(gemma4, tiny):
    info = model_info(gemma4["mtp-gemma4"])
    a = head_file_of(info)
    assert a == HeadFile("gemma4-assistant", N_EMBD, (), True, True, None) and a.source == "mtp"
    assert a.describe() == "Gemma 4 MTP assistant for a 64-wide gemma4 target"
    assert a.mismatch(model_info(gemma4["gemma4"])) is None
    assert "it drafts for gemma4 targets, and target.gguf is llama" in (a.mismatch(model_info(tiny["target"])) or "")
    assert heads_of(info).count == 0  # its MTP blocks are the whole file, not heads of a trunk
    h = heads_of(model_info(gemma4["gemma4"]))
    assert h.count == 0 and h.stripped_note() is None


def test_inspect_and_check_pair_name_the_assistant(gemma4, tiny, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    code, out, _ = cli(["inspect", str(gemma4["mtp-gemma4"])], capsys)
    text = " ".join(out.split())
    assert code == 0 and "Gemma 4 MTP assistant for a 64-wide gemma4 target; attends over the target's KV cache" in text
    assert "built-in MTP" not in text
    code, out, _ = cli(["check-pair", "-m", str(gemma4["gemma4"]), "-d", str(gemma4["mtp-gemma4"])], capsys)
    text = " ".join(out.split())
    assert code == 0 and "it fits this target; --draft mtp drafts with it alone" in text
    code, out, _ = cli(["check-pair", "-m", str(tiny["target"]), "-d", str(gemma4["mtp-gemma4"]), "--json"], capsys)
    report = json.loads(out)
    assert code == EXIT_FAIL and report["compatible"] and not report["draft_head"]["matches"]


def test_the_refusals_are_one_line_exit_2(gemma4, tiny, capsys):
    argv = ["generate", "-m", str(tiny["target"]), "-d", str(gemma4["mtp-gemma4"]), "-p", "hi", "-n", "4"]
    code, out, err = cli(argv, capsys)
    assert code == EXIT_USAGE and out == ""
    assert "mtp-gemma4.gguf (Gemma 4's MTP assistant) cannot draft for" in one_line(err) and "drafts for gemma4 targets" in err
    argv = ["generate", "-m", str(gemma4["gemma4"]), "-d", str(gemma4["mtp-gemma4"]), "--draft", "model", "-p", "hi"]
    code, out, err = cli(argv, capsys)
    assert code == EXIT_USAGE and "needs a draft model, and mtp-gemma4.gguf is Gemma 4's MTP assistant" in one_line(err)
    assert "--draft mtp" in err
    code, out, err = cli(["generate", "-m", str(gemma4["gemma4"]), "--draft", "mtp", "-p", "hi"], capsys)
    assert code == EXIT_USAGE and "mtp (with the MTP assistant file you give" in one_line(err)


# --- drafting through the engine ------------------------------------------------------------


def test_the_assistant_leaves_the_targets_cache_alone(gemma4, fresh):
    """The assistant's context shares the target's KV cells (clearing its memory would clear
    the target's): after it drafted, was reset and closed, the target goes on as one that
    never had it."""
    prompt = fresh.tokenize(PROMPTS[0])
    with Model(gemma4["gemma4"], LoadOptions(n_ctx=1024, n_threads=1, n_batch=64)) as m:
        a = Gemma4Assistant(m, gemma4["mtp-gemma4"])
        m.eval(prompt[:-2], logits="none")
        a.draft_step(prompt[-2])
        a.draft_step(prompt[-1])
        a.end_draft()
        a.reset()
        a.close()
        assert m.heads is None
        got = m.eval(prompt[-2:], logits="all").copy()
    fresh.reset()
    want = fresh.eval(prompt, logits="all")[-2:].copy()
    np.testing.assert_allclose(got, want, atol=1e-3)


@pytest.fixture(scope="module")
def plain(target):
    return {p: run(target, Settings("none"), target.tokenize(p))[0] for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_assistant_equals_plain(target, fresh, plain, prompt):
    s = Settings("mtp", draft_max=K, p_min=0.0, fixed=True)
    heads_run.exact_and_in_step(target, s, target.tokenize(prompt), plain[prompt], lambda seq: check_in_step(target, fresh, seq))


def test_near_ties_and_a_long_prompt_keep_it_in_step(target, fresh, plain):
    s = Settings("mtp", draft_max=K, p_min=0.0, fixed=True)
    heads_run.near_ties_in_step(target, s, target.tokenize(PROMPTS[0]), plain[PROMPTS[0]], lambda seq: check_in_step(target, fresh, seq))
    heads_run.long_prompt_in_step(target, s, lambda seq: check_in_step(target, fresh, seq))


def test_hybrid_weighs_the_assistant_with_ngram(target, plain):
    heads_run.hybrid_weighs_the_heads(target, "mtp", K, plain)


def test_chat_turns_keep_it_in_step(target, fresh):
    s = Settings("mtp", draft_max=K, p_min=0.0, fixed=True)
    heads_run.chat_turns_in_step(target, s, lambda seq: check_in_step(target, fresh, seq))


def test_sampling_keeps_the_targets_distribution(target):
    heads_run.sampling_follows_the_target(target, "mtp", kept=0.05)


def test_generate_with_the_assistant_from_the_cli(gemma4, capsys):
    base = ["generate", "-m", str(gemma4["gemma4"]), "-t", "1", "-p", PROMPTS[1], "-n", "32", "--json"]
    code, out, err = cli([*base, "-d", str(gemma4["mtp-gemma4"]), "--draft", "mtp", "--draft-max", str(K), "--fixed"], capsys)
    assert code == 0, err
    got = json.loads(out)
    assert "drafting with Gemma 4's MTP assistant mtp-gemma4.gguf (2 blocks)" in err
    assert got["stats"]["by_source"]["mtp"]["rounds"] > 0
    code, out, _ = cli([*base, "--draft", "none"], capsys)
    assert code == 0 and json.loads(out)["tokens"] == got["tokens"]


def test_drafts_and_models_scan_mark_the_assistant(gemma4, tiny, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "llama-cache"
    cache.mkdir()
    for name in ("gemma4", "mtp-gemma4"):
        (cache / f"{name}.gguf").symlink_to(gemma4[name])
    (cache / "target.gguf").symlink_to(tiny["target"])
    for var in ("OLLAMA_MODELS", "LMSTUDIO_MODELS", "HF_HUB_CACHE"):
        monkeypatch.setenv(var, str(tmp_path / "empty"))
    monkeypatch.setenv("LLAMA_CACHE", str(cache))
    monkeypatch.setenv("SPECRUN_MODELS_DIR", str(tmp_path / "no-models"))
    code, out, _ = cli(["drafts", str(gemma4["gemma4"]), "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and Path(report["drafts"][0]["path"]).name == "mtp-gemma4.gguf"
    code, out, _ = cli(["drafts", str(tiny["target"]), "--json"], capsys)
    other = next(c for c in json.loads(out)["cannot_draft"] if Path(c["path"]).name == "mtp-gemma4.gguf")
    assert "Gemma 4's MTP assistant for another target" in other["reason"]
    monkeypatch.setenv("COLUMNS", "250")
    _, out, _ = cli(["models", "--scan"], capsys)
    assert any("MTP assistant for 64-wide" in line for line in out.splitlines() if "mtp-gemma4" in line), out
