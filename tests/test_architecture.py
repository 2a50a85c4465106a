"""The layering holds: no import cycle inside specrun, and the contracts in pyproject.toml."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if not w.startswith("specrun"):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(graph.modules):
        if m.startswith("specrun") and m not in index:
            visit(m)
    return out


def test_no_import_cycle_in_specrun():
    graph = grimp.build_graph("specrun", exclude_type_checking_imports=False)  # a type-checking import closes a circle too
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    graph = grimp.ImportGraph()
    for m in ("specrun.a", "specrun.b", "specrun.c"):
        graph.add_module(m)
    graph.add_import(importer="specrun.a", imported="specrun.b")
    graph.add_import(importer="specrun.b", imported="specrun.a")
    graph.add_import(importer="specrun.c", imported="specrun.a")
    assert cycles(graph) == [["specrun.a", "specrun.b"]]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is not installed (scripts/install.sh --extras test)"
    p = subprocess.run([exe, str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


# --- every module is named by the contracts --------------------------------------------------------

FRONT_ENDS = {"specrun.cli"}  # where Typer and Rich may be used


def contracts() -> dict[str, dict]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return {c["name"]: c for c in tomllib.load(f)["tool"]["importlinter"]["contracts"]}


def layers() -> list[list[str]]:
    """The layers contract, top first: each layer's modules."""
    (layered,) = [c for c in contracts().values() if c["type"] == "layers"]
    return [[m.strip() for m in re.split(r"[|:]", layer)] for layer in layered["layers"]]


def package_modules() -> list[str]:
    """specrun's modules as the contracts name them: each top-level module, and each subpackage
    (specrun.cli, specrun.server) as one."""
    out = []
    for p in sorted((ROOT / "specrun").iterdir()):
        if p.suffix == ".py" and p.stem != "__init__":
            out.append(f"specrun.{p.stem}")
        elif p.is_dir() and (p / "__init__.py").exists():
            out.append(f"specrun.{p.name}")
    return out


def named(module: str, names: list[str]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


HOW_TO_FIX = (
    "add it to the layers contract in pyproject.toml, on the layer its imports put it: below every module that imports it "
    "and above every module it imports (run `lint-imports pyproject.toml` to check, and see docs/architecture.md); "
    "unless it is specrun.llama, also name it in 'Only specrun.llama imports llama_cpp', and unless it is the front end "
    "(specrun.cli), in 'The core never imports Typer or Rich'; a new command module (specrun/cli/*.py "
    "with a register function) goes in 'No command imports another'"
)


def test_every_module_is_in_a_layer():
    layered = [m for layer in layers() for m in layer]
    missing = [m for m in package_modules() if not named(m, layered)]
    assert not missing, f"{', '.join(missing)} in no layer: {HOW_TO_FIX}"
    assert len(layered) == len(set(layered)), "a module is named on two layers"


def test_every_package_but_llama_is_kept_from_llama_cpp_and_the_core_from_typer():
    c = contracts()
    llama = c["Only specrun.llama imports llama_cpp"]["source_modules"]
    typer_free = c["The core never imports Typer or Rich"]["source_modules"]
    missing = [m for m in package_modules() if m != "specrun.llama" and not named(m, llama)]
    missing += [m for m in package_modules() if m not in FRONT_ENDS and not named(m, typer_free)]
    assert not missing, f"{', '.join(sorted(set(missing)))} not in a forbidden contract: {HOW_TO_FIX}"


def test_the_module_finder_sees_the_packages_and_the_modules():
    mods = package_modules()
    assert {"specrun.cli", "specrun.server", "specrun.decode", "specrun.llama", "specrun.errors"} <= set(mods)
    assert not any(m.count(".") > 1 or m.endswith("__init__") for m in mods)
    assert named("specrun.cli.generate", ["specrun.cli"]) and not named("specrun.clinic", ["specrun.cli"])


def test_every_command_module_is_independent_of_the_others():
    commands = contracts()["No command imports another"]["modules"]
    found = [f"specrun.cli.{p.stem}" for p in sorted((ROOT / "specrun/cli").glob("*.py")) if "\ndef register(" in p.read_text()]
    assert len(found) >= 13
    missing = [m for m in found if m not in commands]
    assert not missing, f"{', '.join(missing)} not in 'No command imports another': {HOW_TO_FIX}"


def test_the_architecture_page_shows_the_layers_of_the_contract():
    page = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```\n(.*?)^```", page, re.S | re.M)
    shown = [[m.strip() for m in re.split(r"[|:]", line)] for line in blocks[0].splitlines() if line.strip()]
    assert shown == layers(), "docs/architecture.md's layers differ from pyproject.toml's contract: copy them over"
    for m in package_modules():
        short = m.removeprefix("specrun.")
        assert f"`{short}.py`" in page or f"`{short}/`" in page, f"docs/architecture.md does not say what {m} holds"


# --- the house stays easy to walk ------------------------------------------------------------------

TOP_MODULES_MAX = 10  # modules at specrun/'s top: the rest live in the packages that name their concern
MODULE_LINES_MAX = 800  # a module past this holds more than one concern: split it


def test_few_modules_at_the_top_and_none_too_long():
    top = [p.name for p in (ROOT / "specrun").glob("*.py")]
    assert len(top) <= TOP_MODULES_MAX, f"{len(top)} modules at specrun/'s top ({', '.join(sorted(top))}): move them into a package"
    long = {
        str(p.relative_to(ROOT)): n for p in (ROOT / "specrun").rglob("*.py") if (n := len(p.read_text().splitlines())) > MODULE_LINES_MAX
    }
    assert not long, f"modules over {MODULE_LINES_MAX} lines: {long}; split them by concern"
