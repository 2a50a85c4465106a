"""The model stores people already have: Ollama, LM Studio and Hugging Face caches laid out on
disk as those tools lay them out (tests/store_layouts.py), with the tiny generated models;
references to them through check-pair, generate, drafts and models --scan; the broken cases
(one line, exit 3); and `specrun pull` against a Hub served on 127.0.0.1 (tests/fake_hub.py),
so that huggingface_hub does the real listing, HEAD, download and resume."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from fake_hub import FakeHub
from store_layouts import hf_cache, lmstudio_store, ollama_manifest_path, ollama_store, sha256_of
from tiny_models import variants, write_model

from specrun.cli.main import main
from specrun.errors import EXIT_FAIL, EXIT_INPUT, EXIT_USAGE, UnknownModel
from specrun.gguf.facts import model_info
from specrun.gguf.vocabulary import check_vocab
from specrun.models.catalog import Catalog, Known, Summary, SummaryCache, summarize
from specrun.models.discovery import find_drafts
from specrun.models.registry import Registry
from specrun.models.stores import Ref, group_models, parse_ref, pick_model, resolve_ref, roots_from_env

SPECRUN = Path(sys.executable).parent / "specrun"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    """The single `specrun: error:` line, and no traceback."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("specrun: error:")]
    assert len(lines) == 1, err
    return lines[0]


def run_json(argv: list[str], capsys, code: int = 0) -> dict:
    got, out, err = run([*argv, "--json"], capsys)
    assert got == code, err
    return json.loads(out)


# --- references, roots and choosing a file: pure functions -------------------------------


def test_parse_references():
    assert parse_ref("ollama:llama3.1") == Ref("ollama", "registry.ollama.ai/library/llama3.1", tag="latest")
    assert parse_ref("ollama:llama3.1:70b") == Ref("ollama", "registry.ollama.ai/library/llama3.1", tag="70b")
    assert parse_ref("ollama:me/mine:q8") == Ref("ollama", "registry.ollama.ai/me/mine", tag="q8")
    assert parse_ref("ollama:hf.co/org/repo-GGUF:Q4_K_M") == Ref("ollama", "hf.co/org/repo-GGUF", tag="Q4_K_M")
    assert str(parse_ref("ollama:llama3.1")) == "ollama:llama3.1:latest"
    assert parse_ref("hf:org/repo") == Ref("hf", "org/repo")
    assert parse_ref("hf:org/repo:Q4_K_M") == Ref("hf", "org/repo", quant="Q4_K_M")
    assert parse_ref("hf:org/repo/sub/m.gguf") == Ref("hf", "org/repo", file="sub/m.gguf")
    assert parse_ref("lmstudio:pub/repo/m.gguf") == Ref("lmstudio", "pub/repo", file="m.gguf")
    for bad in (
        "ollama:",
        "ollama:a/b/c/d",
        "ollama:../x",
        "hf:org",
        "hf:org/../x",
        "hf:org/repo/m.bin",
        "hf:org/repo/x.gguf:Q4",
        "hf:org/repo:",
        "zzz:a",
    ):
        with pytest.raises(UnknownModel):
            parse_ref(bad)


def test_roots_from_env(tmp_path):
    home = tmp_path / "home"
    r = roots_from_env({}, home)
    assert r.ollama[0] == home / ".ollama/models" and r.lmstudio[0] == home / ".lmstudio/models"
    assert r.hf_hub == (home / ".cache/huggingface/hub",) and r.llama_cache[0].name == "llama.cpp"
    assert r.cache_dir == home / ".cache/specrun"
    r = roots_from_env(
        {"OLLAMA_MODELS": "/o", "HF_HOME": "/h", "LMSTUDIO_MODELS": "~/lm", "LLAMA_CACHE": "/l", "HF_ENDPOINT": "http://127.0.0.1:1"}, home
    )
    assert r.ollama == (Path("/o"),) and r.hf_hub == (Path("/h/hub"),) and r.lmstudio == (home / "lm",)
    assert r.llama_cache == (Path("/l"),) and r.hf_endpoint == "http://127.0.0.1:1"
    assert roots_from_env({"HF_HOME": "/h", "HF_HUB_CACHE": "/c"}, home).hf_hub == (Path("/c"),)  # as huggingface_hub


def test_pick_model_rules():
    names = [
        "m-Q4_K_M.gguf",
        "m-IQ4_XS.gguf",
        "m-Q8_0.gguf",
        "mmproj-m-f16.gguf",
        "README.md",
        "Q2_K/m-Q2_K-00001-of-00002.gguf",
        "Q2_K/m-Q2_K-00002-of-00002.gguf",
    ]
    assert pick_model(names, parse_ref("hf:o/r"), "r") == ["m-Q4_K_M.gguf"]  # llama.cpp's default
    assert pick_model(names, parse_ref("hf:o/r:q8_0"), "r") == ["m-Q8_0.gguf"]  # case-insensitive
    assert pick_model(names, parse_ref("hf:o/r:Q2_K"), "r") == names[5:]  # every part, in order
    assert pick_model(names, parse_ref("hf:o/r/Q2_K/m-Q2_K-00002-of-00002.gguf"), "r") == names[5:]
    with pytest.raises(UnknownModel, match="no XS GGUF"):
        pick_model(names, parse_ref("hf:o/r:XS"), "r")  # IQ4_XS does not match XS
    with pytest.raises(UnknownModel, match=r"holds 2 GGUF models; name one: hf:o/r/m-A.gguf, hf:o/r/m-B.gguf"):
        pick_model(["m-A.gguf", "m-B.gguf", "mmproj.gguf"], parse_ref("hf:o/r"), "r")
    assert group_models(["a-00002-of-00002.gguf"]) == {"a-00001-of-00002.gguf": ["a-00001-of-00002.gguf", "a-00002-of-00002.gguf"]}


# --- stores on disk ----------------------------------------------------------------------


@pytest.fixture
def stores(tmp_path, tiny, monkeypatch):
    """An Ollama store, an LM Studio folder and a Hugging Face cache holding the tiny models,
    and an empty models folder, so the packaged registry's demo entries are missing."""
    root = tmp_path / "stores"
    ollama_store(
        root / "ollama",
        {"tiny": tiny["target"], "tiny:small": tiny["draft-small"], "other:1b": tiny["other-family"]},
        projector=tiny["other-family"],
    )
    lmstudio_store(
        root / "lmstudio",
        {
            "pub/tiny-GGUF/tiny-small-F32.gguf": tiny["draft-small"],  # the same file as ollama:tiny:small (a hard link)
            "pub/tiny-GGUF/mmproj-tiny-F16.gguf": tiny["other-family"],
            "pub/changed-GGUF/changed-F32.gguf": tiny["vocab-changed"],
        },
    )
    hf_cache(root / "hf", {"org/tiny-GGUF": {"tiny-Q4_K_M.gguf": tiny["draft-copy"], "tiny-Q8_0.gguf": tiny["draft-perturbed"]}})
    env = {
        "OLLAMA_MODELS": root / "ollama",
        "LMSTUDIO_MODELS": root / "lmstudio",
        "HF_HUB_CACHE": root / "hf",
        "LLAMA_CACHE": root / "llama.cpp",
        "SPECRUN_MODELS_DIR": tmp_path / "no-models",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.delenv("HF_HOME", raising=False)
    return root


def test_references_resolve_to_the_stored_files(stores, tiny):
    roots = roots_from_env()
    assert resolve_ref("ollama:tiny", roots).read_bytes() == tiny["target"].read_bytes()
    assert resolve_ref("ollama:TINY:Small", roots).samefile(tiny["draft-small"])  # Ollama ignores case
    assert resolve_ref("lmstudio:pub/tiny-GGUF", roots).samefile(tiny["draft-small"])  # the projector is not a model
    assert resolve_ref("hf:org/tiny-GGUF", roots).samefile(tiny["draft-copy"])  # Q4_K_M by default
    p = resolve_ref("hf:org/tiny-GGUF:Q8_0", roots)
    assert p.samefile(tiny["draft-perturbed"]) and f"snapshots/{COMMIT}/tiny-Q8_0.gguf" in str(p)


def test_check_pair_on_store_references(stores, capsys):
    for target, draft in (("ollama:tiny", "lmstudio:pub/tiny-GGUF/tiny-small-F32.gguf"), ("hf:org/tiny-GGUF:Q8_0", "ollama:tiny:small")):
        r = run_json(["check-pair", "-m", target, "-d", draft], capsys)
        assert r["compatible"] and r["ok"]
    r = run_json(["check-pair", "-m", "ollama:tiny", "-d", "lmstudio:pub/changed-GGUF"], capsys, code=EXIT_FAIL)
    assert not r["compatible"] and "token texts" in {c["name"] for c in r["vocab"] if not c["ok"]}


def test_check_pair_through_the_real_binary(stores):
    p = subprocess.run(
        [str(SPECRUN), "check-pair", "-m", "ollama:tiny", "-d", "hf:org/tiny-GGUF"], capture_output=True, text=True, timeout=60, check=False
    )
    assert p.returncode == 0, p.stderr
    assert "OK: the pair is compatible and fits." in p.stdout


def test_generate_on_store_references_matches_the_plain_files(stores, tiny, capsys):
    def text(model: str, draft: str) -> str:
        r = run_json(["generate", "-m", model, "-d", draft, "-t", "1", "-n", "12", "-p", "The quick brown fox"], capsys)
        return r["text"]

    by_ref = text("ollama:tiny", "hf:org/tiny-GGUF:Q8_0")
    assert by_ref == text(str(tiny["target"]), str(tiny["draft-perturbed"]))
    assert len(by_ref) > 0


def test_registry_entries_may_point_into_stores(stores, tmp_path, capsys):
    reg = tmp_path / "models.toml"
    reg.write_text(
        '[models.mine]\npath = "ollama:tiny"\ndraft = "small"\n[models.small]\npath = "lmstudio:pub/tiny-GGUF"\n'
        '[models.gone]\npath = "ollama:not-pulled:7b"\n',
        encoding="utf-8",
    )
    r = run_json(["check-pair", "-m", "mine", "-d", "small", "--registry", str(reg)], capsys)
    assert r["ok"]
    rows = {m["name"]: m for m in run_json(["models", "--registry", str(reg)], capsys)["models"]}
    assert rows["mine"]["present"] and rows["mine"]["path"] == "ollama:tiny" and "sha256-" in rows["mine"]["file"]
    assert not rows["gone"]["present"] and "error" not in rows["gone"]
    code, _, err = run(["inspect", "gone", "--registry", str(reg)], capsys)
    assert code == EXIT_INPUT and "ollama pull not-pulled:7b" in one_line(err)


def test_bad_reference_in_the_registry_names_the_line(tmp_path, capsys):
    reg = tmp_path / "models.toml"
    reg.write_text('[models.a]\npath = "/x.gguf"\n\n[models.b]\npath = "hf:org/../x"\n', encoding="utf-8")
    code, _, err = run(["models", "--registry", str(reg)], capsys)
    assert code == EXIT_INPUT and f"{reg}:5" in one_line(err)


# --- drafts and the scan ------------------------------------------------------------------


def test_drafts_lists_the_smaller_compatible_file_and_explains_the_rest(stores, tiny, capsys):
    r = run_json(["drafts", "ollama:tiny"], capsys)
    (draft,) = r["drafts"]
    assert set(draft["refs"]) == {"ollama:tiny:small", "lmstudio:pub/tiny-GGUF/tiny-small-F32.gguf"}  # one file, two names
    assert 0 < draft["size_ratio"] < 1 and draft["memory_bytes"] > draft["weights_bytes"]
    why = {c["refs"][0]: c["reason"] for c in r["cannot_draft"]}
    assert "not smaller than the target" in why["hf:org/tiny-GGUF/tiny-Q4_K_M.gguf"]  # draft-copy: same size
    # the near miss is named exactly as check-pair names it from the full headers
    direct = check_vocab(model_info(tiny["target"]), model_info(tiny["vocab-changed"])).failures[0]
    assert why["lmstudio:pub/changed-GGUF/changed-F32.gguf"] == f"token texts: {direct.detail}"
    assert why["ollama:other:1b"].startswith("tokenizer model: target uses 'gpt2', draft uses 'llama'")
    assert all("mmproj" not in ref for c in r["cannot_draft"] + r["drafts"] for ref in c["refs"])
    # check-pair without -d gives the same report
    assert run_json(["check-pair", "-m", "ollama:tiny"], capsys)["drafts"] == r["drafts"]


def test_drafts_reads_each_header_once_then_only_changed_files(stores, tiny, capsys):
    first = run_json(["drafts", "ollama:tiny"], capsys)
    assert first["headers_read"] >= 6
    assert run_json(["drafts", "ollama:tiny"], capsys)["headers_read"] == 0
    changed = stores / "lmstudio/pub/changed-GGUF/changed-F32.gguf"
    data = changed.read_bytes()
    changed.unlink()  # a hard link to the shared fixture: replace it rather than touch it
    changed.write_bytes(data)
    st = changed.stat()
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same size, new mtime: read again
    again = run_json(["drafts", "ollama:tiny"], capsys)
    assert again["headers_read"] == 1  # its summary; the near-miss detail is cached by text hashes
    assert again["cannot_draft"] == first["cannot_draft"]


def test_drafts_ranks_same_family_then_smallest(tmp_path, tiny):
    real = summarize(model_info(tiny["target"]))  # one vocabulary for all: every rule passes

    def summary(name: str, arch: str, weights: int) -> Summary:
        return replace(real, path=tmp_path / name, architecture=arch, name=name, weights_bytes=weights, file_size=weights)

    target = summary("target", "qwen2", 10_000)
    models = [
        Known([s.name], ["registry"], s.path, summary=s)
        for s in (
            summary("other-arch-tiny", "llama", 100),
            summary("same-big", "qwen2", 5_000),
            summary("same-small", "qwen2", 1_000),
            summary("too-big", "qwen2", 20_000),
        )
    ]
    cache = SummaryCache(None)
    cache._entries = {}
    cache.get = lambda p: target if p == target.path else next(k.summary for k in models if k.path == p)  # type: ignore[method-assign]
    r = find_drafts(target.path, "target", Catalog(models), cache)
    assert [c.known.label for c in r.drafts] == ["same-small", "same-big", "other-arch-tiny"]
    assert [c.known.label for c in r.cannot] == ["too-big"]


def test_scan_lists_every_store_with_fingerprints(stores, tiny, capsys):
    r = run_json(["models", "--scan"], capsys)
    rows = {ref: m for m in r["models"] for ref in m["refs"]}
    assert {
        "ollama:tiny:latest",
        "ollama:tiny:small",
        "ollama:other:1b",
        "lmstudio:pub/tiny-GGUF/tiny-small-F32.gguf",
        "lmstudio:pub/changed-GGUF/changed-F32.gguf",
        "hf:org/tiny-GGUF/tiny-Q4_K_M.gguf",
        "hf:org/tiny-GGUF/tiny-Q8_0.gguf",
    } <= set(rows)
    assert len(r["models"]) == 6  # the hard-linked draft-small is one row with two names
    fp = {ref: m["fingerprint"] for ref, m in rows.items()}
    assert fp["ollama:tiny:latest"] == fp["hf:org/tiny-GGUF/tiny-Q8_0.gguf"] == fp["ollama:tiny:small"]  # one vocabulary
    assert fp["lmstudio:pub/changed-GGUF/changed-F32.gguf"] != fp["ollama:tiny:latest"]
    assert rows["ollama:tiny:latest"]["size"] == tiny["target"].stat().st_size and rows["ollama:other:1b"]["tokenizer"] == "llama"
    assert not any("mmproj" in ref for ref in rows)


def test_a_split_model_in_the_hf_cache_loads_and_counts_all_parts(stores, tiny, tmp_path, capsys):
    vocab, weights = variants()["target"]
    first = write_model(tmp_path / "split/tiny-F32.gguf", vocab=vocab, weights=weights, name="tiny-split", split_max_tensors=8)
    parts = sorted(first.parent.glob("tiny-F32-*.gguf"))
    assert len(parts) == 3
    hf_cache(stores / "hf", {"org/split-GGUF": {f"F32/{p.name}": p for p in parts}})
    plain = run_json(["generate", "-m", str(tiny["target"]), "-t", "1", "-n", "10", "-p", "def hello"], capsys)
    split = run_json(["generate", "-m", "hf:org/split-GGUF:F32", "-t", "1", "-n", "10", "-p", "def hello"], capsys)
    assert split["text"] == plain["text"]
    (row,) = [
        m for m in run_json(["models", "--scan"], capsys)["models"] if m["refs"] == ["hf:org/split-GGUF/F32/tiny-F32-00001-of-00003.gguf"]
    ]
    assert row["parts"] == 3 and row["size"] == sum(p.stat().st_size for p in parts)
    assert row["n_params"] == model_info(tiny["target"]).n_params
    # a missing part is named
    (stores / "hf/models--org--split-GGUF/snapshots" / COMMIT / "F32" / parts[2].name).unlink()
    code, _, err = run(["inspect", "hf:org/split-GGUF:F32"], capsys)
    assert code == EXIT_INPUT and "tiny-F32-00003-of-00003.gguf is missing" in one_line(err)


# --- broken stores: one line, exit 3 -----------------------------------------------------


def manifest(stores: Path, name: str) -> Path:
    return ollama_manifest_path(stores / "ollama", name)


def model_blob(stores: Path, name: str) -> Path:
    layer = next(la for la in json.loads(manifest(stores, name).read_text())["layers"] if la["mediaType"].endswith(".model"))
    return stores / "ollama/blobs" / layer["digest"].replace(":", "-")


def break_dangling_blob(stores: Path) -> str:
    model_blob(stores, "tiny").unlink()
    return "missing (a dangling blob)"


def break_malformed_manifest(stores: Path) -> str:
    manifest(stores, "tiny").write_text('{"schemaVersion": 2, "layers": [', encoding="utf-8")
    return "is malformed"


def break_model_layer(stores: Path) -> str:
    m = json.loads(manifest(stores, "tiny").read_text())
    m["layers"] = [la for la in m["layers"] if not la["mediaType"].endswith(".model")]
    manifest(stores, "tiny").write_text(json.dumps(m), encoding="utf-8")
    return "has no GGUF model layer (layers: application/vnd.ollama.image.template"


def break_digest(stores: Path) -> str:
    m = json.loads(manifest(stores, "tiny").read_text())
    m["layers"][0]["digest"] = "sha256:../../etc/passwd"
    manifest(stores, "tiny").write_text(json.dumps(m), encoding="utf-8")
    return "is not sha256:<64 hex>"


def break_blob_size(stores: Path) -> str:
    blob = model_blob(stores, "tiny")
    data = blob.read_bytes()
    blob.unlink()  # a hard link: write a new file rather than truncating the shared one
    blob.write_bytes(data[:1000])
    return "has 1000 bytes, the manifest says"


def break_not_json(stores: Path) -> str:
    manifest(stores, "tiny").write_bytes(b"\xff\xfe not json")
    return "is malformed"


@pytest.mark.parametrize(
    "breaker", [break_dangling_blob, break_malformed_manifest, break_model_layer, break_digest, break_blob_size, break_not_json]
)
def test_broken_ollama_store_is_one_line_exit_3(stores, breaker, capsys):
    needle = breaker(stores)
    for argv in (
        ["check-pair", "-m", "ollama:tiny", "-d", "ollama:tiny:small"],
        ["generate", "-m", "ollama:tiny", "-t", "1", "-n", "2", "-p", "x"],
    ):
        code, out, err = run(argv, capsys)
        assert code == EXIT_INPUT, err
        assert needle in one_line(err) and out == ""
    # the scan goes on and shows the broken entry
    rows = {m["refs"][0]: m for m in run_json(["models", "--scan"], capsys)["models"]}
    assert needle in rows["ollama:tiny:latest"]["error"] and rows["ollama:tiny:small"]["error"] is None


def snapshot(stores: Path, name: str) -> Path:
    return stores / "hf/models--org--tiny-GGUF/snapshots" / COMMIT / name


def test_hf_cache_symlink_loop_is_one_line_exit_3(stores, capsys):
    a, b = snapshot(stores, "tiny-Q4_K_M.gguf"), snapshot(stores, "loop-b.gguf")
    a.unlink()
    a.symlink_to("loop-b.gguf")
    b.symlink_to("tiny-Q4_K_M.gguf")
    code, _, err = run(["check-pair", "-m", "ollama:tiny", "-d", "hf:org/tiny-GGUF:Q4_K_M"], capsys)
    assert code == EXIT_INPUT and "is a symlink loop" in one_line(err)
    rows = {ref: m for m in run_json(["models", "--scan"], capsys)["models"] for ref in m["refs"]}
    assert "symlink loop" in rows["hf:org/tiny-GGUF/tiny-Q4_K_M.gguf"]["error"]


def test_hf_cache_snapshot_folder_loop_and_dangling_link(stores, capsys):
    snap = snapshot(stores, "")
    (snap / "tiny-Q8_0.gguf").unlink()
    (snap / "tiny-Q8_0.gguf").symlink_to("../../blobs/" + "0" * 64)  # an interrupted download
    code, _, err = run(["inspect", "hf:org/tiny-GGUF:Q8_0"], capsys)
    assert code == EXIT_INPUT and "a dangling link" in one_line(err)
    (snap / "sub").symlink_to(".")  # a folder link to itself: the walk must not follow it
    assert run_json(["models", "--scan"], capsys)["models"]
    repo = stores / "hf/models--org--tiny-GGUF"
    (repo / "refs/main").write_text("../../../etc/passwd")
    code, _, err = run(["inspect", "hf:org/tiny-GGUF"], capsys)
    assert code == EXIT_INPUT and "does not hold a commit hash" in one_line(err)


def test_unknown_references_say_how_to_get_them(stores, capsys):
    for ref, fix in (
        ("ollama:llama3.1:70b", "ollama pull llama3.1:70b"),
        ("hf:org/none-GGUF:Q4_K_M", "specrun pull hf:org/none-GGUF:Q4_K_M"),
        ("lmstudio:pub/none", "download it in LM Studio"),
        ("hf:org/tiny-GGUF:Q2_K", "name one: hf:org/tiny-GGUF/tiny-Q4_K_M.gguf"),
    ):
        code, _, err = run(["inspect", ref], capsys)
        assert code == EXIT_INPUT and fix in one_line(err)


def test_a_missing_packaged_model_names_its_pull_command(stores, capsys):
    code, _, err = run(["check-pair", "-m", "70b", "-d", "8b"], capsys)
    assert code == EXIT_INPUT and "get it with: specrun pull llama-3.1-70b" in one_line(err)
    reg = Registry.load()
    assert {reg.get(n).hf is not None for n in ("70b", "8b", "1b", "32b", "coder-32b", "mistral-large", "27b")} == {True}


# --- specrun pull against a Hub on 127.0.0.1 ----------------------------------------------


@pytest.fixture
def hub(tiny, monkeypatch, stores):
    files = {"tiny-Q4_K_M.gguf": tiny["target"].read_bytes(), "tiny-Q8_0.gguf": tiny["draft-small"].read_bytes()}
    h = FakeHub({"org/tiny-GGUF": files, "org/big": {}, "org/split-GGUF": {}}).start()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(stores / "pulled-hf"))
    yield h
    h.stop()


def gets(hub: FakeHub, name: str) -> list[str | None]:
    return [rng for method, path, rng in hub.requests if method == "GET" and path.endswith("/" + name)]


def test_pull_an_hf_reference_into_the_cache_then_use_it(hub, tiny, capsys):
    code, out, err = run(["pull", "hf:org/tiny-GGUF:Q4_K_M"], capsys)
    assert code == 0, err
    assert "downloaded and verified" in out and len(gets(hub, "tiny-Q4_K_M.gguf")) == 1
    assert resolve_ref("hf:org/tiny-GGUF:Q4_K_M", roots_from_env()).read_bytes() == tiny["target"].read_bytes()
    assert run_json(["check-pair", "-m", "hf:org/tiny-GGUF:Q4_K_M", "-d", "ollama:tiny:small"], capsys)["ok"]
    code, out, _ = run(["pull", "hf:org/tiny-GGUF:Q4_K_M"], capsys)
    assert code == 0 and "already present" in out and len(gets(hub, "tiny-Q4_K_M.gguf")) == 1


def test_pull_resumes_after_the_server_drops_the_connection(hub, tmp_path, capsys):
    data = random.Random(5).randbytes(12 << 20)  # over huggingface_hub's 10 MiB chunk, so a chunk lands before the drop
    hub.repos["org/big"] = {"big-Q4_K_M.gguf": data}
    hub.drop_once["big-Q4_K_M.gguf"] = (10 << 20) + 12345
    reg = tmp_path / "models.toml"
    reg.write_text(
        f'[models.big]\npath = "{tmp_path}/models/big.gguf"\nhf = "org/big:Q4_K_M"\nsha256 = "{hashlib.sha256(data).hexdigest()}"\n'
    )
    code, _, err = run(["pull", "big", "--registry", str(reg)], capsys)
    assert code == 0, err
    assert (tmp_path / "models/big.gguf").read_bytes() == data
    ranges = gets(hub, "big-Q4_K_M.gguf")
    assert ranges[0] is None and len(ranges) == 2 and ranges[1] == f"bytes={10 << 20}-"  # the second GET resumed
    assert not (tmp_path / "models/.specrun-pull").exists()


def test_pull_a_split_model_to_its_registry_path(hub, tmp_path, capsys):
    vocab, weights = variants()["target"]
    first = write_model(tmp_path / "src/tiny-F32.gguf", vocab=vocab, weights=weights, name="tiny-split", split_max_tensors=8)
    parts = sorted(first.parent.glob("tiny-F32-*.gguf"))
    hub.repos["org/split-GGUF"] = {f"F32/{p.name}": p.read_bytes() for p in parts}
    reg = tmp_path / "models.toml"
    reg.write_text('[models.split]\npath = "models/tiny-split.gguf"\nhf = "org/split-GGUF:F32"\n')
    code, _, err = run(["pull", "split", "--registry", str(reg)], capsys)
    assert code == 0, err
    got = sorted((tmp_path / "models").glob("*.gguf"))
    assert [p.name for p in got] == [f"tiny-split-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert [sha256_of(p) for p in got] == [sha256_of(p) for p in parts]
    # the entry's path names the split model: inspect and check-pair find its first part
    assert run_json(["inspect", "split", "--registry", str(reg)], capsys)["path"].endswith("tiny-split-00001-of-00003.gguf")
    assert run_json(["check-pair", "-m", "split", "-d", "ollama:tiny:small", "--registry", str(reg)], capsys)["ok"]


def test_pull_wrong_checksum_removes_the_file_and_fails(hub, tmp_path, capsys):
    hub.lie_sha256["tiny-Q8_0.gguf"] = "ab" * 32  # the Hub promises other bytes than it serves
    code, out, err = run(["pull", "hf:org/tiny-GGUF:Q8_0"], capsys)
    assert code == EXIT_FAIL and "sha256 mismatch" in one_line(err) and out == ""
    cache = Path(os.environ["HF_HUB_CACHE"]) / "models--org--tiny-GGUF"
    assert not list(cache.glob("blobs/*")) and not list(cache.glob("snapshots/*/*.gguf"))
    reg = tmp_path / "models.toml"
    reg.write_text(f'[models.t]\npath = "{tmp_path}/m/t.gguf"\nhf = "org/tiny-GGUF/tiny-Q8_0.gguf"\n')
    code, _, err = run(["pull", "t", "--registry", str(reg)], capsys)
    assert code == EXIT_FAIL and "sha256 mismatch" in one_line(err)
    assert not (tmp_path / "m").exists() or not list((tmp_path / "m").rglob("*.gguf"))
    # a registry sha256 that disagrees with the Hub stops before any download
    n = len(gets(hub, "tiny-Q4_K_M.gguf"))
    reg.write_text(f'[models.t]\npath = "{tmp_path}/m/t.gguf"\nhf = "org/tiny-GGUF:Q4_K_M"\nsha256 = "{"0" * 64}"\n')
    code, _, err = run(["pull", "t", "--registry", str(reg)], capsys)
    assert code == EXIT_FAIL and "differs from the Hub's" in one_line(err) and len(gets(hub, "tiny-Q4_K_M.gguf")) == n


def test_pull_errors(hub, capsys):
    for argv, code, needle in (
        (["pull", "hf:org/missing"], EXIT_INPUT, "was not found on the Hub"),
        (["pull", "ollama:tiny"], EXIT_USAGE, "specrun pulls only registry entries and hf: references"),
        (["pull", "qwen-1.5b"], EXIT_USAGE, "has no hf reference"),
        (["pull", "hf:org/tiny-GGUF:Q2_K"], EXIT_INPUT, "no Q2_K GGUF in org/tiny-GGUF on the Hub"),
    ):
        got, _, err = run(argv, capsys)
        assert got == code, err
        assert needle in one_line(err)
