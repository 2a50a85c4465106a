"""check-pair's rules on the tiny variants, and the memory estimate against llama.cpp."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace

import pytest

from specrun.cli.main import main
from specrun.errors import EXIT_FAIL
from specrun.fit.memory import Gpu, GpuQuery, check_fit, estimate, host_device
from specrun.gguf.facts import model_info
from specrun.gguf.vocabulary import check_vocab
from specrun.llama import LoadOptions, Model
from specrun.run.pair import check_pair

GiB = 2**30


def failed(t, d) -> set[str]:
    return {c.name for c in check_vocab(model_info(t), model_info(d)).failures}


@pytest.mark.parametrize("variant", ["draft-copy", "draft-perturbed", "draft-unrelated", "draft-small", "vocab-plus100"])
def test_compatible_variants(tiny, variant):
    assert failed(tiny["target"], tiny[variant]) == set()


def test_one_changed_token_text_is_named(tiny):
    r = check_vocab(model_info(tiny["target"]), model_info(tiny["vocab-changed"]))
    assert not r.compatible
    (c,) = r.failures
    assert c.name == "token texts"
    m = re.search(r"id (\d+): '(.*?)' vs '(.*?)'", c.detail)
    assert m and int(m.group(1)) > 5 and m.group(2) != m.group(3)


def test_eos_change_and_other_family(tiny):
    assert failed(tiny["target"], tiny["eos-changed"]) == {"EOS id"}
    other = failed(tiny["target"], tiny["other-family"])
    assert "tokenizer model" in other and "token texts" in other


def test_vocab_size_rule_is_128(tiny):
    t = model_info(tiny["target"])
    d = model_info(tiny["vocab-plus100"])
    assert d.n_vocab - t.n_vocab == 100
    # the same rule with 129 extra tokens fails: simulate by trimming the target's list
    n = d.n_vocab - 129
    t = replace(t, tokens=list(t.tokens)[:n], n_vocab=n)
    assert "vocab size" in {c.name for c in check_vocab(t, d).failures}


def test_kv_estimate_matches_llama_cpp(tiny):
    n_ctx = 1024
    m = model_info(tiny["target"])
    with Model(tiny["target"], LoadOptions(n_ctx=n_ctx, n_threads=2)) as model:
        log = "".join(model.load_log)
    size = re.search(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells", log)
    assert size, log[-2000:]
    reported = float(size.group(1)) * 2**20
    cells = size
    ours = m.kv_bytes(int(cells.group(2)))
    assert int(cells.group(2)) == n_ctx
    assert abs(ours - reported) <= 0.01 * 2**20  # llama.cpp prints MiB with 2 decimals


def test_fit_against_fake_gpus(tiny):
    m = model_info(tiny["target"])
    one = check_pair(m, m, gpu_query=GpuQuery([], problem="none"), available_ram=64 * GiB)
    need = sum(x.total for x in one.fit.models)  # everything, when it all sits in RAM
    two = GpuQuery([Gpu(0, "RTX 4090", 24 * GiB, need // 2 + GiB), Gpu(1, "RTX 4090", 24 * GiB, need // 2 + GiB)], driver="555.0")
    r = check_pair(m, m, gpu_query=two, available_ram=64 * GiB)
    assert r.fit.fits and "2 NVIDIA GPUs, driver 555.0" in r.fit.note
    on = {s.device.name: s for s in r.fit.shares}
    assert set(on) == {"CUDA0", "CUDA1", "CPU"} and on["CUDA0"].need > 0
    # the target has a GPU's layers, the draft another's whole (the target leaves it the room)
    assert r.placement.draft.devices in (("CUDA0",), ("CUDA1",))
    small = GpuQuery([Gpu(0, "tiny", GiB, need // 4)], driver="555.0")
    assert not check_pair(m, m, gpu_query=small, available_ram=64 * GiB).fit.fits
    # partial offload moves the rest to RAM
    part = estimate(m, "target", 4096, 1, ("CUDA0",), (1.0,))
    assert 0 < part.on_devices < part.total and part.on_host > 0


def test_no_gpu_checks_system_ram(tiny):
    m = model_info(tiny["target"])
    mems = [estimate(m, "target", 4096, -1)]
    fit = check_fit(mems, [host_device(8 * GiB)])
    assert fit.fits and [s.device.name for s in fit.shares] == ["CPU"]
    assert not check_fit(mems, [host_device(1024)]).fits
    r = check_pair(m, m, gpu_query=GpuQuery([], problem="no NVIDIA driver"), available_ram=8 * GiB)
    assert r.fit.fits and "system RAM" in r.fit.note and r.placement.target.devices == ()


def test_check_pair_suggests_matching_drafts(tiny, tmp_path):
    """An incompatible pair names the known files that could draft instead, found as `specrun
    drafts` finds them (one finder)."""
    reg = tmp_path / "models.toml"
    reg.write_text(f'[models.small]\npath = "{tiny["draft-small"]}"\n[models.other]\npath = "{tiny["other-family"]}"\n')
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["check-pair", "-m", str(tiny["target"]), "-d", "other", "--registry", str(reg), "--json"])
    r = json.loads(out.getvalue())
    assert code == EXIT_FAIL and r["compatible"] is False, err.getvalue()
    assert r["suggested_drafts"] == ["small"]
