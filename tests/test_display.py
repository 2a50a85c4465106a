"""The display functions on fixed, hand-built numbers, rendered to plain text (no terminal)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from specrun.cli.display import (
    human_bytes,
    human_count,
    inspect_table,
    models_table,
    pair_table,
    stats_table,
    status_line,
    summary_line,
)
from specrun.decode.stats import RoundStats, RunStats
from specrun.fit.memory import Gpu, GpuQuery
from specrun.fit.placement import PlacementSettings
from specrun.gguf.facts import model_info
from specrun.run.pair import check_pair

GiB = 1 << 30


def render(renderable) -> str:
    c = Console(record=True, width=120, file=io.StringIO(), color_system=None)
    c.print(renderable)
    return c.export_text()


def squash(text: str) -> str:
    """Collapse runs of spaces so assertions do not depend on column padding."""
    return re.sub(r"[ \t]+", " ", text)


def row(text: str, first_cell: str) -> list[str]:
    """The cells of the table row whose first cell is ``first_cell``."""
    for line in text.splitlines():
        if not line.startswith(("│", "┃")):
            continue
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]  # between the borders
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{text}")


@pytest.fixture
def run() -> RunStats:
    """100 tokens in 4 s (25.0 tok/s); 50 drafted, 40 accepted (80%) in 10 drafting rounds
    (mean length 4.00); 40 target decodes (2.50 tok/decode); last draft length K=4."""
    return RunStats(
        n_prompt_tokens=20,
        n_generated=100,
        prompt_s=0.5,
        wall_s=4.0,
        draft_s=1.0,
        verify_s=3.0,
        sample_s=0.0,
        n_rounds=40,
        n_target_decodes=40,
        n_drafted=50,
        n_accepted=40,
        n_drafted_rounds=10,
        proposed_at=[10, 10, 10, 10, 10],
        accepted_at=[10, 9, 8, 7, 6],
        by_source={"model": [8, 40, 32], "ngram": [2, 10, 8], "none": [30, 0, 0]},
        draft_lengths=[5] * 10 + [0] * 29 + [4],
        finish_reason="length",
    )


def test_status_line(run):
    text = squash(render(status_line(run)))
    assert "25.0 tok/s" in text
    assert "accept 80%" in text
    assert "mean len 4.00" in text
    assert "draft K=4" in text
    assert "draft/verify 25/75%" in text
    assert "100 tok" in text


def test_status_line_before_any_round():
    text = squash(render(status_line(RunStats())))
    assert "0.0 tok/s" in text and "accept 0%" in text and "draft K=0" in text
    assert "draft/verify -/-" in text  # no division by zero


def test_summary_line(run):
    line = summary_line(run, label="session: ")
    assert line.startswith("session: 100 tokens in 4.00 s, 25.0 tok/s")
    assert "prompt 20 tok at 40.0 tok/s" in line
    assert "accepted 40/50 (80%)" in line
    assert "mean len 4.00" in line
    assert "2.50 tok/decode" in line
    assert "draft 1.00 s, verify 3.00 s" in line
    assert "rounds: model 8, ngram 2, none 30" in line
    assert line.endswith("finish: length")
    assert "\n" not in line


def test_summary_line_with_nothing_drafted():
    s = RunStats(
        n_prompt_tokens=7, n_generated=3, wall_s=0.5, n_rounds=3, n_target_decodes=3, by_source={"none": [3, 0, 0]}, finish_reason="stop"
    )
    line = summary_line(s)
    assert "accepted 0/0 (0%)" in line and "rounds: none 3" in line and "6.0 tok/s" in line


def test_stats_table(run):
    text = render(stats_table(run))
    assert "Session" in text
    assert row(text, "generated")[1] == "100 tokens at 25.0 tok/s"
    assert row(text, "prompt")[1] == "20 tokens at 40.0 tok/s"
    assert row(text, "drafted / accepted")[1] == "50 / 40 (80.0%)"
    assert row(text, "mean accepted length")[1] == "4.00"
    assert row(text, "tokens per target decode")[1] == "2.50"
    assert row(text, "time: draft / verify / sample / other")[1] == "1.00 / 3.00 / 0.00 / 0.00 s"
    assert row(text, "rounds by source")[1] == "model: 8, ngram: 2, none: 30"
    assert "Acceptance per draft position" in text
    assert row(text, "1") == ["1", "10", "10", "100%"]
    assert row(text, "2") == ["2", "10", "9", "90%"]
    assert row(text, "5") == ["5", "10", "6", "60%"]


def test_stats_table_built_from_rounds():
    s = RunStats()
    s.add(RoundStats("model", 4, 4, 5, 0.01, 0.02, 0.0))
    s.add(RoundStats("model", 4, 1, 2, 0.01, 0.02, 0.0))
    s.add(RoundStats("none", 0, 0, 1, 0.0, 0.01, 0.0))
    s.wall_s = 0.08
    text = render(stats_table(s, title="Turn"))
    assert "Turn" in text
    assert row(text, "generated")[1] == "8 tokens at 100.0 tok/s"
    assert row(text, "drafted / accepted")[1] == "8 / 5 (62.5%)"
    assert row(text, "mean accepted length")[1] == "2.50"  # 5 accepted over 2 drafting rounds
    assert row(text, "1") == ["1", "2", "2", "100%"]
    assert row(text, "2") == ["2", "2", "1", "50%"]
    assert row(text, "4") == ["4", "2", "1", "50%"]
    assert squash(render(status_line(s))).count("draft K=0") == 1  # the last round drafted nothing


def test_tree_counts_show_only_where_trees_ran(run):
    for shown in (status_line(run), summary_line(run), stats_table(run)):
        assert "branch" not in squash(render(shown)) and "tree" not in squash(render(shown))
    run.n_tree_rounds, run.n_tree_nodes, run.n_branch_wins = 8, 48, 2
    assert "trees 8 (48 nodes), a branch won 2 (25%), 2.50 tok/verify" in squash(render(status_line(run)))
    assert summary_line(run).endswith("| finish: length | trees 8 (48 nodes), a branch won 2 (25%)")
    text = render(stats_table(run))
    assert row(text, "token trees")[1] == "8 rounds, 48 nodes verified"
    assert row(text, "a branch other than the first won")[1] == "2 rounds (25.0%)"


def test_text_from_a_branch_is_tinted_apart_from_the_drafts():
    from specrun.cli.display import BRANCH_STYLE, DRAFT_STYLE, event_text
    from specrun.run.stream import Event

    segments = (("def ", None, False), ("add", "model", False), ("(", "model", True), ("a", None, False))
    ev = Event("def add(a", (), (), RunStats(), segments=segments)
    styles = {ev.text[s.start : s.end]: str(s.style) for s in event_text(ev, True).spans}
    assert styles == {"add": DRAFT_STYLE, "(": BRANCH_STYLE} and BRANCH_STYLE != DRAFT_STYLE
    assert not event_text(ev, False).spans


def test_stats_table_empty_session():
    text = render(stats_table(RunStats()))
    assert row(text, "rounds by source")[1] == "-"
    assert row(text, "drafted / accepted")[1] == "0 / 0 (0.0%)"


def test_human_units():
    assert human_bytes(None) == "-"
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(3 * GiB) == "3.00 GiB"
    assert human_count(999) == "999"
    assert human_count(1_500_000) == "1.50M"
    assert human_count(7_000_000_000) == "7.00B"


# --- pair_table, inspect_table, models_table --------------------------------------------


def fixed_fit_report(target: Path, draft: Path, n_ctx=512, gq=None, ram=8 * GiB, **kw):
    """check_pair on the tiny models, with the memory fit made against fixed free memory."""
    return check_pair(target, draft, PlacementSettings(n_ctx=n_ctx), gpu_query=gq or GpuQuery([], problem="none"), available_ram=ram, **kw)


def test_pair_table_compatible(tiny):
    r = fixed_fit_report(tiny["target"], tiny["draft-copy"])
    text = render(pair_table(r))
    assert "target: tiny-target (target.gguf)" in text
    assert "draft:  tiny-draft-copy (draft-copy.gguf)" in text
    assert row(text, "vocab size") == ["vocab size", "640", "640", "ok", ""]
    assert row(text, "EOS id")[1:4] == ["639", "639", "ok"]
    assert row(text, "pre-tokenizer")[1:4] == ["qwen2", "qwen2", "info"]
    assert "Memory at -c 512" in text
    target_row = row(text, "target")
    assert target_row[1] == human_bytes(r.target.weights_bytes)
    assert target_row[2] == "128.00 KiB"  # 2 layers x 2 kv heads x (16+16) dims x 2 bytes x 512
    assert row(text, "CPU")[1:4] == ["RAM", "system RAM", "8.00 GiB"]
    assert row(text, "CPU")[-1] == "ok"
    assert "Placement: target on the CPU; draft on the CPU" in text
    assert "no NVIDIA GPU found (none)" in text
    assert "OK: the pair is compatible and fits." in text
    assert "FAIL" not in text


def test_pair_table_incompatible_with_suggestion(tiny):
    r = fixed_fit_report(tiny["target"], tiny["other-family"])
    r.suggestions = ["small"]
    text = squash(render(pair_table(r)))
    assert "NO: incompatible vocabularies" in text
    assert "tokenizer model: target uses 'gpt2', draft uses 'llama'" in text
    assert "known drafts that match the target: small (`specrun drafts` lists them all)" in text
    assert row(render(pair_table(r)), "tokenizer model")[1:4] == ["gpt2", "llama", "FAIL"]
    assert row(render(pair_table(r)), "pre-tokenizer")[3] == "differs"


def test_pair_table_does_not_fit(tiny):
    gpu = GpuQuery([Gpu(0, "Tiny GPU", GiB, 1 << 20)], driver="555.0")
    r = fixed_fit_report(tiny["target"], tiny["draft-copy"], gq=gpu)
    text = render(pair_table(r, lambda s: f"--{s.replace('_', '-')}"))
    assert row(text, "CUDA0")[1:4] == ["GPU", "Tiny GPU", "1.00 MiB"]
    assert row(text, "CUDA0")[-1] == "FAIL"
    assert "1 NVIDIA GPU, driver 555.0" in text
    assert "NO: does not fit (CUDA0 needs" in squash(text)
    # the exact flags that would fit: here, nothing on the GPU
    assert "This would fit: --gpu-layers 0 --gpu-layers-draft 0" in squash(text)


def test_inspect_table(tiny):
    m = model_info(tiny["target"])
    text = render(inspect_table(m))
    assert row(text, "name")[1] == "tiny-target"
    assert row(text, "architecture")[1] == "llama"
    assert row(text, "layers")[1] == "2"
    assert row(text, "context length")[1] == "4096"
    assert row(text, "embedding / heads / kv heads")[1] == "64 / 4 / 2"
    assert row(text, "vocabulary")[1] == "640"
    assert row(text, "eos token")[1] == "639 '<|im_end|>'"
    assert row(text, "bos token")[1] == "637 '<|endoftext|>'"
    assert row(text, "chat template")[1] == "present"
    assert row(text, "KV cache per 1k context (f16)")[1] == "256.00 KiB"


def test_models_table():
    rows = [
        {
            "name": "qwen-1.5b",
            "aliases": ["q15", "coder"],
            "present": True,
            "size": 3 * GiB // 2,
            "architecture": "qwen2",
            "quant": "Q4_K_M",
            "draft": "qwen-0.5b",
            "path": "/m/q15.gguf",
            "verified": True,
        },
        {
            "name": "qwen-0.5b",
            "aliases": [],
            "present": False,
            "size": None,
            "architecture": None,
            "quant": None,
            "draft": None,
            "path": "/m/q05.gguf",
        },
        {
            "name": "broken",
            "aliases": [],
            "present": True,
            "size": 10,
            "architecture": None,
            "quant": None,
            "draft": None,
            "path": "/m/b.gguf",
            "error": "not a GGUF file",
        },
        {
            "name": "tampered",
            "aliases": [],
            "present": True,
            "size": 2048,
            "architecture": "llama",
            "quant": "F16",
            "draft": None,
            "path": "/m/t.gguf",
            "verified": False,
        },
    ]
    text = render(models_table(rows))
    assert row(text, "qwen-1.5b")[1:7] == ["q15, coder", "present sha256 ok", "1.50 GiB", "qwen2", "Q4_K_M", "qwen-0.5b"]
    assert row(text, "qwen-0.5b")[1:7] == ["", "missing", "-", "-", "-", "-"]
    assert row(text, "broken")[2] == "unreadable"
    assert row(text, "tampered")[2] == "present SHA256 MISMATCH"
    assert row(text, "tampered")[3] == "2.00 KiB"
