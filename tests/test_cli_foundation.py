"""`inspect` and `check-pair` through the CLI: output, exit codes, and one-line errors for every
kind of broken input. Most tests call `main(argv)` in-process (the real error boundary); the
success paths also go through Typer's CliRunner, and two run a real `specrun` process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrun.cli.main import _register, app, main
from specrun.errors import EXIT_FAIL, EXIT_INPUT, EXIT_USAGE

SPECRUN = Path(sys.executable).parent / "specrun"


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # tables must not wrap the words the tests look for


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specrun: error:"), err
    assert "Traceback" not in err
    return lines[0]


def invoke_json(argv: list[str]) -> dict:
    _register()
    r = CliRunner().invoke(app, [*argv, "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    return json.loads(r.output)


def specrun_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


# --- inspect ------------------------------------------------------------------------------


def test_inspect_json_tiny(tiny):
    m = invoke_json(["inspect", str(tiny["target"])])
    assert m["architecture"] == "llama" and m["n_layer"] == 2 and m["n_head_kv"] == 2
    assert m["tokenizer"]["model"] == "gpt2" and m["tokenizer"]["n_vocab"] == 640
    assert m["tokenizer"]["special"]["eos"] == {"id": 639, "text": "<|im_end|>"}
    assert m["tokenizer"]["special"]["bos"] == {"id": 637, "text": "<|endoftext|>"}
    assert m["chat_template"] is True
    # 2 layers x 2 KV heads x (16 + 16) dims x 2 bytes (f16) x 1024 positions
    assert m["kv_bytes_per_1k_ctx"] == 2 * 2 * 32 * 2 * 1024


def test_inspect_json_real(demo):
    m = invoke_json(["inspect", "qwen-1.5b"])
    assert m["path"] == str(demo["target"])
    assert m["architecture"] == "qwen2" and m["n_layer"] == 28 and m["quant"] == "Q4_K_M"
    assert m["tokenizer"]["n_vocab"] == 151936
    assert m["tokenizer"]["special"]["eos"]["text"] == "<|im_end|>"
    assert m["chat_template"] is True
    assert m["kv_bytes_per_1k_ctx"] == 28 * 2 * 256 * 2 * 1024  # 28 layers, 2 KV heads of 128+128
    g = invoke_json(["inspect", str(demo["gemma3"])])
    assert g["architecture"].startswith("gemma3") and g["tokenizer"]["model"] == "llama"


def test_inspect_table(tiny, capsys):
    code, out, err = run_main(["inspect", str(tiny["target"])], capsys)
    assert code == 0 and err == ""
    for needle in ("llama", "640", "<|im_end|>", "chat template", "present", "256.00 KiB"):
        assert needle in out


def test_inspect_table_real(demo, capsys):
    code, out, _ = run_main(["inspect", "smollm2"], capsys)
    assert code == 0 and "llama" in out and "49152" in out


# --- check-pair ---------------------------------------------------------------------------


def check_pair_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, err = run_main(["check-pair", *argv, "--json"], capsys)
    return code, json.loads(out)


def failed(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["vocab"] if c["enforced"] and not c["ok"]}


def test_check_pair_real_qwen_pair_is_ok(demo, capsys):
    code, r = check_pair_json(capsys, "-m", "qwen-1.5b", "-d", "qwen-0.5b")
    assert code == 0 and r["compatible"] is True and r["fits"] is True and r["ok"] is True
    assert failed(r) == {}


def test_check_pair_real_qwen_vs_smollm2(demo, capsys):
    code, r = check_pair_json(capsys, "-m", "qwen-1.5b", "-d", "smollm2")
    assert code == EXIT_FAIL and r["compatible"] is False and isinstance(r["fits"], bool)
    bad = failed(r)
    assert "vocab size" in bad and "151936" in bad["vocab size"]["detail"] and "49152" in bad["vocab size"]["detail"]
    ids = [int(i) for i in re.findall(r"id (\d+):", bad["token texts"]["detail"])]
    assert ids and ids == sorted(ids) and ids[0] >= 5  # the first differing ids, in order
    assert r["suggested_drafts"] == ["qwen-0.5b"]
    code, out, _ = run_main(["check-pair", "-m", "qwen-1.5b", "-d", "smollm2"], capsys)
    assert code == EXIT_FAIL and "incompatible vocabularies" in out and "vocab size" in out


def test_check_pair_tiny_vocab_changed_names_the_id(tiny, capsys):
    code, r = check_pair_json(capsys, "-m", str(tiny["target"]), "-d", str(tiny["vocab-changed"]))
    assert code == EXIT_FAIL and r["compatible"] is False
    assert set(failed(r)) == {"token texts"}
    assert re.search(r"id 3\d\d: ", failed(r)["token texts"]["detail"])
    code, out, _ = run_main(["check-pair", "-m", str(tiny["target"]), "-d", str(tiny["vocab-changed"])], capsys)
    assert code == EXIT_FAIL and re.search(r"token texts: first differences at id 3\d\d", out)


@pytest.mark.parametrize(
    "variant, code", [("draft-copy", 0), ("vocab-plus100", 0), ("eos-changed", EXIT_FAIL), ("other-family", EXIT_FAIL)]
)
def test_check_pair_tiny_exit_codes(tiny, capsys, variant, code):
    got, r = check_pair_json(capsys, "-m", str(tiny["target"]), "-d", str(tiny[variant]), "-c", "512")
    assert got == code
    assert isinstance(r["compatible"], bool) and isinstance(r["fits"], bool)
    assert r["compatible"] is (code == 0) and r["fits"] is True and r["n_ctx"] == 512
    if variant == "eos-changed":
        assert set(failed(r)) == {"EOS id"}


def test_check_pair_table_ok(tiny, capsys):
    code, out, err = run_main(["check-pair", "-m", str(tiny["target"]), "-d", str(tiny["draft-small"])], capsys)
    assert code == 0 and "Vocabulary" in out and "Memory" in out and err == ""


# the command in a child process that writes its peak resident memory (the kernel's VmHWM,
# which counts the model pages it touched through mmap) on its last stderr line
PEAK_RSS = (
    "import sys\n"
    "from specrun.cli.main import main\n"
    "code = main(sys.argv[1:])\n"
    "print(next(ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')), file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def test_check_pair_real_subprocess_reads_headers_only(demo):
    """check-pair on the real pair in a child process: it decides from the headers, so its peak
    memory stays far below the weights (loading either model would touch them all)."""
    env = specrun_env(SPECRUN_MODELS_DIR=str(demo["target"].parent))
    argv = [sys.executable, "-c", PEAK_RSS, "check-pair", "-m", "qwen-1.5b", "-d", "qwen-0.5b", "--json"]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["compatible"] is True and r["fits"] is True
    assert "Traceback" not in p.stderr
    peak = int(p.stderr.strip().splitlines()[-1].split()[1]) * 1024  # "VmHWM:   123456 kB"
    weights = demo["target"].stat().st_size + demo["draft"].stat().st_size
    assert peak < weights / 3, f"peak {peak / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights"


def test_json_to_a_closed_pipe_is_quiet(tiny):
    cmd = f"{SPECRUN} inspect {tiny['target']} --json | true; echo rc=${{PIPESTATUS[0]}} >&2"
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert p.stderr == "rc=0\n"


# --- broken inputs: exit 3, one line ----------------------------------------------------


@pytest.fixture
def broken(tiny, tmp_path) -> dict[str, tuple[Path, str]]:
    """Each kind of unreadable model: (path, a word the message must contain)."""
    text = tmp_path / "notes.gguf"
    text.write_text("these are my notes, not a model\n" * 10)
    data = tiny["target"].read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    head = tmp_path / "head.gguf"  # cut inside the metadata, not only the tensor data
    head.write_bytes(data[:1000])
    return {
        "missing": (tmp_path / "nope.gguf", "not found"),
        "directory": (tmp_path, "directory"),
        "not-gguf": (text, "not a GGUF file"),
        "truncated": (half, "truncated"),
        "truncated-header": (head, "not a valid GGUF file"),
    }


KINDS = ["missing", "directory", "not-gguf", "truncated", "truncated-header"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["inspect", "target", "draft"])
def test_broken_model_files_exit_3_one_line(tiny, broken, capsys, kind, where):
    path, needle = broken[kind]
    argv = {
        "inspect": ["inspect", str(path)],
        "target": ["check-pair", "-m", str(path), "-d", str(tiny["target"])],
        "draft": ["check-pair", "-m", str(tiny["target"]), "-d", str(path)],
    }[where]
    for extra in ([], ["--json"]):
        code, out, err = run_main(argv + extra, capsys)
        assert code == EXIT_INPUT, err
        line = assert_one_line_error(err)
        assert needle in line and path.name in line
        assert out == ""


@pytest.mark.parametrize("argv", [["inspect", "no-such-model"], ["check-pair", "-m", "TARGET", "-d", "no-such-model"]])
def test_unknown_alias_exit_3(tiny, argv, capsys):
    code, _, err = run_main([str(tiny["target"]) if a == "TARGET" else a for a in argv], capsys)
    assert code == EXIT_INPUT
    assert "unknown model 'no-such-model'" in assert_one_line_error(err)


def test_unknown_alias_suggests(capsys):
    code, _, err = run_main(["inspect", "qwen-0.6b"], capsys)
    assert code == EXIT_INPUT and "did you mean" in assert_one_line_error(err) and "qwen-0.5b" in err


def test_registry_entry_whose_file_is_missing_names_its_source(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECRUN_MODELS_DIR", str(tmp_path))
    code, _, err = run_main(["inspect", "70b"], capsys)
    line = assert_one_line_error(err)
    assert code == EXIT_INPUT and "llama-3.1-70b" in line and "get it with: specrun pull llama-3.1-70b" in line


@pytest.mark.parametrize("argv", [["inspect", "x.gguf"], ["check-pair", "-m", "x.gguf", "-d", "y.gguf"]])
def test_invalid_registry_exit_3(argv, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[models."a"]\npath = "a.gguf"\n[models."b"\n')
    code, _, err = run_main([*argv, "--registry", str(bad)], capsys)
    assert code == EXIT_INPUT
    line = assert_one_line_error(err)
    assert str(bad) in line and "line 3" in line


def test_debug_shows_the_traceback(tmp_path):
    argv = [str(SPECRUN), "inspect", str(tmp_path / "nope.gguf")]
    p = subprocess.run(argv, capture_output=True, text=True, env=specrun_env(SPECRUN_DEBUG="1"), timeout=60)
    assert p.returncode != 0 and "Traceback" in p.stderr and "InputError" in p.stderr
    p = subprocess.run(argv, capture_output=True, text=True, env=specrun_env(SPECRUN_DEBUG="0"), timeout=60)
    assert p.returncode == EXIT_INPUT and "Traceback" not in p.stderr
    assert p.stderr.startswith("specrun: error: model file not found") and p.stderr.count("\n") == 1


# --- usage errors: exit 2, one line ------------------------------------------------------


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["check-pair", "-d", "x"], "--model"),
        (["check-pair", "-m", "x", "-d", "y", "-c", "-5"], "-c/--ctx"),
        (["check-pair", "-m", "x", "-d", "y", "-c", "0"], "-c/--ctx"),
        (["check-pair", "-m", "x", "-d", "y", "-c", "lots"], "--ctx"),
        (["check-pair", "-m", "x", "-d", "y", "--gpu-layers", "-7"], "--gpu-layers"),
        (["check-pair", "-m", "x", "-d", "y", "--gpu-layers-draft", "-2"], "--gpu-layers-draft"),
        (["check-pair", "-m", "x", "-d", "y", "--frobnicate"], "--frobnicate"),
        (["inspect"], "model"),
        (["inspect", "a", "b"], "b"),
        (["no-such-command"], "no-such-command"),
    ],
)
def test_usage_errors_exit_2_one_line(argv, needle, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == EXIT_USAGE, err
    assert needle in assert_one_line_error(err)
    assert out == ""


def test_usage_errors_come_before_reading_models(tmp_path, capsys):
    # a bad flag with a missing model is a usage error (2), not an input error (3)
    code, _, err = run_main(["check-pair", "-m", str(tmp_path / "nope.gguf"), "-d", "x", "-c", "-1"], capsys)
    assert code == EXIT_USAGE and "-c/--ctx" in err
