"""`specrun bench --llama-cpp`: llama.cpp's own llama-speculative-simple on the same files and
prompts, taking its turn among specrun's modes, and each mode rated against its best setting.

The tool itself is built by `scripts/compare-llama-cpp.sh --build-only` (several minutes, once);
the tests that run it are skipped, saying so, where it has not been built."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from test_bench import PROMPTS, write_jsonl  # the bench tests' two prompts, one of code and one of chat
from typer.testing import CliRunner

from specrun.bench.llamacpp import DRAFT_SETTINGS, NGRAM_SETTINGS, PREFIX, TOOL, LlamaCpp, find_bin, parse_settings, write_prompt
from specrun.bench.runner import BenchPrompt, geomean, run_bench
from specrun.cli.main import _register, app, main
from specrun.decode.costs import CostModel
from specrun.decode.engine import Settings
from specrun.decode.sampling import Sampler
from specrun.decode.stats import RunStats
from specrun.errors import EXIT_INPUT, EXIT_USAGE, InputError, UsageError
from specrun.llama import LoadOptions, Model


@pytest.fixture(scope="module")
def tool() -> Path:
    try:
        return find_bin()
    except InputError as e:
        pytest.skip(f"llama.cpp's tools are not built here ({e})")


# --- settings, the command line, finding the tool ------------------------------------------------


def test_settings_default_to_the_draft_lengths_users_try_or_to_every_ngram_type():
    assert parse_settings(None, has_draft=True) == list(DRAFT_SETTINGS)
    assert parse_settings(None, has_draft=False) == list(NGRAM_SETTINGS)
    assert parse_settings(" draft-simple@8, ngram-mod,draft-simple@8", has_draft=True) == ["draft-simple@8", "ngram-mod"]


@pytest.mark.parametrize(
    "text",
    [
        "bogus",
        "draft-simple@0",
        "draft-simple@x",
        "ngram-mod@",
        ",",
        "draft-simple@999",
        "draft-simple@8/",
        "draft-simple@8/1.5",
        "draft-simple@8/x",
    ],
)
def test_a_bad_setting_is_a_usage_error(text):
    with pytest.raises(UsageError):
        parse_settings(text, has_draft=True)


def test_the_draft_model_setting_needs_a_draft_model():
    with pytest.raises(UsageError, match="needs a draft model"):
        parse_settings("draft-simple@8", has_draft=False)


def test_a_block_drafter_runs_under_its_own_type_at_the_lengths_users_try():
    """llama.cpp runs a DFlash or DFlash2 file as draft-dflash and a DSpark one as draft-dspark
    (each at its n-max); a draft model's type, or the other block type, is refused in one line."""
    assert parse_settings(None, has_draft=True, block="dspark") == [f"draft-dspark@{n}" for n in (2, 4, 8, 16)]
    assert parse_settings(None, has_draft=True, block="dflash2") == [f"draft-dflash@{n}" for n in (2, 4, 8, 16)]
    assert parse_settings("draft-dflash@3,ngram-mod", has_draft=True, block="dflash") == ["draft-dflash@3", "ngram-mod"]
    for text, block, words in (
        ("draft-simple", "dspark", "use draft-dspark"), ("draft-dflash", "dspark", "use draft-dspark"),
        ("draft-dspark", None, "needs a block drafter"),
    ):  # fmt: skip
        with pytest.raises(UsageError) as e:
            parse_settings(text, has_draft=True, block=block)
        assert words in str(e.value)
    assert parse_settings("draft-dspark@4", has_draft=False, pair_known=False) == ["draft-dspark@4"]  # before the load


def test_a_setting_may_give_llamacpps_p_min_beside_its_n_max(tmp_path):
    """``TYPE@N/P``: n-max N and p-min P, the tuning a block drafter's or draft model's user
    has besides the length (llama.cpp's DSpark stops at a draft whose confidence is under P)."""
    assert parse_settings("draft-dspark@8/0.5", has_draft=True, block="dspark") == ["draft-dspark@8/0.5"]
    cmd = LlamaCpp(tmp_path, tmp_path / "t.gguf", tmp_path / "d.gguf", threads=2, n_ctx=512).command(
        "draft-dspark@8/0.5", tmp_path / "p", 9
    )
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == "8" and cmd[cmd.index("--spec-draft-p-min") + 1] == "0.5"
    assert "--spec-draft-p-min" not in LlamaCpp(tmp_path, tmp_path / "t", None, threads=2, n_ctx=512).command(
        "ngram-mod", tmp_path / "p", 9
    )


def test_both_tools_get_the_same_files_threads_context_and_greedy_decoding(tmp_path):
    t, d, f = tmp_path / "t.gguf", tmp_path / "d.gguf", tmp_path / "p.txt"
    run = LlamaCpp(tmp_path, t, d, threads=3, n_ctx=2048)
    cmd = run.command("draft-simple@8", f, 64)

    def arg(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert cmd[0] == str(tmp_path / TOOL)
    assert (arg("-m"), arg("-md"), arg("-f"), arg("-n"), arg("--temp")) == (str(t), str(d), str(f), "64", "0")
    assert (arg("-t"), arg("-td"), arg("-c"), arg("--spec-type"), arg("--spec-draft-n-max")) == ("3", "3", "2048", "draft-simple", "8")
    defaults = run.command("draft-simple", f, 64)
    assert "--spec-draft-n-max" not in defaults  # its own defaults
    ngram = run.command("ngram-map-k4v", f, 64)
    assert "-md" not in ngram and ngram[ngram.index("--spec-type") + 1] == "ngram-map-k4v"


def test_a_missing_tool_is_named_with_the_build_that_makes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_LLAMA_CPP_BIN", str(tmp_path))
    with pytest.raises(InputError, match=f"{TOOL} is not in {tmp_path}"):
        find_bin()
    monkeypatch.delenv("SPECRUN_LLAMA_CPP_BIN")
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(InputError, match="compare-llama-cpp.sh --build-only"):
        find_bin()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / TOOL).write_text("")
    (tmp_path / "bin" / TOOL).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert find_bin() == tmp_path / "bin"


def bench_argv(tiny, prompts: Path, *extra: str) -> list[str]:
    return [
        "bench",
        "-m",
        str(tiny["target"]),
        "-d",
        str(tiny["draft-perturbed"]),
        "-t",
        "1",
        "-c",
        "512",
        "--prompts",
        str(prompts),
        *extra,
    ]


@pytest.mark.parametrize(
    "extra, code, words",
    [
        (["--llama-cpp", "--llama-cpp-bin", "{tmp}"], EXIT_INPUT, f"{TOOL} is not in"),
        (["--llama-cpp-settings", "draft-simple"], EXIT_USAGE, "go with --llama-cpp"),
        (["--llama-cpp-bin", "{tmp}"], EXIT_USAGE, "go with --llama-cpp"),
    ],
)
def test_bench_says_what_is_wrong_with_the_comparison_in_one_line(tiny, tmp_path, capsys, extra, code, words):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    assert main(bench_argv(tiny, prompts, *[x.replace("{tmp}", str(tmp_path)) for x in extra])) == code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("specrun: error: ") and words in lines[0], err


# --- the bench: the other tool takes its turn, and is never the verdict ------------------------------


def test_another_tools_runs_take_their_turn_and_each_mode_is_rated_against_its_best(tiny):
    """Two stand-in settings of another tool (one slow, one faster than
    any mode here) run among the modes in the bench's alternating order; the rating divides each
    mode's per-prompt median speedup by the best setting's, and the verdict, which says which
    `--draft` to use, never names the other tool."""
    opts = LoadOptions(n_ctx=256, n_threads=1)
    calls: list[tuple[str, int, int]] = []

    def runner(name: str, tps: float):
        def run(i: int, n: int) -> RunStats:
            calls.append((name, i, n))
            return RunStats(n_generated=n, wall_s=n / tps)

        return run

    outside = {PREFIX + "slow": runner("slow", 50.0), PREFIX + "fast": runner("fast", 1e5)}
    with Model(tiny["target"], opts) as t, Model(tiny["draft-copy"], opts) as d:
        prompts = [BenchPrompt("code", "def f(x):", chat=False), BenchPrompt("chat", "Tell me", chat=False, n_predict=6)]
        order: list[str] = []
        result = run_bench(
            t, d, prompts, ["hybrid"], Sampler(0.0), Settings(), lambda p: t.tokenize(p.prompt, add_special=True),
            8, 3, CostModel({1: 0.001, 2: 0.001}), lambda s: order.append(s.mode), outside=outside,
        )  # fmt: skip
    modes = ["none", "hybrid", PREFIX + "slow", PREFIX + "fast"]
    assert result.modes == modes
    assert order[:8] == modes + modes[::-1]  # turned round with every sample, as the bench's own modes
    assert sorted(calls) == sorted([(k, i, 8 if i == 0 else 6) for k in ("slow", "fast") for i in (0, 1) for _ in range(3)])
    data = result.to_json()
    assert all(s.tokens is None for s in result.samples if s.mode.startswith(PREFIX))
    assert data["classes"]["overall"][PREFIX + "fast"]["identical_to_plain"] is None  # not compared
    assert data["classes"]["overall"]["hybrid"]["identical_to_plain"] is True

    def score(mode: str, cls: str) -> float:
        per_prompt = {}
        for s in result.samples:
            if s.mode == mode and s.cls == cls:
                plain = next(
                    p for p in result.samples if p.mode == "none" and (p.cls, p.prompt_index, p.run) == (s.cls, s.prompt_index, s.run)
                )
                per_prompt.setdefault(s.prompt_index, []).append(s.stats.generation_tps / plain.stats.generation_tps)
        return geomean([statistics.median(v) for v in per_prompt.values()])

    for cls in ("code", "chat"):
        v = data["against_llama_cpp"][cls]
        assert v["best"] == PREFIX + "fast" and set(v["ratio"]) == {"hybrid"}
        assert math.isclose(v["ratio"]["hybrid"], score("hybrid", cls) / score(PREFIX + "fast", cls), rel_tol=1e-2)
    assert "llama.cpp" not in data["verdict"] and set(data["predicted_vs_measured"]) == {"hybrid"}


def test_the_real_tool_reads_the_same_prompt_tokens_and_is_rated(tiny, tool, tmp_path):
    """The whole command on the tiny models, with the real llama-speculative-simple: each
    setting's row, drafts that its draft model made, the same prompt tokens as specrun's own
    (the chat template rendered once, for both), and the rating per class."""
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    _register()
    argv = bench_argv(tiny, prompts, "--runs", "2", "-n", "12", "--draft", "hybrid", "--llama-cpp", "--llama-cpp-bin", str(tool), "--json")
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, (r.output, r.exception)
    data = json.loads(r.stdout)
    theirs = [PREFIX + s for s in DRAFT_SETTINGS]
    assert data["modes"] == ["none", "hybrid", *theirs]
    for cls in ("code", "chat"):
        for m in theirs:
            row = data["classes"][cls][m]
            assert row["n"] == 2 and row["tps_mean"] > 0 and row["drafted"] > 0 and 0 < row["accepted"] <= row["drafted"]
        v = data["against_llama_cpp"][cls]
        assert v["best"] in theirs and v["ratio"]["hybrid"] > 0
    assert set(data["against_llama_cpp"]) == {"code", "chat", "overall"}


def test_the_tool_is_given_the_prompt_tokens_specrun_decodes(tiny, tool, tmp_path):
    """The chat prompt as text for llama.cpp (which adds the model's specials itself, and drops
    a prompt file's last newline) comes to exactly the tokens specrun prefills for it."""
    from specrun.run.config import PairConfig
    from specrun.run.prompt import chat_prompt, chat_text
    from specrun.run.session import open_pair

    pair = open_pair(tiny["target"], None, PairConfig(n_ctx=512, threads=1))
    try:
        messages = [{"role": "user", "content": PROMPTS[1]["prompt"]}]
        ours = chat_prompt(pair, messages)
        f = write_prompt(tmp_path / "p.txt", chat_text(pair, messages))
    finally:
        pair.close()
    stats = LlamaCpp(tool, tiny["target"], None, threads=1, n_ctx=512).run("ngram-simple", f, 4)
    assert stats.n_prompt_tokens == len(ours) and stats.n_generated >= 4


def test_the_real_tool_runs_a_block_drafter_beside_specrun(tiny, tool, tmp_path):
    """With a block drafter as the draft, llama.cpp's draft-dspark runs the same file beside
    specrun's --draft dflash, drafting and accepting from it, rated per class."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_dflash import build_dflash

    dspark = build_dflash(tmp_path / "drafters")["dspark"]
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    _register()
    argv = bench_argv(tiny, prompts, "--runs", "1", "-n", "12", "--draft", "dflash", "--llama-cpp", "--llama-cpp-bin", str(tool), "--json")
    argv[argv.index("-d") + 1] = str(dspark)
    argv += ["--llama-cpp-settings", "draft-dspark@2,draft-dspark@8"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, (r.output, r.exception)
    data = json.loads(r.stdout)
    theirs = [PREFIX + "draft-dspark@2", PREFIX + "draft-dspark@8"]
    assert data["modes"] == ["none", "dflash", *theirs]
    for m in theirs:
        drafted = sum(data["classes"][cls][m]["drafted"] for cls in ("code", "chat"))
        accepted = sum(data["classes"][cls][m]["accepted"] for cls in ("code", "chat"))
        assert drafted > 0 and 0 < accepted <= drafted, (m, drafted, accepted)
    assert set(data["against_llama_cpp"]) == {"code", "chat", "overall"}
