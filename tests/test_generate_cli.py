"""`specrun generate` on the tiny models: the JSON object, plain == speculative at temperature
0, and the bad-input table (each row an exit code and a one-line message, never a traceback),
through `main(argv)` in-process and through a real `specrun` process (pipes and signals).

Every run uses `-t 1`: on a busy machine llama.cpp's worker threads spin, and one thread is
many times faster than two for a 64-wide model."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specrun.cli.main import main
from specrun.errors import EXIT_FAIL, EXIT_INPUT, EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE

SPECRUN = Path(sys.executable).parent / "specrun"
PROMPT = "The quick brown fox"  # greedy from here runs to the end of a 4096 context, no EOS
STATS_KEYS = {
    "n_prompt_tokens",
    "n_generated",
    "prompt_tps",
    "generation_tps",
    "n_drafted",
    "n_accepted",
    "acceptance_rate",
    "mean_accept_len",
    "accept_per_position",
    "draft_s",
    "verify_s",
    "wall_s",
}


def gen_argv(tiny, *args: str, model: str = "target") -> list[str]:
    return ["generate", "-m", str(tiny[model]), "-t", "1", *args]


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_json(tiny, capsys, *args: str) -> dict:
    code, out, err = run_main(gen_argv(tiny, *args, "--json"), capsys)
    assert code == 0, err
    return json.loads(out)


def run_proc(tiny, *args: str, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("timeout", 120)
    return subprocess.run([str(SPECRUN), *gen_argv(tiny, *args)], capture_output=True, text=True, **kw)


def error_line(err: str) -> str:
    """The single `specrun: error:` line (llama.cpp notices may precede it), no traceback."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("specrun: error:")]
    assert len(lines) == 1, err
    return lines[0]


def only_error_line(err: str) -> str:
    """Usage errors come before anything loads: stderr is exactly one line."""
    assert len(err.strip().splitlines()) == 1, err
    return error_line(err)


# --- the JSON object ----------------------------------------------------------------------


def test_json_object_from_a_real_process(tiny):
    p = run_proc(
        tiny,
        "-d",
        str(tiny["draft-perturbed"]),
        "--draft",
        "model",
        "--fixed",
        "--draft-max",
        "4",
        "-p",
        PROMPT,
        "-n",
        "24",
        "-c",
        "512",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)  # stdout is the object and nothing else
    assert set(r) >= {"text", "tokens", "finish_reason", "stats"}
    assert isinstance(r["text"], str) and r["text"]
    assert len(r["tokens"]) == 24 and all(isinstance(t, int) for t in r["tokens"])
    assert r["finish_reason"] == "length" == r["stats"]["finish_reason"]
    s = r["stats"]
    assert STATS_KEYS <= set(s), STATS_KEYS - set(s)
    assert s["n_generated"] == 24 and s["n_prompt_tokens"] > 0
    assert 0 < s["n_accepted"] <= s["n_drafted"] and 0 <= s["acceptance_rate"] <= 1
    assert len(s["accept_per_position"]) == 4 and s["wall_s"] > 0
    assert "Traceback" not in p.stderr


def test_text_mode_streams_text_and_puts_stats_on_stderr(tiny, capsys):
    code, out, err = run_main(gen_argv(tiny, "--draft", "none", "-p", PROMPT, "-n", "16", "-c", "256"), capsys)
    assert code == 0 and out.endswith("\n") and len(out) > 1
    assert re.search(r"16 tokens in [\d.]+ s, .* finish: length", err)


# --- plain == speculative at temperature 0 -------------------------------------------------


def test_plain_and_speculative_give_identical_tokens(tiny, capsys):
    common = ["-p", PROMPT, "-n", "40", "-c", "512", "--temp", "0"]
    plain = run_json(tiny, capsys, "--draft", "none", *common)
    spec = run_json(tiny, capsys, "-d", str(tiny["draft-perturbed"]), "--draft", "model", "--fixed", "--draft-max", "4", *common)
    assert plain["stats"]["n_drafted"] == 0
    assert spec["stats"]["n_drafted"] > 0 and spec["stats"]["n_accepted"] > 0
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]
    adaptive = run_json(tiny, capsys, "-d", str(tiny["draft-unrelated"]), *common)  # default: hybrid, adaptive
    assert adaptive["tokens"] == plain["tokens"]


def test_temperature_sampling_is_reproducible_with_a_seed(tiny, capsys):
    args = ["-p", PROMPT, "-n", "30", "-c", "256", "--temp", "0.8", "--seed", "11"]
    a = run_json(tiny, capsys, "-d", str(tiny["draft-perturbed"]), "--draft", "model", "--fixed", *args)
    b = run_json(tiny, capsys, "-d", str(tiny["draft-perturbed"]), "--draft", "model", "--fixed", *args)
    assert a["tokens"] == b["tokens"]


# --- the bad-input table ------------------------------------------------------------------


@pytest.mark.parametrize("args", [["-p", ""], ["-p", "   \n\t"]])
def test_empty_prompt_exit_2(tiny, capsys, args):
    code, out, err = run_main(gen_argv(tiny, *args), capsys)
    assert code == EXIT_USAGE and "prompt is empty" in only_error_line(err) and out == ""


def test_empty_prompt_file_exit_2(tiny, tmp_path, capsys):
    f = tmp_path / "empty.txt"
    f.write_bytes(b"\xef\xbb\xbf\n")  # a BOM and a newline: still empty
    code, _, err = run_main(gen_argv(tiny, "--prompt-file", str(f)), capsys)
    assert code == EXIT_USAGE and "prompt is empty" in only_error_line(err)


def test_prompt_longer_than_the_context_exit_1(tiny, tmp_path, capsys):
    f = tmp_path / "long.txt"
    f.write_text("hello world " * 100)  # about 400 tokens of the tiny vocabulary
    code, out, err = run_main(gen_argv(tiny, "--draft", "none", "--prompt-file", str(f), "-c", "256"), capsys)
    assert code == EXIT_FAIL
    m = re.search(r"the prompt has (\d+) tokens but the context holds 256; raise -c/--ctx to (\d+)", error_line(err))
    assert m, err
    n, need = int(m.group(1)), int(m.group(2))
    assert 300 < n < 500 and need >= n


@pytest.mark.parametrize("draft", [["--draft", "none"], ["--draft", "model", "--fixed", "--draft-max", "8"]])
def test_n_beyond_the_context_stops_with_reason_context(tiny, tmp_path, capsys, draft):
    f = tmp_path / "mid.txt"
    f.write_text("the dog " * 78)  # about 236 tokens
    r = run_json(tiny, capsys, "-d", str(tiny["draft-perturbed"]), *draft, "--prompt-file", str(f), "-c", "256", "-n", "1000")
    s = r["stats"]
    assert r["finish_reason"] == "context"
    assert 200 < s["n_prompt_tokens"] < 256 and 0 < s["n_generated"] < 1000
    # the context holds every token but the last one sampled, which is never evaluated
    assert s["n_prompt_tokens"] + s["n_generated"] in (256, 257)


def test_n_beyond_the_context_same_tokens_plain_and_speculative(tiny, tmp_path, capsys):
    f = tmp_path / "mid.txt"
    f.write_text("the dog " * 78)
    args = ["--prompt-file", str(f), "-c", "256", "-n", "1000"]
    plain = run_json(tiny, capsys, "--draft", "none", *args)
    spec = run_json(tiny, capsys, "-d", str(tiny["draft-perturbed"]), "--draft", "model", "--fixed", "--draft-max", "8", *args)
    assert spec["tokens"] == plain["tokens"]


def test_non_utf8_prompt_file_exit_3_names_the_offset(tiny, tmp_path, capsys):
    f = tmp_path / "latin1.txt"
    f.write_bytes("Café au lait".encode("latin-1"))  # é is 0xe9, at byte 3
    code, out, err = run_main(gen_argv(tiny, "--prompt-file", str(f)), capsys)
    assert code == EXIT_INPUT and out == ""
    line = only_error_line(err)
    assert "not UTF-8" in line and "0xe9" in line and "offset 3" in line and str(f) in line


def test_non_utf8_stdin_exit_3(tiny):
    argv = [str(SPECRUN), *gen_argv(tiny, "--draft", "none")]
    p = subprocess.run(argv, input=b"ok \xff\xfe", capture_output=True, timeout=60)
    err = p.stderr.decode()
    assert p.returncode == EXIT_INPUT and "stdin is not UTF-8" in error_line(err) and "offset 3" in err


@pytest.mark.parametrize("path", ["missing.txt", "."])
def test_unreadable_prompt_file_exit_3(tiny, tmp_path, capsys, path):
    code, _, err = run_main(gen_argv(tiny, "--prompt-file", str(tmp_path / path)), capsys)
    assert code == EXIT_INPUT and only_error_line(err)


def test_draft_of_another_family_exit_1_before_loading(tiny, capsys, monkeypatch):
    import specrun.llama

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the vocabulary check")

    monkeypatch.setattr(specrun.llama, "Model", no_load)
    code, out, err = run_main(gen_argv(tiny, "-d", str(tiny["other-family"]), "-p", PROMPT), capsys)
    assert code == EXIT_FAIL and out == ""
    line = only_error_line(err)
    assert "other-family.gguf cannot draft for target.gguf" in line and "tokenizer model" in line


def test_draft_that_cannot_be_read_exit_3(tiny, tmp_path, capsys):
    code, _, err = run_main(gen_argv(tiny, "-d", str(tmp_path / "nope.gguf"), "-p", PROMPT), capsys)
    assert code == EXIT_INPUT and "not found" in only_error_line(err)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--draft-max", "0"], "--draft-max"),
        (["--draft-max", "-3"], "--draft-max"),
        (["--draft-p-min", "1.5"], "--draft-p-min"),
        (["--draft-p-min", "-0.1"], "--draft-p-min"),
        (["--temp", "-1"], "--temp"),
        (["-n", "0"], "-n"),
        (["-n", "-5"], "-n"),
        (["-c", "-1"], "-c"),
        (["-t", "0"], "-t"),
        (["--top-p", "1.5"], "--top-p"),
        (["--draft", "bogus"], "bogus"),
        (["-p", "x", "--prompt-file", "y"], "not both"),
        (["--temp", "warm"], "--temp"),
    ],
)
def test_out_of_range_numbers_exit_2(tiny, capsys, args, needle):
    argv = gen_argv(tiny, *args) if "-p" in args else gen_argv(tiny, "-p", PROMPT, *args)
    code, out, err = run_main(argv, capsys)
    assert code == EXIT_USAGE and needle in only_error_line(err) and out == ""


def test_missing_model_flag_exit_2(capsys):
    code, _, err = run_main(["generate", "-p", "hi"], capsys)
    assert code == EXIT_USAGE and "--model" in only_error_line(err)


# --- a real process: stdin, stdout, signals ------------------------------------------------


def test_stdin_closed_without_a_prompt_is_a_usage_error(tiny):
    p = run_proc(tiny, "--draft", "none", stdin=subprocess.DEVNULL, timeout=60)  # a hang fails here
    assert p.returncode == EXIT_USAGE
    line = only_error_line(p.stderr)
    assert "prompt is empty" in line and "-p" in line


def test_prompt_from_stdin(tiny):
    p = run_proc(tiny, "--draft", "none", "-n", "8", "-c", "256", "--json", input=PROMPT)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["stats"]["n_generated"] == 8


@pytest.mark.parametrize("json_out, reader, n_out", [(False, "head -c 10", 10), (False, "true", 0), (True, "true", 0)])
def test_stdout_a_closed_pipe_is_quiet(tiny, json_out, reader, n_out):
    """`| head -c 10` closes the pipe mid-stream; `| true` before the first write. Text mode
    stops generating; --json writes once, at the end (so it runs a short -n)."""
    n = "300" if json_out else "2000"
    cmd = " ".join([str(SPECRUN), *gen_argv(tiny, "--draft", "none", "-p", "'The quick brown fox'", "-n", n, "-c", "4096")])
    cmd += " --json" if json_out else ""
    p = subprocess.run(
        ["bash", "-c", f'set +o pipefail; {cmd} | {reader}; echo "rc=${{PIPESTATUS[0]}}" >&2'],
        capture_output=True,
        timeout=120,
    )
    err = p.stderr.decode(errors="replace")
    assert len(p.stdout) == n_out
    assert "BrokenPipeError" not in err and "Traceback" not in err and "Exception ignored" not in err, err
    assert "rc=0" in err
    assert ("finish: length" if json_out else "finish: interrupted") in err  # the stats line, still


def read_first_bytes(proc: subprocess.Popen, timeout: float = 60) -> bytes:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output within the timeout"
    return os.read(proc.stdout.fileno(), 4096)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, EXIT_SIGINT), (signal.SIGTERM, EXIT_SIGTERM)])
def test_signal_during_generation_prints_stats_and_exits(tiny, signum, code):
    argv = [str(SPECRUN), *gen_argv(tiny, "--draft", "none", "-p", PROMPT, "-n", "100000", "-c", "4096")]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = read_first_bytes(proc)
        assert first
        proc.send_signal(signum)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err.decode(errors="replace")
    assert proc.returncode == code, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    m = re.search(r"(\d+) tokens in [\d.]+ s.*finish: interrupted", err)
    assert m and 0 < int(m.group(1)) < 4000, err
    assert (first + rest).endswith(b"\n")  # what it had, then the closing newline
