"""An EAGLE-3 head as the draft (``-d eagle3-head.gguf``), on a tiny taught head over tiny_models'
llama target (tests/tiny_eagle3.py), through the real llama.cpp: what the header says
(inspect, check-pair, drafts, models --scan), the one-line refusals (a head for another target,
a head where a draft model is asked for and back), and the head drafting through the engine:
exact greedy output, the head's context in step with the target after every round (its KV
length, its pending state, and its next guess against a head that caught up from scratch),
chat turns, the chooser weighing it with the n-gram lookup, sampling that keeps the target's
distribution, and tokens counted by source."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import heads_run
import numpy as np
import pytest
from heads_run import N_TOKENS, PROMPTS
from tiny_eagle3 import D2T_EVERY, N_EMBD, TARGET_LAYERS, WIDE, build_eagle3, with_d2t, write_eagle3
from tiny_models import TARGET_SEED, bpe_vocab, make_weights

from specrun.cli.main import main
from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.sampling import Sampler
from specrun.decode.sources.eagle3 import Eagle3Source
from specrun.errors import EXIT_FAIL, EXIT_USAGE, UsageError
from specrun.gguf.facts import model_info
from specrun.gguf.heads import HeadFile, head_file_of
from specrun.llama import Eagle3Head, LoadOptions, Model, MtpHeads
from specrun.server.metrics import Metrics

K = 6  # drafts per round


@pytest.fixture(scope="session")
def heads(tmp_path_factory) -> dict[str, Path]:
    return build_eagle3(tmp_path_factory.mktemp("eagle3"))


def load(path: Path, head: Path) -> Model:
    m = Model(path, LoadOptions(n_ctx=1024, n_threads=1, n_batch=64))
    Eagle3Head(m, head)
    return m


@pytest.fixture(scope="module")
def target(tiny, heads):
    m = load(tiny["target"], heads["eagle3"])
    yield m
    m.close()


@pytest.fixture(scope="module")
def fresh(tiny, heads):
    """A second copy, to catch up from scratch and compare with."""
    m = load(tiny["target"], heads["eagle3"])
    yield m
    m.close()


def run(target: Model, settings: Settings, prompt: list[int], n: int = N_TOKENS, **kw):
    return heads_run.run(target, settings, prompt, n, **kw)


def check_in_step(target: Model, fresh: Model, seq: list[int]) -> None:
    """The head accounts for exactly the target's positions (in its cache, or queued for it),
    its pending state is the target's layer inputs at the last cached position, and its next
    guess equals that of a head that caught up with the same sequence in one batch."""
    h, f = target.eagle3, fresh.eagle3
    assert h is not None and f is not None
    assert target.n_past == h.n_past == h.cached + h.queued == len(seq) - 1
    assert h.queued <= K + 1  # what the last verify kept, not yet fed
    assert target.tokens == seq[:-1]
    fresh.reset()
    fresh.eval(seq[:-1], logits="none")
    np.testing.assert_allclose(h.state_before(h.n_past), f.state_before(f.n_past), atol=2e-3)
    got = h.draft_step(seq[-1]).copy()
    h.end_draft()
    want = f.draft_step(seq[-1]).copy()
    f.end_draft()
    np.testing.assert_allclose(got, want, atol=2e-2)
    assert h.cached == h.n_past and h.queued == 0  # the queue went in with the draft step, whose positions are forgotten again


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# --- the header ---------------------------------------------------------------------------


def test_the_header_says_which_target_the_head_is_for(tiny, heads):
    e = head_file_of(model_info(heads["eagle3"]))
    assert e == HeadFile("eagle3", N_EMBD, TARGET_LAYERS, False, False, None) and e.source == "eagle3"
    assert e.describe() == "EAGLE-3 head for a 64-wide target (reads its layers 0, 1, 1)"
    assert e.mismatch(model_info(tiny["target"])) is None
    assert "128-wide target" in (head_file_of(model_info(heads["eagle3-wide"])).mismatch(model_info(tiny["target"])) or "")
    assert "has 1 (0..0)" in (e.mismatch(model_info(tiny["draft-small"])) or "")  # one block: no layer 1 to read
    assert head_file_of(model_info(tiny["target"])) is None


def test_the_header_reads_a_d2t_head(tiny, heads):
    """A head with its own smaller vocabulary (d2t) says among how many tokens it guesses, and
    which target ids those are (read from the file: every other one of the 640)."""
    d = head_file_of(model_info(heads["eagle3-d2t"]))
    n = len(bpe_vocab()) // D2T_EVERY
    assert (d.draft_vocab, d.d2t_top, d.d2t_fault, d.own_output) == (n, len(bpe_vocab()) - D2T_EVERY, None, True)
    assert d.describe() == f"EAGLE-3 head for a 64-wide target (reads its layers 0, 1, 1; guesses among {n} of its tokens, d2t)"
    assert d.mismatch(model_info(tiny["target"])) is None
    assert HeadFile.from_json(json.loads(json.dumps(d.to_json()))) == d


def test_inspect_shows_the_head(heads, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    code, out, _ = cli(["inspect", str(heads["eagle3"])], capsys)
    text = " ".join(out.split())
    assert code == 0 and "EAGLE-3 head for a 64-wide target (reads its layers 0, 1, 1)" in text
    assert "borrows the target's token embeddings and output head" in text
    code, out, _ = cli(["inspect", str(heads["eagle3"]), "--json"], capsys)
    assert json.loads(out)["draft_head"]["target_layers"] == list(TARGET_LAYERS)


def test_check_pair_says_whether_the_head_fits_the_target(tiny, heads, capsys):
    code, out, _ = cli(["check-pair", "-m", str(tiny["target"]), "-d", str(heads["eagle3"])], capsys)
    assert code == 0 and "it fits this target" in " ".join(out.split())
    code, out, _ = cli(["check-pair", "-m", str(tiny["target"]), "-d", str(heads["eagle3-wide"])], capsys)
    text = " ".join(out.split())
    assert code == EXIT_FAIL and "not this target's" in text and "128-wide target" in text and "NO:" in text
    code, out, _ = cli(["check-pair", "-m", str(tiny["target"]), "-d", str(heads["eagle3-wide"]), "--json"], capsys)
    report = json.loads(out)
    assert not report["ok"] and report["compatible"] and not report["draft_head"]["matches"]


def test_drafts_and_models_scan_mark_the_heads(tiny, heads, tmp_path, monkeypatch, capsys):
    """A head for the target is listed first among its drafts; one for another target cannot
    draft, and says why; ``models --scan`` names the target each head is for."""
    cache = tmp_path / "llama-cache"
    cache.mkdir()
    for name, path in [("target", tiny["target"]), ("draft-small", tiny["draft-small"]), *heads.items()]:
        (cache / f"{name}.gguf").symlink_to(path)
    for var in ("OLLAMA_MODELS", "LMSTUDIO_MODELS", "HF_HUB_CACHE"):
        monkeypatch.setenv(var, str(tmp_path / "empty"))
    monkeypatch.setenv("LLAMA_CACHE", str(cache))
    monkeypatch.setenv("SPECRUN_MODELS_DIR", str(tmp_path / "no-models"))
    code, out, _ = cli(["drafts", str(tiny["target"]), "--json"], capsys)
    report = json.loads(out)
    assert code == 0
    assert [Path(d["path"]).name for d in report["drafts"]] == ["eagle3.gguf", "eagle3-d2t.gguf", "draft-small.gguf"]
    assert report["drafts"][0]["draft_head"]["target_hidden_size"] == N_EMBD
    wide = next(c for c in report["cannot_draft"] if Path(c["path"]).name == "eagle3-wide.gguf")
    assert "an EAGLE-3 head for another target" in wide["reason"] and "128-wide" in wide["reason"]
    monkeypatch.setenv("COLUMNS", "250")
    _, out, _ = cli(["models", "--scan"], capsys)
    rows = [line for line in out.splitlines() if "eagle3" in line]
    assert len(rows) == 3 and all("EAGLE-3 for" in line for line in rows), out
    assert any(f"EAGLE-3 for {WIDE}-wide" in line for line in rows)
    assert any(f"{len(bpe_vocab()) // D2T_EVERY} tokens" in line for line in rows if "eagle3-d2t" in line)


# --- refusals, from the headers -------------------------------------------------------------


def one_line(err: str) -> str:
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line
    return line


def test_a_head_for_another_target_is_one_line_exit_2(tiny, heads, capsys):
    for mode in ("hybrid", "eagle3"):
        argv = ["generate", "-m", str(tiny["target"]), "-d", str(heads["eagle3-wide"]), "--draft", mode, "-p", "hi", "-n", "4"]
        code, out, err = cli(argv, capsys)
        assert code == EXIT_USAGE and out == ""
        line = one_line(err)
        assert "eagle3-wide.gguf (an EAGLE-3 head) cannot draft for" in line and "128-wide" in line, line


def test_a_head_and_a_draft_model_are_not_mistaken_for_each_other(tiny, heads, capsys):
    code, out, err = cli(["generate", "-m", str(tiny["target"]), "-d", str(heads["eagle3"]), "--draft", "model", "-p", "hi"], capsys)
    assert code == EXIT_USAGE and out == "" and "--draft model needs a draft model, and" in one_line(err)
    assert "eagle3.gguf is an EAGLE-3 head" in err and "--draft eagle3" in err
    code, out, err = cli(
        ["generate", "-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "--draft", "eagle3", "-p", "hi"], capsys
    )
    assert code == EXIT_USAGE and "--draft eagle3 needs an EAGLE-3 head" in one_line(err) and "llama model" in err
    code, out, err = cli(["generate", "-m", str(tiny["target"]), "--draft", "eagle3", "-p", "hi"], capsys)
    assert code == EXIT_USAGE and "no EAGLE-3 head for" in one_line(err)


def test_the_backend_refuses_a_head_whose_layers_the_target_lacks(tiny, heads, tmp_path):
    deep = write_eagle3(
        tmp_path / "deep.gguf", vocab=bpe_vocab(), weights=dict(eagle3_weights_for_tests()), target_layers=(0, 1, 5), name="deep"
    )
    with Model(tiny["target"], LoadOptions(n_ctx=256, n_threads=1, n_batch=64)) as m:
        with pytest.raises(UsageError, match=r"reads the target's layers \[0, 1, 5\]"):
            Eagle3Head(m, deep)
        assert m.eagle3 is None


def eagle3_weights_for_tests():
    from tiny_eagle3 import eagle3_weights

    return eagle3_weights(make_weights(TARGET_SEED, len(bpe_vocab())))


def bad_d2t(case: str):
    """A head whose d2t llama.cpp cannot use (an id past the target's vocabulary or a row count
    not the head's output's would end the process in an assert), and what refuses it."""
    head, target = eagle3_weights_for_tests(), make_weights(TARGET_SEED, len(bpe_vocab()))
    ids = np.arange(0, 600, 2)
    if case == "past the vocabulary":
        w = with_d2t(head, target, ids)
        return {**w, "d2t": np.array([*ids[:-1], 650])}, "maps to token 650, past the 640 tokens of target.gguf"
    if case == "longer than the vocabulary":
        w = with_d2t(head, target, ids)
        w["output.weight"], w["d2t"] = np.zeros((700, N_EMBD), np.float32), np.arange(700)
        return w, "maps 700 tokens, more than the 640 of target.gguf"
    if case == "two rows, one token":
        return with_d2t(head, target, [*ids[:-1], ids[0]]), "maps two of its tokens to one target token"
    if case == "I32":
        w = with_d2t(head, target, ids)
        return {**w, "d2t": w["d2t"].astype(np.int32)}, "is I32 of shape [300], and llama.cpp reads a list of I64 token ids"
    if case == "rows of another output":
        w = with_d2t(head, target, ids)
        return {**w, "d2t": w["d2t"][:-10]}, "maps 290 tokens, and its output head has 300 rows"
    assert case == "no output of its own"
    w = with_d2t(head, target, ids)
    del w["output.weight"]
    return w, "maps 300 tokens, and it has no output head of its own (the target's has 640 rows)"


BAD_D2T = [
    "past the vocabulary",
    "longer than the vocabulary",
    "two rows, one token",
    "I32",
    "rows of another output",
    "no output of its own",
]


@pytest.mark.parametrize("case", BAD_D2T)
def test_a_malformed_d2t_is_refused_from_its_header(tiny, tmp_path, case):
    weights, why = bad_d2t(case)
    path = write_eagle3(tmp_path / "bad.gguf", vocab=bpe_vocab(), weights=weights, name="bad")
    assert head_file_of(model_info(path)).mismatch(model_info(tiny["target"])) == f"its d2t {why}"


def test_a_d2t_past_the_vocabulary_is_one_line_exit_2(tiny, tmp_path, capsys):
    """Refused before anything loads: llama.cpp would write that guess past the end of its row
    (an assert in ggml's set_rows, which ends the process)."""
    path = write_eagle3(tmp_path / "bad.gguf", vocab=bpe_vocab(), weights=bad_d2t("past the vocabulary")[0], name="bad")
    code, out, err = cli(["generate", "-m", str(tiny["target"]), "-d", str(path), "--draft", "eagle3", "-p", "hi", "-n", "4"], capsys)
    assert code == EXIT_USAGE and out == ""
    assert "bad.gguf (an EAGLE-3 head) cannot draft for target.gguf: its d2t maps to token 650" in one_line(err)


# --- drafting through the engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(target):
    return {p: run(target, Settings("none"), target.tokenize(p))[0] for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_eagle3_equals_plain(target, fresh, plain, prompt):
    """64 tokens with the head alone (every round drafts up to K tokens): plain decoding's, and
    the head in step after every round."""
    s = Settings("eagle3", draft_max=K, p_min=0.0, fixed=True)
    heads_run.exact_and_in_step(target, s, target.tokenize(prompt), plain[prompt], lambda seq: check_in_step(target, fresh, seq))


def test_the_first_guess_agrees_with_the_target_often(target, plain):
    """The taught head's first guess is the target's next token a good part of the time (a
    head reading the wrong layer rows, or fed at the wrong position, agrees about never)."""
    prompt = target.tokenize(PROMPTS[1])
    seq = prompt + plain[PROMPTS[1]]
    target.reset()
    hits = 0
    for n in range(len(prompt), len(seq) - 1):
        target.eval(seq[target.n_past : n], logits="none")
        hits += int(np.argmax(target.eagle3.draft_step(seq[n]))) == seq[n + 1]
        target.eagle3.end_draft()
    assert hits >= 0.25 * (len(seq) - 1 - len(prompt)), hits


def test_a_prompt_of_several_batches(target, fresh):
    s = Settings("eagle3", draft_max=K, p_min=0.0, fixed=True)
    heads_run.long_prompt_in_step(target, s, lambda seq: check_in_step(target, fresh, seq))


def test_near_ties_keep_the_head_in_step(target, fresh, plain):
    s = Settings("eagle3", draft_max=K, p_min=0.0, fixed=True)
    heads_run.near_ties_in_step(target, s, target.tokenize(PROMPTS[0]), plain[PROMPTS[0]], lambda seq: check_in_step(target, fresh, seq))


def test_hybrid_chooses_among_ngram_and_the_head(target, plain):
    heads_run.hybrid_weighs_the_heads(target, "eagle3", K, plain)


def test_chat_turns_keep_the_head_in_step(target, fresh):
    s = Settings("eagle3", draft_max=K, p_min=0.0, fixed=True)
    heads_run.chat_turns_in_step(target, s, lambda seq: check_in_step(target, fresh, seq))


def test_a_head_attached_late_catches_up(tiny, heads, target):
    """A head attached to a target that holds a sequence already starts from it."""
    prompt = target.tokenize(PROMPTS[1])
    with Model(tiny["target"], LoadOptions(n_ctx=1024, n_threads=1, n_batch=64)) as late:
        late.eval(prompt[:-1], logits="none")
        h = Eagle3Head(late, heads["eagle3"])
        assert late.eagle3 is h and h.n_past == late.n_past == len(prompt) - 1
        target.reset()
        target.eval(prompt[:-1], logits="none")
        got = h.draft_step(prompt[-1]).copy()
        want = target.eagle3.draft_step(prompt[-1]).copy()
        h.end_draft()
        target.eagle3.end_draft()
        np.testing.assert_allclose(got, want, atol=2e-2)
    assert late.eagle3 is None and h._ctx is None  # closed with its target


@pytest.mark.parametrize("head", ["eagle3", "d2t"])
def test_sampling_keeps_the_targets_distribution(target, head, request):
    """Also with a d2t head that lacks the target's commonest tokens (its q is 0 there, its
    logits -inf)."""
    if head == "d2t":
        target = request.getfixturevalue("d2t_targets")["leaves-out"][0]
    heads_run.sampling_follows_the_target(target, "eagle3", kept=0.05)


# --- a head with its own smaller vocabulary (d2t) ---------------------------------------------

LEFT_OUT = 5  # the leaves-out head lacks the target's commonest tokens


@pytest.fixture(scope="module")
def d2t_targets(tiny, plain, tmp_path_factory):
    """The target, each with a head that guesses among some of its tokens (d2t): 'covers'
    among every token plain decoding of PROMPTS produces and as many others, 'leaves-out' among
    the same less the LEFT_OUT commonest of them; name -> (model, the target ids it guesses among)."""
    produced = Counter(t for out in plain.values() for t in out)
    others = [t for t in range(len(bpe_vocab())) if t not in produced]
    covers = {*produced, *np.random.default_rng(0).choice(others, size=len(produced), replace=False).tolist()}
    sets = {"covers": covers, "leaves-out": covers - {t for t, _ in produced.most_common(LEFT_OUT)}}
    directory = tmp_path_factory.mktemp("d2t")
    head, weights = eagle3_weights_for_tests(), make_weights(TARGET_SEED, len(bpe_vocab()))
    out = {}
    for name, ids in sets.items():
        path = write_eagle3(directory / f"{name}.gguf", vocab=bpe_vocab(), weights=with_d2t(head, weights, sorted(ids)), name=name)
        out[name] = (load(tiny["target"], path), ids)
    yield out
    for m, _ in out.values():
        m.close()


@pytest.mark.parametrize("head", ["covers", "leaves-out"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_a_d2t_head_equals_plain(d2t_targets, plain, head, prompt, monkeypatch):
    """A head that guesses among some of the target's tokens (llama.cpp scatters its logits
    into a target-wide row of -inf): 64 tokens come out as plain decoding's, every drafted
    token is one of its own, and some are accepted. (The leaves-out head never drafts the
    commonest tokens, which the target says all the same.)"""
    m, ids = d2t_targets[head]
    drafted: list[int] = []
    propose = Eagle3Source.propose

    def spy(self, tokens, k, worth, offered=0, verify=(), rival=None):
        p = propose(self, tokens, k, worth, offered, verify, rival)
        drafted.extend(p.tokens)
        return p

    monkeypatch.setattr(Eagle3Source, "propose", spy)
    s = Settings("eagle3", draft_max=K, p_min=0.0, fixed=True)
    out, stats = run(m, s, m.tokenize(prompt))
    assert out == plain[prompt]
    assert drafted and set(drafted) <= ids
    assert stats.by_source["eagle3"][2] > 0


def test_tokens_by_source_reach_stats_and_metrics(target):
    s = Settings("eagle3", draft_max=K, p_min=0.0, fixed=True)
    _, stats = run(target, s, target.tokenize(PROMPTS[1]), n=32)
    rounds, drafted, accepted = stats.by_source["eagle3"]
    assert rounds and drafted >= accepted >= 0
    assert stats.to_json()["by_source"]["eagle3"] == {"rounds": rounds, "drafted": drafted, "accepted": accepted}
    m = Metrics(lambda: 0, lambda: False)
    m.observe(stats)
    assert f'specrun_draft_tokens_total{{source="eagle3"}} {float(drafted)}' in m.text().decode()


def test_generate_with_the_head_from_the_cli(tiny, heads, capsys):
    """`generate -d eagle3-head.gguf`: the head is loaded beside the target, and the text is
    plain decoding's."""
    base = ["generate", "-m", str(tiny["target"]), "-t", "1", "-p", PROMPTS[1], "-n", "32", "--json"]
    code, out, err = cli([*base, "-d", str(heads["eagle3"]), "--draft", "eagle3", "--draft-max", str(K), "--fixed"], capsys)
    assert code == 0, err
    with_head = json.loads(out)
    assert "drafting with the EAGLE-3 head eagle3.gguf" in err
    assert with_head["stats"]["by_source"]["eagle3"]["rounds"] > 0
    code, out, _ = cli([*base, "--draft", "none"], capsys)
    assert code == 0 and json.loads(out)["tokens"] == with_head["tokens"]


def test_the_head_beside_the_targets_own_mtp_heads(tmp_path):
    """Both kinds of heads on one target (a qwen35 with an MTP head, whose recurrent layers
    roll back by snapshots): the default mode weighs the n-gram lookup, the MTP heads and the
    EAGLE-3 head, every rollback moves both heads, and the output is plain decoding's."""
    from tiny_mtp import build_mtp

    mtp = build_mtp(tmp_path / "mtp")["mtp"]
    head = write_eagle3(tmp_path / "eagle3-qwen35.gguf", vocab=bpe_vocab(), weights=eagle3_weights_for_tests(), name="eagle3-qwen35")
    with Model(mtp, LoadOptions(n_ctx=1024, n_threads=1, n_batch=64, load_mtp=True, rollback_depth=K)) as m:
        MtpHeads(m)
        Eagle3Head(m, head)
        prompt = m.tokenize(PROMPTS[1])
        plain_out, _ = run(m, Settings("none"), prompt)

        def in_step(e, step):
            assert m.n_past == m.heads.n_past == m.eagle3.n_past == m.eagle3.cached + m.eagle3.queued == len(e.tokens) - 1

        m.reset()
        e = Engine(m, None, Settings("hybrid", draft_max=K), Sampler(0.0), CostModel(dict(heads_run.FLAT)), heads=m.heads, eagle3=m.eagle3)
        assert list(e.sources) == ["ngram", "mtp", "eagle3"]
        out = []
        for step in e.generate(prompt, N_TOKENS):
            out += step.tokens
            in_step(e, step)
        assert out == plain_out
        for s in ("eagle3", "mtp"):
            out, stats = run(m, Settings(s, draft_max=K, p_min=0.0, fixed=True), prompt, on_step=in_step)
            assert out == plain_out and stats.by_source[s][1] > 0


def test_serve_drafts_with_the_head(tiny, heads, tmp_path):
    """`serve -d eagle3-head.gguf`: one sequence (the head follows one), a request that asks for
    the head drafts with it (counted as source eagle3 in /metrics), and its text is what a plain
    request gets."""
    from serve_helpers import Server

    s = Server(["-m", str(tiny["target"]), "-d", str(heads["eagle3"]), "-t", "1", "-c", "1024", "--parallel", "0"], tmp_path)
    try:
        assert "parallel 1: eagle3.gguf (an EAGLE-3 head) follows one sequence" in s.stderr
        body = {"prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0}
        speculative = {"n_max": K, "p_min": 0.0, "fixed": True}
        status, _, r = s.post("/v1/completions", {**body, "draft": "eagle3", "speculative": speculative})
        assert status == 200, r
        assert r["timings"]["draft_n"] > 0
        assert s.metrics().get('specrun_rounds_total{source="eagle3"}', 0) > 0
        status, _, plain_r = s.post("/v1/completions", {**body, "draft": "none"})
        assert status == 200 and plain_r["choices"][0]["text"] == r["choices"][0]["text"]
    finally:
        assert s.stop() == 143, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


def test_bench_runs_the_head_beside_plain_decoding(tiny, heads, tmp_path, capsys):
    """`bench -d eagle3-head.gguf --draft eagle3`: the head drafts (counted by source) and the
    text is plain decoding's."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"class": "c", "prompt": p, "chat": False}) + "\n" for p in PROMPTS[:2]), encoding="utf-8")
    argv = ["bench", "-m", str(tiny["target"]), "-d", str(heads["eagle3"]), "-t", "1", "-c", "512", "--runs", "1", "-n", "24"]
    code, out, err = cli([*argv, "--prompts", str(prompts), "--draft", "eagle3", "--fixed", "--draft-max", str(K), "--json"], capsys)
    assert code == 0, err
    overall = json.loads(out)["classes"]["overall"]
    assert list(overall) == ["none", "eagle3"] and overall["eagle3"]["identical_to_plain"] is True
    drafting = {k: v for k, v in overall["eagle3"]["by_source"].items() if v["drafted"]}
    assert list(drafting) == ["eagle3"] and drafting["eagle3"]["drafted"] == overall["eagle3"]["drafted"] > 0
