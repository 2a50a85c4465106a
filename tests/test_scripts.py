"""The shell scripts in scripts/: shellcheck-clean, --help works, bad arguments fail early.

shellcheck is required: the test fails when it is missing (apt-get install shellcheck, or
brew install shellcheck). Set SPECRUN_NO_SHELLCHECK=1 to skip that one test deliberately.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS_DIR = REPO / "scripts"
SCRIPTS = sorted(SCRIPTS_DIR.glob("*.sh"))


def run_script(name: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "SPECRUN_EXTRAS")}
    return subprocess.run(
        ["bash", str(SCRIPTS_DIR / name), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
    )


def test_scripts_exist() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"install.sh", "fetch-demo-models.sh", "chat.sh", "bench.sh", "serve.sh", "compare-llama-cpp.sh"} <= names


def test_scripts_are_shellcheck_clean() -> None:
    if os.environ.get("SPECRUN_NO_SHELLCHECK") == "1":
        pytest.skip("SPECRUN_NO_SHELLCHECK=1")
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail(
            "shellcheck is not on PATH: install it (apt-get install shellcheck, or brew install "
            "shellcheck), or set SPECRUN_NO_SHELLCHECK=1 to skip this test"
        )
    result = subprocess.run([shellcheck, *map(str, SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "name",
    [
        "install.sh",
        "fetch-demo-models.sh",
        "chat.sh",
        "bench.sh",
        "serve.sh",
        "bench-serve.sh",
        "compare-llama-cpp.sh",
        "worker.sh",
        "ab.sh",
    ],
)
def test_help_prints_usage(name: str, tmp_path: Path) -> None:
    result = run_script(name, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"scripts/{name}" in result.stdout  # the usage lines name the script
    assert list(tmp_path.iterdir()) == []


def test_ab_refuses_a_base_that_is_no_commit_in_one_line(tmp_path: Path) -> None:
    result = run_script("ab.sh", "no-such-ref-anywhere", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "'no-such-ref-anywhere' is not a commit here" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_install_rejects_unknown_backend_without_side_effects(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    result = run_script("install.sh", "--force-backend", "bogus", str(venv), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "bogus" in lines[0] and "cpu" in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["--force-backend"], ["--no-such-flag"], ["--extras", "a b"]])
def test_install_rejects_bad_arguments(args: list[str], tmp_path: Path) -> None:
    result = run_script("install.sh", *args, str(tmp_path / "venv"), cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


# --- scripts/tools/compare_serve.py: the llama-server comparison's commands and arguments ---------


def compare_serve(*args: str) -> subprocess.CompletedProcess[str]:
    import sys

    return subprocess.run(
        [sys.executable, str(SCRIPTS_DIR / "tools" / "compare_serve.py"), *args], capture_output=True, text=True, timeout=60
    )


def test_compare_serve_starts_each_setup_as_documented(tmp_path: Path) -> None:
    result = compare_serve("--bin", str(tmp_path / "bin"), "--target", "T.gguf", "--draft", "D.gguf", "-t", "2", "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.strip().splitlines())
    assert list(lines) == ["draft-simple", "ngram-mod", "plain", "specrun"]
    cmds = {k: v.split() for k, v in lines.items()}
    for name in ("draft-simple", "ngram-mod", "plain"):
        assert cmds[name][0] == str(tmp_path / "bin" / "llama-server") and cmds[name][cmds[name].index("-m") + 1] == "T.gguf"
    assert cmds["draft-simple"][cmds["draft-simple"].index("-md") + 1] == "D.gguf" and "--spec-type draft-simple" in lines["draft-simple"]
    assert "--spec-type ngram-mod" in lines["ngram-mod"] and "-md" not in cmds["ngram-mod"]
    assert "--spec-type" not in cmds["plain"] and "-md" not in cmds["plain"]
    assert cmds["specrun"][1:2] == ["serve"] and cmds["specrun"][cmds["specrun"].index("-d") + 1] == "D.gguf"
    assert "--spec" not in lines["specrun"] and "--draft" not in cmds["specrun"]  # specrun at its defaults
    ports = [c[c.index("--port") + 1] for c in cmds.values()]
    assert len(set(ports)) == 4 and all(c[c.index("--host") + 1] == "127.0.0.1" for c in cmds.values())


@pytest.mark.parametrize(
    "args, words",
    [
        (["--setups", "draft-simple,bogus"], "unknown setup bogus"),
        (["--clients", "0"], "--clients"),
        (["--clients", "one"], "--clients"),
        (["--runs", "0"], "--runs"),
        (["--setups", "plain"], "--bin"),  # llama-server setups need the build
    ],
)
def test_compare_serve_refuses_bad_arguments(args: list[str], words: str) -> None:
    result = compare_serve(*args, "--dry-run")
    assert result.returncode == 2 and words in result.stderr.strip().splitlines()[-1], result.stderr
    assert result.stdout == ""


def test_compare_llama_cpp_documents_serve() -> None:
    result = run_script("compare-llama-cpp.sh", "--help")
    assert result.returncode == 0 and "--serve" in result.stdout and "compare_serve.py" in result.stdout


def test_compare_serve_measures_a_real_server(tiny, tmp_path: Path) -> None:
    """The client side of the comparison, against a real `specrun serve` on tiny models (a
    check of the script, not a benchmark: two short requests, one and two clients)."""
    import sys

    sys.path.insert(0, str(SCRIPTS_DIR / "tools"))
    import compare_serve as cs

    args = cs.parse_args(
        ["--setups", "specrun", "--target", str(tiny["target"]), "--draft", str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024"]
    )
    port = cs.free_port()
    server = cs.Running("specrun", cs.command("specrun", args, port), port, tmp_path / "specrun.log", timeout=120)
    try:
        assert server.model == "target.gguf"
        one = cs.measure(server, "chat", ["Tell me about foxes.", "And dogs?"], 1, run=1, n=8)
        two = cs.measure(server, "chat", ["Tell me about foxes.", "And dogs?"], 2, run=1, n=8)
    finally:
        server.stop()
    for s in (one, two):
        assert s.tokens == 16 and len(s.per_client_tps) == 2 and all(t > 0 for t in s.per_client_tps)
        assert len(s.ttft_ms) == 2 and all(t > 0 for t in s.ttft_ms) and s.total_tps > 0
    text = cs.table([one, two], ["specrun"], ["chat"], [1, 2])
    assert text.splitlines()[1].split()[:3] == ["specrun", "chat", "1"] and len(text.splitlines()) == 3


def test_compare_serve_starts_a_server_per_turn_and_stops_it(tiny, tmp_path: Path, capsys) -> None:
    """The whole loop, on tiny models: each run starts the setup's server for its turn and
    stops it after (only one holds the models at a time), and the table comes out."""
    import sys

    sys.path.insert(0, str(SCRIPTS_DIR / "tools"))
    import compare_serve as cs

    argv = ["--setups", "specrun", "--target", str(tiny["target"]), "--draft", str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024"]
    assert cs.main([*argv, "--runs", "2", "-n", "4", "--limit", "1", "--clients", "1", "--classes", "chat"]) == 0
    out = capsys.readouterr().out
    assert out.count("starting specrun") == 2 and out.count("run 1 specrun") == 1 and out.count("run 2 specrun") == 1
    assert any(line.split()[:3] == ["specrun", "chat", "1"] for line in out.splitlines())
