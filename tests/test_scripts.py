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
    ["install.sh", "fetch-demo-models.sh", "chat.sh", "bench.sh", "serve.sh", "bench-serve.sh", "compare-llama-cpp.sh", "worker.sh"],
)
def test_help_prints_usage(name: str, tmp_path: Path) -> None:
    result = run_script(name, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"scripts/{name}" in result.stdout  # the usage lines name the script
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
