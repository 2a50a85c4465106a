"""Test fixtures: an isolated config/cache per test, tiny generated models, the demo pair."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

DEMO_FILES = {
    "target": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "draft": "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}


def models_dir() -> Path:
    return Path(os.environ.get("SPECRUN_MODELS_DIR") or Path.home() / ".cache/specrun/models")


def _isolate(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "config"))
    monkeypatch.setenv("SPECRUN_CACHE_DIR", str(home / "cache"))
    monkeypatch.delenv("SPECRUN_REGISTRY", raising=False)
    monkeypatch.delenv("SPECRUN_DEBUG", raising=False)
    monkeypatch.setenv("SPECRUN_MODELS_DIR", str(models_dir()))


@pytest.fixture(scope="session", autouse=True)
def isolated_session(tmp_path_factory):
    """... nor does a module's fixture (a bench run once for all its tests), which is set up
    before any test's own isolation."""
    with pytest.MonkeyPatch.context() as mp:
        _isolate(tmp_path_factory.mktemp("home"), mp)
        yield


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    """No test reads or writes the user's registry or cost cache."""
    _isolate(tmp_path, monkeypatch)
    return tmp_path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """The generated tiny models, by variant name (see tests/tiny_models.py)."""
    from tiny_models import build_all

    return build_all(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def demo() -> dict[str, Path]:
    """The real demo models. Missing files fail the test (CI fetches them first), unless
    SPECRUN_SKIP_DEMO=1 is set, which skips and says so."""
    paths = {k: models_dir() / v for k, v in DEMO_FILES.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        if os.environ.get("SPECRUN_SKIP_DEMO") == "1":
            pytest.skip("demo models not fetched (SPECRUN_SKIP_DEMO=1)")
        pytest.fail(f"demo models missing: {missing}; run scripts/fetch-demo-models.sh --all")
    return paths


@pytest.fixture(scope="session")
def demo_costs(demo, tmp_path_factory) -> Path | None:
    """The demo pair's costs (``-t 2``) as a user's store holds them after a first run, measured
    once a session: the calibration of the demo target's verify curve is about 20 s of every demo
    server's start on a 2-core CPU, the same 20 s each time. None where this machine was too busy
    for the measurement to be stored; the tests that would use it then measure their own."""
    home = tmp_path_factory.mktemp("demo-costs")
    env = {**os.environ, "SPECRUN_CACHE_DIR": str(home)}
    args = ["generate", "-m", str(demo["target"]), "-d", str(demo["draft"]), "-t", "2", "-c", "2048", "-n", "1", "-p", "hi"]
    subprocess.run([str(Path(sys.executable).parent / "specrun"), *args], env=env, capture_output=True, timeout=900, check=True)
    stored = home / "costs.json"
    return stored if stored.is_file() else None


@pytest.fixture
def demo_store(demo_costs, isolated_home) -> None:
    """This test's store starts with the demo pair's costs (see ``demo_costs``): a server it starts
    on the pair with ``-t 2`` skips the calibration, as a user's second run does."""
    if demo_costs is not None:
        (isolated_home / "cache").mkdir(parents=True, exist_ok=True)
        shutil.copy(demo_costs, isolated_home / "cache" / "costs.json")
