"""The target's own MTP heads as the draft, on a tiny qwen35 with one head (tests/tiny_mtp.py),
through the real llama.cpp: what the header says (check-pair, drafts, inspect, models --scan,
the memory fit), the one-line refusal of ``--draft mtp`` without heads, and the heads drafting
through the engine: exact greedy output, the MTP context in step with the target after every
round (its KV length, its pending state, and its next guess against a fresh catch-up), chat
turns, sampling that keeps the target's distribution, and tokens counted by source.

qwen35 is hybrid (delta-net layers): its target context keeps ``SNAPSHOTS`` recurrent-state
snapshots so that a verify can be rolled back, which bounds a draft to that many tokens, and a
checkpoint for the rollback snapshots cannot do (tests/test_hybrid.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import heads_run
import numpy as np
import pytest
from heads_run import N_TOKENS, PROMPTS
from tiny_mtp import TRUNK_LAYERS, build_mtp, mtp_block, mtp_variants

from specrun.cli.main import main
from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.learned import Learned
from specrun.decode.sampling import Sampler
from specrun.errors import EXIT_USAGE
from specrun.fit.memory import estimate
from specrun.gguf.facts import model_info
from specrun.gguf.heads import heads_of
from specrun.llama import LoadOptions, Model, MtpHeads
from specrun.models.registry import Registry
from specrun.run.session import resolve_pair, uses_heads
from specrun.server.metrics import Metrics

SNAPSHOTS = 6  # recurrent-state snapshots on the target: a verify rolls back at most this many
K = SNAPSHOTS  # drafts per round (a near-tie deferred at a verify's first row restores a checkpoint)


@pytest.fixture(scope="session")
def mtp(tmp_path_factory) -> dict[str, Path]:
    return build_mtp(tmp_path_factory.mktemp("mtp"))


def load(path: Path, heads: bool = True) -> Model:
    m = Model(path, LoadOptions(n_ctx=1024, n_threads=1, n_batch=64, load_mtp=heads, rollback_depth=SNAPSHOTS))
    if heads:
        MtpHeads(m)
    return m


@pytest.fixture(scope="module")
def target(mtp):
    m = load(mtp["mtp"])
    yield m
    m.close()


@pytest.fixture(scope="module")
def fresh(mtp):
    """A second copy, to catch up from scratch and compare with."""
    m = load(mtp["mtp"])
    yield m
    m.close()


def run(target: Model, settings: Settings, prompt: list[int], n: int = N_TOKENS, **kw):
    return heads_run.run(target, settings, prompt, n, **kw)


def check_in_step(target: Model, fresh: Model, seq: list[int]) -> None:
    """The heads account for exactly the target's positions (in their cache, or queued for it),
    their pending state is the target's state at the last cached position, and their next
    guess equals that of heads that caught up with the same sequence in one batch."""
    h = target.heads
    assert h is not None and fresh.heads is not None
    assert target.n_past == h.n_past == h.cached + h.queued == len(seq) - 1
    assert h.queued <= K + 1  # what the last verify kept, not yet fed
    assert target.tokens == seq[:-1]
    fresh.reset()
    fresh.eval(seq[:-1], logits="none")
    np.testing.assert_allclose(h.state_before(h.n_past), fresh.heads.state_before(fresh.heads.n_past), atol=2e-3)
    got = h.draft_step(seq[-1]).copy()
    h.end_draft()
    want = fresh.heads.draft_step(seq[-1]).copy()
    fresh.heads.end_draft()
    np.testing.assert_allclose(got, want, atol=2e-2)
    assert h.cached == h.n_past and h.queued == 0  # the queue went in with the draft step, whose position is forgotten again


# --- the header ---------------------------------------------------------------------------


def test_the_header_names_the_heads_and_their_bytes(mtp):
    info = model_info(mtp["mtp"])
    h = heads_of(info)
    assert (h.count, h.first_block, h.usable, h.chained, h.max_draft) == (1, TRUNK_LAYERS, True, False, None)
    assert h.weights_bytes == sum(w.nbytes for w in mtp_block(mtp_variants()["mtp"]).values())  # F32, as written
    assert h.kv_bytes_per_token == 2 * 16 * 2 * 2  # 2 KV heads x (k + v) x 16 dims x f16
    assert h.describe() == "built-in MTP: 1 head" and h.stripped_note() is None
    stripped = heads_of(model_info(mtp["mtp-stripped"]))
    assert stripped.count == 0 and not stripped.usable and "stripped" in (stripped.stripped_note() or "")


def test_the_fit_counts_the_heads(mtp):
    """The heads' tensors and their cache are in the target's estimate: the file with them
    costs exactly that much more than the one without."""
    n_ctx = 2048
    with_heads, without = model_info(mtp["mtp"]), model_info(mtp["mtp-stripped"])
    h = heads_of(with_heads)
    a, b = estimate(with_heads, "target", n_ctx, 0), estimate(without, "target", n_ctx, 0)
    assert a.weights - b.weights == h.weights_bytes
    assert a.kv_cache - b.kv_cache == h.kv_bytes(n_ctx)


def test_a_llama_file_has_no_heads_and_no_note(tiny):
    h = heads_of(model_info(tiny["target"]))
    assert h.count == 0 and h.stripped_note() is None


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_drafts_and_check_pair_list_the_heads_first(mtp, tiny, capsys):
    code, out, _ = cli(["drafts", str(mtp["mtp"]), "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["mtp_heads"]["count"] == 1 and report["mtp_heads"]["best"]
    code, out, _ = cli(["drafts", str(mtp["mtp"])], capsys)
    assert code == 0 and "built-in MTP: 1 head" in out and "best free draft" in out
    code, out, _ = cli(["check-pair", "-m", str(mtp["mtp"])], capsys)
    assert code == 0 and "built-in MTP: 1 head" in out
    code, out, _ = cli(["check-pair", "-m", str(mtp["mtp"]), "-d", str(tiny["target"])], capsys)
    assert "built-in MTP: 1 head" in out and "counted in the target's memory" in out
    code, out, _ = cli(["drafts", str(mtp["mtp-stripped"])], capsys)
    assert "may have stripped them" in out.replace("\n", " ")


def test_inspect_shows_the_heads(mtp, capsys):
    code, out, _ = cli(["inspect", str(mtp["mtp"])], capsys)
    assert code == 0 and "built-in MTP: 1 head" in out
    code, out, _ = cli(["inspect", str(mtp["mtp"]), "--json"], capsys)
    assert json.loads(out)["mtp_heads"]["count"] == 1
    _, out, _ = cli(["inspect", str(mtp["mtp-stripped"]), "--json"], capsys)
    assert json.loads(out)["mtp_heads"]["count"] == 0 and "stripped" in json.loads(out)["mtp_heads"]["note"]


def test_models_scan_marks_files_with_heads(mtp, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "llama-cache"
    cache.mkdir()
    for name in ("mtp", "mtp-stripped"):
        (cache / f"{name}.gguf").symlink_to(mtp[name])
    for var in ("OLLAMA_MODELS", "LMSTUDIO_MODELS", "HF_HUB_CACHE"):
        monkeypatch.setenv(var, str(tmp_path / "empty"))
    monkeypatch.setenv("LLAMA_CACHE", str(cache))
    monkeypatch.setenv("SPECRUN_MODELS_DIR", str(tmp_path / "no-models"))
    code, out, _ = cli(["models", "--scan", "--json"], capsys)
    heads = {Path(m["path"]).name: m["mtp_heads"] for m in json.loads(out)["models"] if m["path"]}
    assert code == 0 and heads == {"mtp.gguf": 1, "mtp-stripped.gguf": 0}
    monkeypatch.setenv("COLUMNS", "250")
    _, out, _ = cli(["models", "--scan"], capsys)
    rows = [line for line in out.splitlines() if "mtp" in line]
    assert len(rows) == 2, out
    assert ["MTP x1" in line for line in rows] == ["stripped" not in line for line in rows]


@pytest.mark.parametrize("variant", ["mtp-stripped", "target"])
def test_draft_mtp_without_heads_is_one_line_exit_2(mtp, tiny, variant, capsys):
    path = mtp[variant] if variant in mtp else tiny[variant]
    code, out, err = cli(["generate", "-m", str(path), "-t", "1", "--draft", "mtp", "-p", "hi", "-n", "4"], capsys)
    assert code == EXIT_USAGE and out == ""
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "--draft mtp needs built-in MTP heads" in line and "ngram" in line and "model" in line


# --- drafting through the engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(target):
    return {p: run(target, Settings("none"), target.tokenize(p))[0] for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_mtp_equals_plain(target, fresh, plain, prompt):
    """64 tokens with the heads alone (every round drafts up to SNAPSHOTS tokens): plain decoding's,
    and the heads in step after every round."""
    s = Settings("mtp", draft_max=K, p_min=0.0, fixed=True)
    heads_run.exact_and_in_step(target, s, target.tokenize(prompt), plain[prompt], lambda seq: check_in_step(target, fresh, seq))


def test_a_prompt_of_several_batches(target, fresh):
    s = Settings("mtp", draft_max=K, p_min=0.0, fixed=True)
    heads_run.long_prompt_in_step(target, s, lambda seq: check_in_step(target, fresh, seq))


def test_near_ties_keep_the_heads_in_step(target, fresh, plain):
    s = Settings("mtp", draft_max=K, p_min=0.0, fixed=True)
    heads_run.near_ties_in_step(target, s, target.tokenize(PROMPTS[0]), plain[PROMPTS[0]], lambda seq: check_in_step(target, fresh, seq))


def test_hybrid_chooses_among_ngram_and_the_heads(target, plain):
    heads_run.hybrid_weighs_the_heads(target, "mtp", K, plain)


def test_hybrid_weighs_the_heads_and_a_draft_model_together(target, mtp, plain):
    """With heads and a draft model, the default mode has all three sources before it, each
    learning from every round, and its output is plain decoding's."""
    s = Settings("hybrid", draft_max=K)
    draft = load(mtp["mtp-stripped"], heads=False)  # the same trunk without heads: a draft model that agrees often
    try:
        for prompt in PROMPTS[:2]:
            target.reset()
            e = Engine(target, draft, s, Sampler(0.0), CostModel(), heads=target.heads)
            assert list(e.sources) == ["ngram", "mtp", "model"]
            out, stats = [], None
            for step in e.generate(target.tokenize(prompt), N_TOKENS):
                out += step.tokens
                stats = step.stats
            assert out == plain[prompt]
            assert set(stats.by_source) <= {"mtp", "ngram", "model", "none"}
    finally:
        draft.close()


def test_chat_turns_keep_the_heads_in_step(target, fresh):
    """The third turn goes back into the first prompt before any checkpoint of the recurrent
    state: the target replays the prefix from the start, in two decodes, and the heads keep what
    they hold of it."""
    s = Settings("mtp", draft_max=K, p_min=0.0, fixed=True)
    heads_run.chat_turns_in_step(target, s, lambda seq: check_in_step(target, fresh, seq))


def test_sampling_keeps_the_targets_distribution(target):
    heads_run.sampling_follows_the_target(target, "mtp", kept=0.1)


def test_tokens_by_source_reach_stats_and_metrics(target):
    s = Settings("mtp", draft_max=K, p_min=0.0, fixed=True)
    _, stats = run(target, s, target.tokenize(PROMPTS[1]), n=32)
    rounds, drafted, accepted = stats.by_source["mtp"]
    assert rounds and drafted >= accepted >= 0
    assert stats.to_json()["by_source"]["mtp"] == {"rounds": rounds, "drafted": drafted, "accepted": accepted}
    m = Metrics(lambda: 0, lambda: False)
    m.observe(stats)
    text = m.text().decode()
    assert f'specrun_draft_tokens_total{{source="mtp"}} {float(drafted)}' in text


def test_a_head_step_stored_on_a_busy_day_is_timed_again_at_the_first_prompt(target):
    """A stored head-step time is only a prior (one from a busy day would price the heads out,
    and heads never tried are never timed again): the first prompt in a process times a step,
    and the stored first-draft time moves by the same factor."""
    target.reset()
    busy = Learned(CostModel({b: 0.05 for b in range(1, 9)}), {"mtp": {"per_token": 10.0, "first_s": 30.0}})
    e = Engine(target, None, Settings("mtp", draft_max=K), Sampler(0.0), learned=busy, heads=target.heads)
    src = e.sources["mtp"]
    assert src.per_token == 10.0
    for _ in e.generate(target.tokenize(PROMPTS[0]), 4):
        pass
    assert src.per_token < 1.0 and src.first_s == pytest.approx(3 * src.per_token, rel=0.5)


def test_draft_mtp_with_a_draft_model_is_refused(mtp, tiny, capsys):
    code, out, err = cli(["generate", "-m", str(mtp["mtp"]), "-d", str(tiny["target"]), "--draft", "mtp", "-p", "hi"], capsys)
    assert code == EXIT_USAGE and out == "" and "\n" not in err.strip()
    assert "drafts with the target's own heads alone" in err and "--draft hybrid" in err


def test_hybrid_takes_the_heads_and_a_named_draft_model_beside_them(mtp, tiny):
    """From the headers alone: the default mode loads the heads whenever the target has them,
    and a named draft model beside them (the chooser weighs both); a file without heads falls
    back to the n-gram lookup."""
    reg = Registry.load()
    hybrid = Settings("hybrid")
    t, d, s = resolve_pair(reg, str(mtp["mtp"]), None, hybrid)
    assert d is None and s.mode == "hybrid" and uses_heads(t.path, s, None)
    t, d, s = resolve_pair(reg, str(mtp["mtp"]), str(tiny["target"]), hybrid)
    assert d is not None and d.path == tiny["target"] and s.mode == "hybrid" and uses_heads(t.path, s, d.path)
    t, d, s = resolve_pair(reg, str(mtp["mtp-stripped"]), None, hybrid)
    assert d is None and s.mode == "ngram" and not uses_heads(t.path, s, None)


def test_bench_runs_the_heads_beside_plain_decoding(mtp, tmp_path, capsys):
    """`bench --draft mtp,hybrid` on a target with heads and no draft model: both modes draft
    with the heads (counted by source), and their text is plain decoding's."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"class": "c", "prompt": p, "chat": False}) + "\n" for p in PROMPTS[:2]), encoding="utf-8")
    argv = ["bench", "-m", str(mtp["mtp"]), "-t", "1", "-c", "512", "--runs", "1", "-n", "24", "--prompts", str(prompts)]
    code, out, err = cli([*argv, "--draft", "mtp,hybrid", "--fixed", "--draft-max", str(K), "--json"], capsys)
    assert code == 0, err
    overall = json.loads(out)["classes"]["overall"]
    assert list(overall) == ["none", "mtp", "hybrid"]
    for mode in ("mtp", "hybrid"):
        assert overall[mode]["identical_to_plain"] is True, mode
        assert overall[mode]["drafted"] > 0, mode
    drafting = {k: v for k, v in overall["mtp"]["by_source"].items() if v["drafted"]}  # ("none": the plain rounds)
    assert list(drafting) == ["mtp"] and drafting["mtp"]["drafted"] == overall["mtp"]["drafted"]
    assert drafting["mtp"]["accepted"] == overall["mtp"]["accepted"]
    assert not any(v["drafted"] for v in overall["none"]["by_source"].values())


def test_bench_mtp_on_a_target_without_heads_is_one_line(mtp, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n", encoding="utf-8")
    code, out, err = cli(["bench", "-m", str(mtp["mtp-stripped"]), "-t", "1", "--prompts", str(prompts), "--draft", "mtp"], capsys)
    assert code == EXIT_USAGE
    assert err.count("\n") == 1 and "needs built-in MTP heads" in err and "Traceback" not in err


def test_serve_keeps_the_heads_in_step_when_a_request_goes_back_into_the_cache(mtp, tmp_path):
    """`serve --draft mtp` on the hybrid target, started a second time (its verify costs stored
    by the first, as for any user's second run): a request that rewrites the end of the one
    before reuses most of the slot's cache, so the target rolls back before its recurrent
    state's checkpoint and replays the prefix from the start; the heads keep what they hold of
    it and draft on (the code before answered 400, 'the MTP heads failed to draft'), and each
    reply is what plain decoding writes."""
    from serve_helpers import Server

    args = ["-m", str(mtp["mtp"]), "--draft", "mtp", "-t", "1", "-c", "1024", "--parallel", "0"]
    for _ in range(4):  # until a start finds the costs stored (a calibration timed as disturbed is not)
        s = Server(args, tmp_path)
        if "measuring" not in s.stderr:
            break
        assert s.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 1})[0] == 200
        assert s.stop() == 143, s.stderr
    try:
        assert "measuring" not in s.stderr, s.stderr
        speculative = {"n_max": K, "p_min": 0.0, "fixed": True}
        for prompt in PROMPTS:
            first = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "speculative": speculative}
            second = {"prompt": prompt[:-2] + " and so", "max_tokens": 24, "temperature": 0}
            for body in (first, {**second, "speculative": speculative}):
                status, _, r = s.post("/v1/completions", body)
                assert status == 200, r
                assert r["timings"]["draft_n"] > 0
            assert r["timings"]["cache_n"] > 0  # the second reused the first's cache
            status, _, plain_r = s.post("/v1/completions", {**second, "draft": "none"})
            assert status == 200 and plain_r["choices"][0]["text"] == r["choices"][0]["text"]
    finally:
        assert s.stop() == 143, s.stderr
    assert "Traceback" not in s.stderr, s.stderr
