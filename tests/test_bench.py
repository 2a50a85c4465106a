"""`specrun bench` on the tiny models: the JSON schema, greedy exactness of every mode, the
Markdown report, and one-line errors with exit codes for bad input."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from specrun.bench.runner import BenchPrompt, load_prompts, run_bench
from specrun.cli.main import _register, app, main
from specrun.decode.costs import CostModel
from specrun.decode.engine import Settings
from specrun.decode.sampling import Sampler
from specrun.errors import EXIT_INPUT, EXIT_USAGE, InputError
from specrun.llama import LoadOptions, Model

MODES = ["none", "model", "ngram", "hybrid"]
MODE_KEYS = {
    "tps_mean",
    "tps_stdev",
    "speedup",
    "speedup_ci95",
    "acceptance_rate",
    "mean_accept_len",
    "accept_per_position",
    "identical_to_plain",
}
PROMPTS = [
    {"class": "code", "prompt": "def fibonacci(n):\n    if n < 2:\n        return n\n    return", "chat": False},
    {"class": "chat", "prompt": "Tell me about the quick brown fox."},
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def bench_argv(tiny, prompts: Path, *extra: str) -> list[str]:
    # --fixed: always draft (the adaptive chooser may rightly decide a CPU run is better off
    # without drafting, and then there is no acceptance to check); --tie-margin 0: no near-tie
    # deferrals, so a copy of the target has every draft accepted
    return [
        "bench",
        "-m",
        str(tiny["target"]),
        "-d",
        str(tiny["draft-copy"]),
        "--runs",
        "1",
        "-n",
        "16",
        "-t",
        "1",
        "-c",
        "512",
        "--fixed",
        "--draft-max",
        "4",
        "--tie-margin",
        "0",
        "--prompts",
        str(prompts),
        *extra,
    ]


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory) -> dict:
    prompts = write_jsonl(tmp_path_factory.mktemp("bench") / "p.jsonl", PROMPTS)
    _register()
    r = CliRunner().invoke(app, bench_argv(tiny, prompts, "--json", "--draft", "none,model,ngram,hybrid"))
    assert r.exit_code == 0, (r.output, r.exception)
    return json.loads(r.stdout)


def test_json_has_the_documented_shape(report):
    assert set(report) >= {"meta", "modes", "classes", "verdict", "cost_model", "predicted_vs_measured"}
    meta = report["meta"]
    assert meta["target"] == "target.gguf" and meta["draft"] == "draft-copy.gguf"
    assert (meta["threads"], meta["n_predict"], meta["runs"]) == (1, 16, 1)
    assert report["modes"] == MODES
    assert set(report["classes"]) == {"code", "chat", "overall"}
    for cls, modes in report["classes"].items():
        assert list(modes) == MODES, cls
        for mode, s in modes.items():
            assert MODE_KEYS <= set(s), (cls, mode)
            assert s["tps_mean"] > 0 and s["tps_stdev"] >= 0
            assert isinstance(s["accept_per_position"], list)
            assert all(0.0 <= x <= 1.0 for x in s["accept_per_position"])
    overall = report["classes"]["overall"]
    assert overall["none"]["speedup"] == 1.0 and overall["none"]["n"] == 2  # two prompts, one run
    assert isinstance(report["verdict"], str) and report["verdict"].startswith("use --draft ")

    cm = report["cost_model"]
    assert set(cm) == {"verify_s_by_batch", "verify_relative", "draft_s_per_token", "draft_relative", "perfect_drafter_speedup"}
    assert cm["perfect_drafter_speedup"] >= 1.0  # batch 1 is on the curve: a perfect drafter never loses
    assert cm["verify_relative"]["1"] == 1.0
    assert set(cm["verify_relative"]) == set(cm["verify_s_by_batch"])
    assert cm["draft_s_per_token"] > 0 and cm["draft_relative"] > 0  # a draft model was measured
    assert set(report["predicted_vs_measured"]) == {"model", "ngram", "hybrid"}
    for v in report["predicted_vs_measured"].values():
        assert set(v) == {"predicted", "measured"} and v["measured"] > 0


def test_every_mode_is_token_identical_to_plain(report):
    for cls, modes in report["classes"].items():
        for mode, s in modes.items():
            assert s["identical_to_plain"] is True, (cls, mode)


def test_a_copy_of_the_target_is_always_accepted(report):
    for cls in ("code", "chat", "overall"):
        s = report["classes"][cls]["model"]
        assert s["drafted"] > 0, cls  # --fixed: the model drafted every round
        assert s["acceptance_rate"] == 1.0, cls
        assert s["accept_per_position"] and all(x == 1.0 for x in s["accept_per_position"])
        assert s["mean_accept_len"] >= 1.0
    assert report["classes"]["overall"]["none"]["drafted"] == 0
    assert report["classes"]["overall"]["none"]["acceptance_rate"] == 0.0


def test_markdown_prints_tables_with_header_rows(tiny, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    code = main(bench_argv(tiny, prompts, "--markdown", "--draft", "model", "--classes", "code"))
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    header = lines.index(
        "| class | mode | tok/s (mean ± sd) | speedup vs plain (min) | 95% interval | acceptance | mean accepted len "
        "| tokens per verify | accept by position | accepted / drafted by source | same text as plain |"
    )  # no column for the branches' wins: no tree ran
    assert lines[header + 1] == "|---|---|---|---|---|---|---|---|---|---|---|"
    rows = [line for line in lines[header + 2 :] if line.startswith("| ")]
    assert [r.split(" | ")[:2] for r in rows[:4]] == [
        ["| code", "none"],
        ["| code", "model"],
        ["| overall", "none"],
        ["| overall", "model"],
    ]
    assert all(r.endswith("| yes |") for r in rows[:4])
    assert "| code | model |" in out and " 100% |" in rows[1]
    drafted = rows[1].split(" | ")[9]  # the copy of the target: every draft accepted, all by the model
    assert float(rows[1].split(" | ")[7]) > 1.0 and rows[0].split(" | ")[7] == "1.00"  # tokens per verify: plain's is one
    assert drafted.startswith("model ") and len(set(drafted.removeprefix("model ").split("/"))) == 1
    assert "| mode | predicted speedup | measured speedup |" in out
    assert "| verify batch |" in out
    assert any(line.startswith("**Verdict:** use --draft ") for line in lines)
    assert "chat" not in "".join(r.split(" | ")[0] for r in rows)  # --classes code


def test_ngram_only_needs_no_draft_model(tiny, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    code = main(
        [
            "bench",
            "-m",
            str(tiny["target"]),
            "--draft",
            "ngram",
            "--runs",
            "1",
            "-n",
            "8",
            "-t",
            "1",
            "-c",
            "512",
            "--json",
            "--prompts",
            str(prompts),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["modes"] == ["none", "ngram"] and data["meta"]["draft"] is None
    assert data["cost_model"]["draft_relative"] is None


def test_limit_keeps_at_most_n_prompts_of_each_class(tiny, tmp_path, capsys):
    rows = [{"class": c, "prompt": f"{c} prompt {i}", "chat": False, "n": 4} for c in ("a", "b") for i in range(3)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows[:1] + rows[3:] + rows[1:3])  # a, b, b, b, a, a
    code = main(["bench", "-m", str(tiny["target"]), "--draft", "ngram", "--runs", "1", "-t", "1", "-c", "512", "--json"]
                + ["--prompts", str(prompts), "--limit", "2"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert {c: data["classes"][c]["ngram"]["n"] for c in ("a", "b", "overall")} == {"a": 2, "b": 2, "overall": 4}


# --- bad input: one line on stderr, an exit code, nothing loaded --------------------------


def run_bad(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specrun: error: "), err
    assert out == ""
    return code, lines[0]


def test_unknown_draft_mode_is_a_usage_error(tiny, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    code, msg = run_bad(bench_argv(tiny, prompts, "--draft", "model,bogus"), capsys)
    assert code == EXIT_USAGE and "'bogus'" in msg


@pytest.mark.parametrize("spec", ["model:0", "ngram:x", "none:4", "model:", "hybrid:999"])
def test_bad_fixed_length_is_a_usage_error(tiny, tmp_path, capsys, spec):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    code, msg = run_bad(bench_argv(tiny, prompts, "--draft", f"hybrid,{spec}"), capsys)
    assert code == EXIT_USAGE and repr(spec) in msg and "hybrid,model:4" in msg


def test_fixed_lengths_sit_next_to_the_adaptive_mode(tiny, tmp_path, capsys):
    # without --fixed: "hybrid" adapts, "model:2" and "model:3" always draft exactly 2 and 3
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    code = main(
        [
            "bench",
            "-m",
            str(tiny["target"]),
            "-d",
            str(tiny["draft-copy"]),
            "--draft",
            "hybrid,model:2,model:3",
            "--runs",
            "1",
            "-n",
            "12",
            "-t",
            "1",
            "-c",
            "512",
            "--tie-margin",
            "0",
            "--json",
            "--prompts",
            str(prompts),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["modes"] == ["none", "hybrid", "model:2", "model:3"]
    for spec, k in (("model:2", 2), ("model:3", 3)):
        s = data["classes"]["overall"][spec]
        assert len(s["accept_per_position"]) == k and s["acceptance_rate"] == 1.0
        assert s["mean_accept_len"] == k  # a copy of the target: every fixed-length draft accepted


def test_json_and_markdown_together_is_a_usage_error(tiny, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    code, msg = run_bad(bench_argv(tiny, prompts, "--json", "--markdown"), capsys)
    assert code == EXIT_USAGE and "exclude each other" in msg


def test_unknown_class_is_a_usage_error(tiny, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    code, msg = run_bad(bench_argv(tiny, prompts, "--classes", "poetry"), capsys)
    assert code == EXIT_USAGE and "poetry" in msg


def test_missing_prompts_file(tiny, tmp_path, capsys):
    code, msg = run_bad(bench_argv(tiny, tmp_path / "nope.jsonl"), capsys)
    assert code == EXIT_INPUT and "nope.jsonl" in msg and "not found" in msg


@pytest.mark.parametrize(
    "bad_line, why",
    [
        ('{"class": "chat", "prompt": "unterminated', "not a prompt object"),
        ('["a", "list"]', "needs a non-empty string 'prompt'"),
        ('{"class": "chat"}', "needs a non-empty string 'prompt'"),
        ('{"class": "chat", "prompt": "  "}', "needs a non-empty string 'prompt'"),
        ('{"class": "chat", "prompt": "hi", "n": "16"}', "'n' must be a positive integer"),
        ('{"class": "chat", "prompt": "hi", "n": 0}', "'n' must be a positive integer"),
        ('{"class": "chat", "prompt": "hi", "chat": "yes"}', "'chat' must be true or false"),
        ('{"class": 7, "prompt": "hi"}', "'class' must be a non-empty string"),
        ('{"class": "chat", "prompt": "hi", "N": 5}', "unknown key 'N'"),
    ],
)
def test_malformed_jsonl_line_is_named(tiny, tmp_path, capsys, bad_line, why):
    prompts = write_jsonl(tmp_path / "p.jsonl", [PROMPTS[0], "", bad_line, PROMPTS[1]])
    code, msg = run_bad(bench_argv(tiny, prompts), capsys)
    assert code == EXIT_INPUT
    assert f"{prompts}:3:" in msg and why in msg  # line 3: blank lines count


def test_empty_or_unreadable_prompts_file(tmp_path):
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "   "])
    with pytest.raises(InputError, match="holds no prompts"):
        load_prompts(empty)
    with pytest.raises(InputError, match="cannot read"):
        load_prompts(tmp_path)  # a directory
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(InputError, match="UTF-8"):
        load_prompts(binary)


def test_builtin_prompts_load():
    prompts = load_prompts()
    assert len(prompts) >= 4 and len({p.cls for p in prompts}) >= 2


def test_the_interval_covers_the_class_mean_and_shrinks_with_agreement():
    from specrun.bench.runner import ci95, geomean

    spread = [0.9, 1.1, 1.3, 1.0, 1.2]
    lo, hi = ci95(spread)
    assert lo < geomean(spread) < hi
    tight = [1.10, 1.11, 1.09, 1.10, 1.10]
    tlo, thi = ci95(tight)
    assert thi - tlo < (hi - lo) / 5 and tlo > 1.05
    assert ci95([1.2]) == (1.2, 1.2)
    # t with 4 degrees of freedom: wider than a normal interval would be
    import math
    import statistics

    logs = [math.log(x) for x in spread]
    normal_half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
    assert math.log(hi) - math.log(geomean(spread)) > normal_half


def test_no_mode_always_runs_first(tiny):
    """The samples alternate their order (none model, then model none, ...), so a mode that ran
    first every time (a warm cache, a quiet neighbour) cannot pass for a faster one."""
    opts = LoadOptions(n_ctx=256, n_threads=1)
    with Model(tiny["target"], opts) as t, Model(tiny["draft-copy"], opts) as d:
        prompts = [BenchPrompt("code", "def f(x):", chat=False), BenchPrompt("chat", "Tell me", chat=False)]
        order: list[tuple[int, int, str]] = []
        result = run_bench(
            t, d, prompts, ["model"], Sampler(0.0), Settings(), lambda p: t.tokenize(p.prompt, add_special=True),
            8, 2, CostModel({1: 0.001, 2: 0.001}), lambda s: order.append((s.run, s.prompt_index, s.mode)),
        )  # fmt: skip
    assert len(result.samples) == 8
    firsts = [order[i][2] for i in range(0, 8, 2)]
    assert firsts == ["none", "model", "none", "model"]
    assert [list(m) for m in result.summaries().values()] == [["none", "model"]] * 3  # reported in the order given


@pytest.mark.parametrize("cols", [80, 250])
def test_the_tables_cut_no_number_or_name_in_a_terminal_of_any_width(tiny, tmp_path, cols):
    """In a real terminal 80 columns wide the summary comes as two tables, every cell whole (a
    cost model too wide for its table comes as a line that wraps); where one table fits, one."""
    from test_chat_pty import SPECRUN, Terminal, terminal_env

    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    t = Terminal([str(SPECRUN), *bench_argv(tiny, prompts, "--draft", "model,ngram,hybrid")], terminal_env(), cols=cols)
    try:
        assert t.wait() == 0, t.text[-3000:]
    finally:
        t.close()
    out = t.text
    assert "…" not in out, out[-4000:]
    assert max(len(line) for line in out.splitlines()) <= cols
    split = "specrun bench: speed" in out
    assert split == ("specrun bench: acceptance" in out) == (cols == 80)
    for cls in ("code", "chat", "overall"):
        assert re.search(rf"^│ {cls} +│ hybrid +│ +\d+\.\d +│", out, re.M), cls  # a row with its tok/s whole
    assert "measured cost model" in out  # a table where it fits, else a line


def test_bench_reports_tokens_per_verify_and_the_trees_a_branch_won_where_trees_ran(tiny):
    """On a target opened for trees, each sample's tree rounds, nodes and branch wins are those
    the target verified (read off its calls between one sample and the next; the first sample's
    also hold the warm-ups), and each mode's add them up; the tables get a column for them."""
    from test_trees import PROMPTS as TREE_PROMPTS
    from test_trees import TreeSpy

    from specrun.cli.bench import tables, to_markdown

    seen: list[tuple[int, int, int]] = []
    prompts = [BenchPrompt(f"p{i}", p, chat=False) for i, p in enumerate(TREE_PROMPTS)]
    settings = Settings(draft_max=4, p_min=0.0, fixed=True, tree=True)
    flat = CostModel({b: 0.001 * (1 + 0.01 * b) for b in (1, 2, 4, 8)})
    with pytest.MonkeyPatch.context() as mp:
        spy = TreeSpy(mp)
        with (
            Model(tiny["target"], LoadOptions(n_ctx=512, n_threads=1, tree_branches=8)) as t,
            Model(tiny["draft-perturbed"], LoadOptions(n_ctx=512, n_threads=1)) as d,
        ):
            result = run_bench(
                t, d, prompts, ["model"], Sampler(0.0), settings, lambda p: t.tokenize(p.prompt, add_special=True), 128, 1, flat,
                lambda sample: seen.append((spy.rounds, spy.nodes, spy.wins)),
            )  # fmt: skip
    for before, after, sample in zip(seen, seen[1:], result.samples[1:]):
        s = sample.stats
        assert (s.n_tree_rounds, s.n_tree_nodes, s.n_branch_wins) == tuple(b - a for a, b in zip(before, after)), sample
    data = result.to_json()["classes"]["overall"]
    model = [s.stats for s in result.samples if s.mode == "model"]
    assert data["model"]["tree_rounds"] == sum(s.n_tree_rounds for s in model) > 0
    assert data["model"]["tree_nodes"] == sum(s.n_tree_nodes for s in model)
    assert data["model"]["branch_wins"] == sum(s.n_branch_wins for s in model) > 0
    assert data["model"]["branch_win_rate"] == round(data["model"]["branch_wins"] / data["model"]["tree_rounds"], 4)
    assert data["model"]["tokens_per_decode"] == round(sum(s.n_generated for s in model) / sum(s.n_target_decodes for s in model), 4)
    assert (data["none"]["tree_rounds"], data["none"]["branch_wins"], data["none"]["tokens_per_decode"]) == (0, 0, 1.0)

    def header(res) -> str:
        c = Console(record=True, width=400, file=io.StringIO(), color_system=None)
        for part in tables(res):
            c.print(part)
        return next(line for line in c.export_text().splitlines() if "tok/verify" in line)

    assert "branch won" in header(result)
    md = to_markdown(result)
    m = data["model"]
    assert "| a branch won / trees |" in md and f"| {m['branch_wins']}/{m['tree_rounds']} ({100 * m['branch_win_rate']:.0f}%) |" in md
    result.samples = [dataclasses.replace(s, stats=dataclasses.replace(s.stats, n_tree_rounds=0, n_tree_nodes=0, n_branch_wins=0))
                      for s in result.samples]  # fmt: skip
    assert "branch won" not in header(result) and "a branch won" not in to_markdown(result)  # no tree ran: no column
