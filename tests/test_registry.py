"""models.toml: path expansion, aliases, default drafts, validation, layering, `specrun models`."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from specrun.cli.main import main
from specrun.errors import EXIT_FAIL, EXIT_INPUT, RegistryError, UnknownModel
from specrun.gguf.heads import named_beside
from specrun.models.registry import Registry, expand, packaged_registry_path, sha256_file, user_config_path


def write_toml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def entry(name: str, path: str, **extra: str | list[str]) -> str:
    lines = [f'[models."{name}"]', f"path = {json.dumps(path)}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n\n"


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specrun: error:"), err
    assert "Traceback" not in err
    return lines[0]


# --- path expansion ---------------------------------------------------------------------


def test_expand_tilde_vars_defaults_and_relative(tmp_path, monkeypatch):
    env = {"HOME": str(tmp_path / "home"), "M": "/models", "EMPTY": ""}
    monkeypatch.setenv("HOME", env["HOME"])
    base = tmp_path / "cfg"
    assert expand("~/a.gguf", base, env) == tmp_path / "home/a.gguf"
    assert expand("$M/a.gguf", base, env) == Path("/models/a.gguf")
    assert expand("${M}/a.gguf", base, env) == Path("/models/a.gguf")
    assert expand("${M:-/other}/a.gguf", base, env) == Path("/models/a.gguf")
    assert expand("${UNSET:-/other}/a.gguf", base, env) == Path("/other/a.gguf")
    assert expand("${EMPTY:-/other}/a.gguf", base, env) == Path("/other/a.gguf")  # as in sh: empty takes the default
    assert expand("${UNSET:-~/d}/a.gguf", base, env) == tmp_path / "home/d/a.gguf"  # a default may start with ~
    assert expand("models/a.gguf", base, env) == base / "models/a.gguf"
    assert expand("$UNSET/a.gguf", base, env) == base / "$UNSET/a.gguf"  # left as written, not emptied


def test_paths_resolve_against_the_toml_folder(tmp_path):
    f = write_toml(tmp_path / "conf/models.toml", entry("rel", "sub/m.gguf") + entry("abs", "/x/m.gguf"))
    reg = Registry.load(f)
    assert reg.get("rel").path == tmp_path / "conf/sub/m.gguf"
    assert reg.get("abs").path == Path("/x/m.gguf")


def test_paths_are_never_shell_evaluated(tmp_path, monkeypatch, capsys):
    marks = [tmp_path / f"mark{i}" for i in range(4)]
    monkeypatch.setenv("EVIL", f"$(touch {marks[3]})")
    text = (
        entry("dollar", f"$(touch {marks[0]})/m.gguf")
        + entry("backtick", f"`touch {marks[1]}`/m.gguf")
        + entry("braced", f"${{NOPE:-$(touch {marks[2]})}}/m.gguf")
        + entry("value", "$EVIL/m.gguf")
    )
    f = write_toml(tmp_path / "models.toml", text)
    reg = Registry.load(f)
    assert "$(touch" in str(reg.get("dollar").path)
    assert "`touch" in str(reg.get("backtick").path)
    assert str(reg.get("value").path).endswith(f"$(touch {marks[3]})/m.gguf")  # one pass: values are not re-expanded
    # the CLI reads the same paths (exists, stat, header) and still runs nothing
    assert main(["models", "--registry", str(f), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert rows["dollar"]["present"] is False
    assert main(["inspect", "backtick", "--registry", str(f)]) == EXIT_INPUT
    capsys.readouterr()
    assert not any(m.exists() for m in marks)


# --- names, aliases, default drafts -----------------------------------------------------


@pytest.mark.parametrize(
    "alias, name", [("70b", "llama-3.1-70b"), ("8b", "llama-3.1-8b"), ("70B", "llama-3.1-70b"), ("LLaMA-3.1-8B", "llama-3.1-8b")]
)
def test_packaged_aliases_case_insensitive(alias, name):
    r = Registry.load().resolve(alias)
    assert r.entry is not None and r.entry.name == name


def test_default_drafts():
    reg = Registry.load()
    assert reg.default_draft(reg.resolve("70b")).entry.name == "llama-3.1-8b"
    assert reg.default_draft(reg.resolve("8b")).entry.name == "llama-3.2-1b"
    assert reg.default_draft(reg.resolve("demo")).entry.name == "qwen-0.5b"
    assert reg.default_draft(reg.resolve("qwen-0.5b")) is None


BESIDE_SUFFIXES = ("-dflash", "-dspark")


def test_packaged_block_drafters_land_where_hybrid_looks(tmp_path, monkeypatch):
    """Each registered DFlash or DSpark drafter (``<target>-dflash``, ``<target>-dspark``) is
    pulled into its target's folder under a name the discovery beside the target lists, so hybrid
    finds it without -d."""
    monkeypatch.setenv("SPECRUN_MODELS_DIR", str(tmp_path))
    reg = Registry.load()
    drafters = [e for e in reg.entries.values() if e.name.endswith(BESIDE_SUFFIXES)]
    assert drafters
    for e in drafters:
        target = reg.resolve(e.name.rsplit("-", 1)[0])
        drafter = reg.resolve(e.name)
        for r in (target, drafter):
            r.path.parent.mkdir(parents=True, exist_ok=True)
            r.path.touch()
        assert drafter.path in named_beside(target.path), e.name
        assert e.hf is not None and e.hf.endswith("/" + drafter.path.name)


def test_packaged_paths_follow_specrun_models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_MODELS_DIR", str(tmp_path))
    assert Registry.load().resolve("70b").path == tmp_path / "Meta-Llama-3.1-70B-Instruct-Q4_K_M.gguf"
    monkeypatch.delenv("SPECRUN_MODELS_DIR")
    assert Registry.load().resolve("70b").path == Path.home() / ".cache/specrun/models/Meta-Llama-3.1-70B-Instruct-Q4_K_M.gguf"


def test_unknown_name_suggests_close_names():
    with pytest.raises(UnknownModel) as e:
        Registry.load().resolve("qwen-1.6b")
    assert "qwen-1.6b" in e.value.message and "qwen-1.5b" in e.value.fix
    with pytest.raises(UnknownModel) as e:
        Registry.load().resolve("zzzzzz")
    assert "specrun models" in e.value.fix


def test_a_gguf_path_works_where_a_name_is_expected(tiny, tmp_path, monkeypatch):
    reg = Registry.load()
    r = reg.resolve(str(tiny["target"]))
    assert r.entry is None and r.path == tiny["target"] and r.label == "target.gguf"
    monkeypatch.chdir(tiny["target"].parent)
    assert reg.resolve("target.gguf").path == tiny["target"]  # relative, no slash
    assert reg.resolve("missing.gguf").entry is None  # a path: read (and refused) later, not "unknown model"


# --- validation -------------------------------------------------------------------------


def test_unknown_key_is_named_with_its_line(tmp_path):
    f = write_toml(tmp_path / "m.toml", entry("b", "b.gguf") + entry("a", "a.gguf", notes="n", sha265="0" * 64))
    with pytest.raises(RegistryError) as e:
        Registry.load(f)
    assert f"{f}:7: [models.a]" in str(e.value) and "sha265" in str(e.value) and "sha256" in e.value.fix


def test_unknown_top_level_key(tmp_path):
    f = write_toml(tmp_path / "m.toml", 'model = "x"\n' + entry("a", "a.gguf"))
    with pytest.raises(RegistryError, match="model"):
        Registry.load(f)


def test_malformed_toml_names_the_line(tmp_path):
    f = write_toml(tmp_path / "m.toml", entry("a", "a.gguf") + '[models."b"]\npath = "b.gguf\n')
    with pytest.raises(RegistryError) as e:
        Registry.load(f)
    assert str(f) in str(e.value) and "line 5" in str(e.value)


@pytest.mark.parametrize(
    "bad, needle",
    [
        ('[models."a"]\naliases = ["x"]\n', "path"),
        ('[models."a"]\npath = 3\n', "path"),
        ('[models."a"]\npath = "a.gguf"\naliases = "x"\n', "aliases"),
        ('[models."a"]\npath = "a.gguf"\ndraft = 1\n', "draft"),
        ('[models."a"]\npath = "a.gguf"\nsha256 = "abc"\n', "sha256"),
        ("models = 3\n", "table"),
    ],
)
def test_invalid_values(tmp_path, bad, needle):
    with pytest.raises(RegistryError, match=needle):
        Registry.load(write_toml(tmp_path / "m.toml", bad))


def test_one_alias_on_two_entries_names_both(tmp_path):
    f = write_toml(tmp_path / "m.toml", entry("first", "a.gguf", aliases=["x"]) + entry("second", "b.gguf", aliases=["y", "x"]))
    with pytest.raises(RegistryError) as e:
        Registry.load(f)
    assert f"{f}:7:" in str(e.value)  # the second entry's aliases line
    assert "first" in str(e.value) and "second" in str(e.value) and "'x'" in str(e.value)


def test_alias_clash_is_case_insensitive(tmp_path):
    # lookups ignore case, so "X" and "x" on two entries would make one of them unreachable
    f = write_toml(tmp_path / "m.toml", entry("first", "a.gguf", aliases=["X"]) + entry("second", "b.gguf", aliases=["x"]))
    with pytest.raises(RegistryError, match="first.*second"):
        Registry.load(f)


def test_alias_equal_to_another_entrys_name(tmp_path):
    f = write_toml(tmp_path / "m.toml", entry("first", "a.gguf") + entry("second", "b.gguf", aliases=["first"]))
    with pytest.raises(RegistryError, match="first.*second"):
        Registry.load(f)


def test_dotted_unquoted_name_hints_to_quote(tmp_path):
    f = write_toml(tmp_path / "m.toml", '[models.llama-3.1-8b]\npath = "a.gguf"\n')
    with pytest.raises(RegistryError) as e:
        Registry.load(f)
    assert '[models."llama-3.1-8b"]' in e.value.fix


# --- layering and precedence -------------------------------------------------------------


def test_precedence_flag_over_env_over_user_config(tmp_path, monkeypatch):
    cfg = write_toml(user_config_path(), entry("mine", "/from/config.gguf"))
    assert user_config_path().is_relative_to(tmp_path)  # the autouse fixture isolates it
    env = write_toml(tmp_path / "env.toml", entry("mine", "/from/env.gguf"))
    flag = write_toml(tmp_path / "flag.toml", entry("mine", "/from/flag.gguf"))

    reg = Registry.load()
    assert reg.files == [packaged_registry_path(), cfg] and reg.get("mine").path == Path("/from/config.gguf")
    monkeypatch.setenv("SPECRUN_REGISTRY", str(env))
    reg = Registry.load()
    assert reg.files == [packaged_registry_path(), env] and reg.get("mine").path == Path("/from/env.gguf")
    reg = Registry.load(flag)
    assert reg.files == [packaged_registry_path(), flag] and reg.get("mine").path == Path("/from/flag.gguf")


def test_no_user_file_means_packaged_only():
    assert Registry.load().files == [packaged_registry_path()]


def test_env_registry_that_is_missing_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_REGISTRY", str(tmp_path / "nope.toml"))
    with pytest.raises(RegistryError, match="nope.toml"):
        Registry.load()


def test_user_entries_override_and_extend_packaged(tmp_path):
    f = write_toml(
        tmp_path / "m.toml",
        entry("qwen-1.5b", "/mine/q.gguf") + entry("tiny", "t.gguf", aliases=["demo"], draft="qwen-0.5b"),
    )
    reg = Registry.load(f)
    assert reg.get("qwen-1.5b").path == Path("/mine/q.gguf") and reg.get("qwen-1.5b").origin == f
    assert reg.get("qwen-1.5b").draft is None  # replaced as a whole, not merged
    assert reg.resolve("demo").entry.name == "tiny"  # a user alias shadows the packaged one
    assert reg.resolve("DEMO").entry.name == "tiny"
    assert reg.resolve("70b").entry.name == "llama-3.1-70b"  # packaged entries are still there
    assert reg.default_draft(reg.resolve("tiny")).entry.name == "qwen-0.5b"
    assert "demo" not in reg.get("qwen-0.5b").aliases + reg.get("llama-3.1-8b").aliases


def test_user_alias_shadows_packaged_alias_ignoring_case(tmp_path):
    f = write_toml(tmp_path / "m.toml", entry("tiny", "t.gguf", aliases=["DEMO", "8B"]))
    reg = Registry.load(f)
    assert reg.resolve("demo").entry.name == "tiny" and reg.resolve("8b").entry.name == "tiny"
    assert reg.get("qwen-1.5b").aliases == ["qwen2.5-coder-1.5b"]  # `specrun models` no longer lists "demo" twice
    assert "8b" not in reg.get("llama-3.1-8b").aliases
    assert reg.resolve("llama-3.1-8b").entry.name == "llama-3.1-8b"  # canonical names stay reachable


# --- `specrun models` -------------------------------------------------------------------


@pytest.fixture
def small_registry(tiny, tmp_path, monkeypatch) -> Path:
    """A user registry of tiny models; the packaged entries point at an empty folder, so no
    test hashes a gigabyte. Tables get a wide console so that no cell wraps."""
    monkeypatch.setenv("SPECRUN_MODELS_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("COLUMNS", "300")
    good = sha256_file(tiny["target"])
    return write_toml(
        tmp_path / "m.toml",
        entry("tiny-good", str(tiny["target"]), sha256=good, aliases=["tg"])
        + entry("tiny-bad", str(tiny["draft-copy"]), sha256="0" * 64)
        + entry("tiny-missing", "nowhere.gguf", source="make it"),
    )


def test_models_json_lists_present_and_missing(small_registry, tiny, capsys):
    assert main(["models", "--registry", str(small_registry), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["files"] == [str(packaged_registry_path()), str(small_registry)]
    rows = {r["name"]: r for r in out["models"]}
    good = rows["tiny-good"]
    assert good["present"] and good["size"] == tiny["target"].stat().st_size
    assert good["architecture"] == "llama" and good["quant"] == "ALL_F32" and good["aliases"] == ["tg"]
    missing = rows["tiny-missing"]
    assert not missing["present"] and missing["size"] is None and missing["source"] == "make it"
    assert not rows["llama-3.1-70b"]["present"] and rows["llama-3.1-70b"]["draft"] == "llama-3.1-8b"
    assert "verified" not in good  # hashing only with --verify


def test_models_table(small_registry, capsys):
    assert main(["models", "--registry", str(small_registry)]) == 0
    out = capsys.readouterr().out
    assert "tiny-good" in out and "present" in out and "missing" in out


def test_models_verify_reports_a_mismatch(small_registry, capsys):
    assert main(["models", "--registry", str(small_registry), "--verify", "--json"]) == EXIT_FAIL
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert rows["tiny-good"]["verified"] is True
    assert rows["tiny-bad"]["verified"] is False
    assert "verified" not in rows["tiny-missing"]
    assert main(["models", "--registry", str(small_registry), "--verify"]) == EXIT_FAIL
    assert "SHA256 MISMATCH" in capsys.readouterr().out


def test_models_verify_passes_when_all_match(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECRUN_MODELS_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("COLUMNS", "300")
    f = write_toml(tmp_path / "m.toml", entry("ok", str(tiny["target"]), sha256=sha256_file(tiny["target"]).upper()))
    assert main(["models", "--registry", str(f), "--verify"]) == 0
    assert "sha256 ok" in capsys.readouterr().out


def test_models_where(tmp_path, monkeypatch, capsys):
    assert main(["models", "--where"]) == 0
    assert capsys.readouterr().out.splitlines() == [str(packaged_registry_path())]
    f = write_toml(tmp_path / "env.toml", entry("x", "x.gguf"))
    monkeypatch.setenv("SPECRUN_REGISTRY", str(f))
    assert main(["models", "--where"]) == 0
    assert capsys.readouterr().out.splitlines() == [str(packaged_registry_path()), str(f)]


def test_models_with_an_invalid_registry_is_one_line_exit_3(tmp_path, capsys):
    f = write_toml(tmp_path / "bad.toml", entry("a", "a.gguf", colour="red"))
    assert main(["models", "--registry", str(f)]) == EXIT_INPUT
    line = one_line_error(capsys)
    assert "colour" in line and str(f) in line
