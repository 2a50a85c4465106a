"""Hybrid and recurrent models on the real llama.cpp: speculation is exact on every rollback
method (state snapshots, checkpoints, the attention cache), in every pairing, and check-pair
knows the architecture and its memory from the header.

The models are tests/tiny_hybrid.py's: qwen35 and lfm2 (snapshots) and granitehybrid (no
snapshots: checkpoints), all on tiny_models' vocabulary, so the tiny llama models pair with them.
"""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest
from gguf import GGUFWriter
from tiny_hybrid import N_LAYER, RECURRENT, STATE_BYTES, build_hybrid
from tiny_models import N_EMBD, N_HEAD_KV, add_vocab, bpe_vocab

from specrun.cli.main import main
from specrun.decode.costs import CostModel
from specrun.decode.engine import DRAFT_MAX_ADAPTIVE, Engine, Settings
from specrun.decode.learned import Learned
from specrun.decode.sampling import Sampler
from specrun.errors import EXIT_FAIL
from specrun.fit.memory import GpuQuery, estimate
from specrun.gguf.architecture import CHECKPOINTS_KEPT, ROLLBACK_DEPTH
from specrun.gguf.facts import model_info
from specrun.llama import LoadOptions, Model
from specrun.run.pair import check_pair

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef fib",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]
FLAT = {b: 0.001 * (1 + 0.01 * b) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}  # verifying is nearly free: draft
METHOD = {"qwen35": "snapshots", "lfm2": "snapshots", "granitehybrid": "checkpoint", "target": "trim", "llama": "trim"}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return build_hybrid(tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module")
def models(hybrid, tiny):
    paths = hybrid | {"target": tiny["target"], "draft-perturbed": tiny["draft-perturbed"]}
    loaded: dict[str, Model] = {}

    def get(name: str) -> Model:
        if name not in loaded:
            loaded[name] = Model(paths[name], LoadOptions(n_ctx=512, n_threads=2))
        return loaded[name]

    yield get
    for m in loaded.values():
        m.close()


def run(target: Model, draft: Model | None, settings: Settings, prompt: str, n: int = 48, sampler: Sampler | None = None):
    """Generate from empty caches; the tokens, the run's stats and the rounds."""
    target.reset()
    if draft is not None:
        draft.reset()
    e = Engine(target, draft, settings, sampler or Sampler(0.0), learned=Learned(CostModel(dict(FLAT)), {"model": {"per_token": 0.0001}}))
    out, rounds, stats = [], [], None
    for step in e.generate(target.tokenize(prompt), n):
        out += step.tokens
        rounds.append(step.round)
        stats = step.stats
    return out, stats, rounds


def plain(target: Model, prompt: str, n: int = 48) -> list[int]:
    return run(target, None, Settings("none"), prompt, n)[0]


# --- the backend: which method, and that each restores the exact state ------------------------


@pytest.mark.parametrize("name", ["qwen35", "lfm2", "granitehybrid", "target"])
def test_each_architecture_gets_its_rollback_method(models, name):
    m = models(name)
    assert m.rollback_method == METHOD[name]
    assert m.draft_limit == (ROLLBACK_DEPTH if METHOD[name] == "snapshots" else None)
    assert m.snapshots == (ROLLBACK_DEPTH if METHOD[name] == "snapshots" else 0)


def test_a_snapshot_target_at_its_defaults_drafts_as_far_as_its_snapshots_reach(models):
    """A hybrid keeps ROLLBACK_DEPTH snapshots of its recurrent state, each a copy of it, so its
    drafts stop there; an attention model's reach the adaptive cap, as far as a verify returns."""
    caps = {}
    for name in ("qwen35", "target"):
        e = Engine(models(name), None, Settings("ngram"), Sampler(0.0), CostModel(dict(FLAT)))
        caps[name] = e.settings.draft_max
    assert caps["qwen35"] == ROLLBACK_DEPTH < caps["target"] == DRAFT_MAX_ADAPTIVE


def test_fewer_snapshots_cap_the_draft(hybrid):
    with Model(hybrid["qwen35"], LoadOptions(n_ctx=256, n_threads=2, rollback_depth=3)) as t:
        assert t.draft_limit == 3
        e = Engine(t, None, Settings("ngram", draft_max=8), Sampler(0.0), CostModel(dict(FLAT)))
        assert e.settings.draft_max == 3


@pytest.mark.parametrize("name", ["qwen35", "lfm2", "granitehybrid"])
@pytest.mark.parametrize("drop", [1, 3, 6])
def test_rollback_leaves_the_state_as_a_fresh_decode(models, hybrid, name, drop):
    """Decode a prompt, then a 7-token verify, roll ``drop`` tokens back, and the logits of the
    next token equal those of a model that never saw the dropped tokens."""
    m = models(name)
    m.reset()
    toks = m.tokenize(PROMPTS[0])
    m.eval(toks[:-1], logits="none")
    m.checkpoint()
    m.eval(toks[-1:] + [100, 101, 102, 103, 104, 105], logits="all")
    keep = m.n_past - drop
    m.rollback(keep)
    assert m.n_past == keep
    got = m.eval([200], logits="last")[0].copy()
    with Model(hybrid[name], LoadOptions(n_ctx=512, n_threads=2)) as fresh:
        fresh.eval(toks[:-1], logits="none")
        fresh.eval((toks[-1:] + [100, 101, 102, 103, 104, 105])[: 7 - drop], logits="all")
        want = fresh.eval([200], logits="last")[0].copy()
    np.testing.assert_allclose(got, want, atol=2e-3)
    st = m.rollback_stats
    assert (st.snapshots if METHOD[name] == "snapshots" else st.restores) >= 1


def test_a_whole_decode_undone_on_a_snapshot_model_restores_a_checkpoint(models, hybrid):
    """Snapshots never cover a decode's first token: undoing all of it takes the checkpoint."""
    m = models("qwen35")
    m.reset()
    toks = m.tokenize(PROMPTS[1])
    m.eval(toks[:-1], logits="none")
    before = m.rollback_stats.restores
    m.checkpoint(full=True)
    m.eval(toks[-1:] + [100, 101], logits="all")
    m.rollback(len(toks) - 1)
    assert m.rollback_stats.restores == before + 1 and m.tokens == toks[:-1]
    got = m.eval(toks[-1:], logits="last")[0].copy()
    with Model(hybrid["qwen35"], LoadOptions(n_ctx=512, n_threads=2)) as fresh:
        fresh.eval(toks[:-1], logits="none")
        want = fresh.eval(toks[-1:], logits="last")[0].copy()
    np.testing.assert_allclose(got, want, atol=2e-3)


# --- the engine: greedy speculation is exact in every pairing --------------------------------

PAIRS = [
    # (target, draft, modes): hybrid + hybrid of the same family, across families and methods,
    # hybrid + transformer both ways
    ("qwen35", "qwen35-draft", ("model", "hybrid")),
    ("lfm2", "lfm2-draft", ("model",)),
    ("granitehybrid", "granitehybrid-draft", ("model", "hybrid")),
    ("granitehybrid", "qwen35-draft", ("model",)),
    ("qwen35", "draft-perturbed", ("model",)),
    ("granitehybrid", "draft-perturbed", ("model",)),
    ("target", "qwen35-draft", ("model",)),
    ("target", "granitehybrid-draft", ("model",)),
]


@pytest.mark.parametrize("target, draft, modes", PAIRS)
def test_greedy_speculation_equals_plain(models, target, draft, modes):
    t, d = models(target), models(draft)
    accepted = rejected = 0
    for p in PROMPTS:
        want = plain(t, p)
        for mode in modes:
            out, stats, rounds = run(t, d, Settings(mode, draft_max=6, p_min=0.0, fixed=True), p)
            assert out == want, (target, draft, mode, p, stats.to_json())
            # speculation went on to the end: every round drafted, but the plain steps that settle
            # a near-tie and the last (no room left)
            settled = sum(1 for r in rounds if r.drafted and r.ties)
            assert stats.n_drafted_rounds >= stats.n_rounds - settled - 1, stats.to_json()
            assert all(r.rollback_s >= 0 for r in rounds)
            accepted += stats.n_accepted
            rejected += stats.n_drafted - stats.n_accepted
    assert rejected > 0  # drafts were rolled back ...
    if t.path.stem == d.path.stem.removesuffix("-draft"):
        assert accepted > 0  # ... and kept
    for m in (t, d):
        st = m.rollback_stats
        assert st.full_replays == 0, (m.path.name, st)  # no rollback fell back to replaying everything
        if m.rollback_method == "snapshots" and m is t:
            assert st.snapshots > 0
        if m.rollback_method == "checkpoint" or (m is d and m.rollback_method != "trim"):
            assert st.restores > 0 and st.checkpoints > 0


@pytest.mark.parametrize("name", ["qwen35", "lfm2", "granitehybrid"])
def test_a_draft_of_the_targets_own_weights_is_accepted_in_full(models, name):
    t, d = models(name), models(f"{name}-draft-copy")
    s = Settings("model", draft_max=4, p_min=0.0, fixed=True, tie_margin=0.0)
    out, stats, _ = run(t, d, s, PROMPTS[0], n=40)
    assert stats.n_drafted > 20 and stats.acceptance_rate == 1.0, stats.to_json()
    assert out == plain(t, PROMPTS[0], 40)


@pytest.mark.parametrize("name", ["qwen35", "granitehybrid"])
def test_ngram_lookup_on_a_hybrid_target_equals_plain(models, name):
    t = models(name)
    want = plain(t, PROMPTS[1], 96)  # both loop back into the prompt's text before 96 tokens
    out, stats, _ = run(t, None, Settings("ngram", draft_max=8, fixed=True), PROMPTS[1], 96)
    assert out == want
    assert stats.n_drafted > 0, stats.to_json()
    assert t.rollback_stats.full_replays == 0


# --- temperature > 0: the target's distribution, exactly -------------------------------------

CHI2_Z_001 = 3.090  # the normal quantile at 1 - 0.001


def chi2_critical(df: int) -> float:
    """Wilson-Hilferty's approximation of the chi-square quantile at alpha = 0.001."""
    return df * (1 - 2 / (9 * df) + CHI2_Z_001 * (2 / (9 * df)) ** 0.5) ** 3


def chi2(counts: dict, p: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over the tokens expected at least 5 times, the rest in one bin."""
    big = [t for t, q in p.items() if q * n >= 5]
    rest_p = 1.0 - sum(p[t] for t in big)
    rest_n = n - sum(counts.get(t, 0) for t in big)
    stat = sum((counts.get(t, 0) - n * p[t]) ** 2 / (n * p[t]) for t in big)
    df = len(big) - 1
    if rest_p * n >= 5:
        stat += (rest_n - n * rest_p) ** 2 / (n * rest_p)
        df += 1
    return stat, df


@pytest.mark.parametrize("target, draft", [("qwen35", "qwen35-draft"), ("granitehybrid", "granitehybrid-draft")])
def test_sampling_matches_the_target_distribution(models, target, draft):
    """The first two sampled tokens against the target's own distributions: the second comes
    from a round after a rollback whenever the first round's draft was rejected."""
    t, d = models(target), models(draft)
    n = 800
    sampler = Sampler(1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)  # the whole distribution: more to get wrong
    prompt = t.tokenize(PROMPTS[0])
    e = Engine(
        t,
        d,
        Settings("model", draft_max=1, p_min=0.0, fixed=True),
        sampler,
        learned=Learned(CostModel(dict(FLAT)), {"model": {"per_token": 0.0001}}),
    )
    firsts: dict[int, int] = {}
    pairs: dict[tuple[int, int], int] = {}
    rejected = 0
    for seed in range(n):
        e.reseed(seed)
        steps = list(e.generate(prompt, 2))
        got = [x for s in steps for x in s.tokens][:2]
        rejected += steps[0].round.accepted == 0
        firsts[got[0]] = firsts.get(got[0], 0) + 1
        pairs[(got[0], got[1])] = pairs.get((got[0], got[1]), 0) + 1
    assert rejected > n // 10  # the rollback path is well exercised

    def dist_after(tokens: list[int]) -> dict[int, float]:
        t.reset()
        row = t.eval(tokens, logits="last")[0].copy()
        q = sampler.dist(row)
        return {int(i): float(p) for i, p in zip(q.ids, q.probs)}

    p1 = dist_after(prompt)
    stat, df = chi2(firsts, p1, n)
    assert df >= 1 and stat < chi2_critical(df), (stat, df)
    # the joint law of the first two tokens: p1(a) p2(b | a), for every first token seen often
    joint = {(a, b): p1[a] * q for a in p1 if p1[a] * n >= 20 for b, q in dist_after(prompt + [a]).items()}
    stat, df = chi2(pairs, joint, n)
    assert df >= 2 and stat < chi2_critical(df), (stat, df)


def test_the_chi_square_check_catches_a_wrong_distribution():
    p = {0: 0.5, 1: 0.3, 2: 0.2}
    assert chi2({0: 500, 1: 300, 2: 200}, p, 1000)[0] < chi2_critical(2)
    assert chi2({0: 600, 1: 250, 2: 150}, p, 1000)[0] > chi2_critical(2)


# --- header only: the class, the sentence, the memory ----------------------------------------


def test_architecture_class_and_state_from_the_header(hybrid, tiny):
    # the state, from the shapes tiny_hybrid wrote, worked out by hand:
    # qwen35: conv 3 x (64 + 2*2*16) + delta-net 16 x 64 = 1408 floats per recurrent layer
    assert STATE_BYTES["qwen35"] == 2 * 4 * (3 * 128 + 16 * 64) == 11264
    assert STATE_BYTES["lfm2"] == 2 * 4 * (2 * 64) == 1024
    assert STATE_BYTES["granitehybrid"] == 2 * 4 * (3 * (128 + 2 * 16) + 16 * 128) == 20224
    for name, method in (("qwen35", "snapshots"), ("lfm2", "snapshots"), ("granitehybrid", "checkpoint")):
        a = model_info(hybrid[name]).arch
        assert (a.kind, a.rollback, a.state_bytes) == ("hybrid", method, STATE_BYTES[name])
        assert a.recurrent_layers == RECURRENT
    llama = model_info(tiny["target"]).arch
    assert (llama.kind, llama.rollback, llama.state_bytes) == ("attention", "trim", 0)


def test_the_header_state_size_is_what_llama_cpp_saves(models):
    """The checkpoint llama.cpp writes is the state plus a small header of cell metadata."""
    for name in ("qwen35", "lfm2", "granitehybrid"):
        m = models(name)
        m.reset()
        m.eval(m.tokenize(PROMPTS[1]), logits="none")
        m.checkpoint(full=True)
        assert 0 <= m.rollback_stats.checkpoint_bytes - STATE_BYTES[name] < 256, name


def test_the_mtp_variant_carries_one_nextn_block(hybrid):
    m = model_info(hybrid["qwen35-mtp"])
    assert m.header.get("qwen35.nextn_predict_layers") == 1 and m.n_layer == N_LAYER + 1
    assert any(t.name == f"blk.{N_LAYER}.nextn.eh_proj.weight" for t in m.header.tensors)
    assert m.arch.state_bytes == STATE_BYTES["qwen35"]  # the MTP block is attention, outside the trunk


def test_llama_cpp_loads_the_mtp_head_and_gives_it_a_context(hybrid):
    """What issue 24 builds on: load_mtp keeps the NextN tensors, and an MTP context shares the
    target's (llama.cpp's own API: specrun's backend does not drive MTP yet)."""
    import llama_cpp as ll

    from specrun import llama

    llama.devices()  # llama.cpp initialised, its log captured
    mp = ll.llama_model_default_params()
    mp.load_mtp = True
    model = ll.llama_model_load_from_file(str(hybrid["qwen35-mtp"]).encode(), mp)
    assert model and ll.llama_model_n_layer_nextn(model) == 1
    ctxs = []
    try:
        for ctx_type in (None, ll.LLAMA_CONTEXT_TYPE_MTP):
            cp = ll.llama_context_default_params()
            cp.n_ctx, cp.n_threads, cp.n_threads_batch = 256, 1, 1
            if ctx_type is not None:
                cp.ctx_type, cp.ctx_other, cp.n_rs_seq = ctx_type, ctxs[0], 0
            ctxs.append(ll.llama_init_from_model(model, cp))
            assert ctxs[-1]
    finally:
        for c in reversed(ctxs):
            if c:
                ll.llama_free(c)
        ll.llama_model_free(model)


def test_memory_counts_the_state_and_only_the_attention_layers_kv(hybrid):
    n_ctx = 512
    m = model_info(hybrid["qwen35"])  # one KV head count for every layer in the header ...
    assert m.header.get("qwen35.attention.head_count_kv") == N_HEAD_KV
    kv_per_layer = n_ctx * N_HEAD_KV * (2 * N_EMBD // 4) * 2  # ... but KV only in the 2 attention layers (f16)
    assert m.kv_bytes(n_ctx) == 2 * kv_per_layer
    mm = estimate(m, "target", n_ctx, 0)
    snapshots = STATE_BYTES["qwen35"] * (1 + ROLLBACK_DEPTH)
    assert mm.state == snapshots + CHECKPOINTS_KEPT * STATE_BYTES["qwen35"]
    plain_llama_like = mm.weights + mm.kv_cache + mm.compute
    assert mm.total == plain_llama_like + mm.state


def test_kv_and_state_match_what_llama_cpp_allocates(hybrid):
    """llama.cpp's own log: the KV cache of the attention layers, and the recurrent buffer with
    its snapshots."""
    for name in ("qwen35", "granitehybrid"):
        m = model_info(hybrid[name])
        with Model(hybrid[name], LoadOptions(n_ctx=512, n_threads=2)) as model:
            log = "".join(model.load_log)
            snaps = model.snapshots
        kv = re.search(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells", log)
        rs = re.search(r"llama_memory_recurrent: size =\s*([\d.]+) MiB", log)
        assert kv and rs, log[-3000:]
        assert abs(m.kv_bytes(int(kv.group(2))) - float(kv.group(1)) * 2**20) <= 0.01 * 2**20
        assert abs(m.arch.state_total(snaps) - float(rs.group(1)) * 2**20) <= 0.01 * 2**20


@pytest.mark.parametrize("target, draft", [("qwen35", "qwen35-draft"), ("granitehybrid", "qwen35-draft"), ("target", "lfm2")])
def test_check_pair_names_the_class_and_counts_the_state(hybrid, tiny, capsys, target, draft):
    paths = hybrid | {"target": tiny["target"]}
    r = check_pair(paths[target], paths[draft], gpu_query=GpuQuery([], problem="none"), available_ram=64 * 2**30)
    assert r.ok
    code = main(["check-pair", "-m", str(paths[target]), "-d", str(paths[draft]), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    for role, name in (("target", target), ("draft", draft)):
        a = out["architectures"][role]
        arch = "llama" if name == "target" else name.removesuffix("-draft")
        assert a["rollback"] == METHOD[arch]
        mem = next(x for x in out["memory"]["models"] if x["role"] == role)
        extra = 0 if arch == "llama" else STATE_BYTES[arch] * (1 + (ROLLBACK_DEPTH if METHOD[arch] == "snapshots" else 0))
        assert mem["state"] == extra + (CHECKPOINTS_KEPT * STATE_BYTES[arch] if extra else 0)
    main(["check-pair", "-m", str(paths[target]), "-d", str(paths[draft])])
    text = " ".join(capsys.readouterr().out.split())
    words = {
        "snapshots": f"(hybrid): rejected drafts roll back through {ROLLBACK_DEPTH} state snapshots",
        "checkpoint": "(hybrid): llama.cpp keeps no state snapshots for it; a rejected draft restores a checkpoint",
        "trim": "(attention only): rejected drafts are trimmed from the KV cache",
    }
    for name in (target, draft):
        arch = "llama" if name == "target" else name.removesuffix("-draft")
        assert f"{arch} {words[METHOD[arch]]}" in text, text


def write_unknown_arch(path) -> None:
    w = GGUFWriter(path, "retnet9")
    w.add_block_count(1)
    w.add_embedding_length(N_EMBD)
    add_vocab(w, bpe_vocab())
    w.add_tensor("token_embd.weight", np.zeros((len(bpe_vocab()), N_EMBD), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_architecture_llama_cpp_cannot_load_is_one_line_and_exit_1(tmp_path, tiny, capsys):
    bad = tmp_path / "retnet.gguf"
    write_unknown_arch(bad)
    assert struct.unpack("<4s", bad.read_bytes()[:4])[0] == b"GGUF"
    for argv in (["check-pair", "-m", str(bad), "-d", str(tiny["target"])], ["generate", "-m", str(bad), "-p", "hi", "-n", "2"]):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == EXIT_FAIL, err
        lines = [ln for ln in err.splitlines() if ln.startswith("specrun: error:")]
        assert len(lines) == 1 and "'retnet9'" in lines[0] and "Traceback" not in err, err


def test_an_unknown_architecture_is_refused_where_llama_cpp_python_has_no_package_metadata(tmp_path, tiny, capsys, monkeypatch):
    """A llama-cpp-python unpacked from an archive (the GPU machine's) has no package metadata:
    its version is read from the package itself, so the refusal before loading still holds."""
    from importlib import metadata

    import specrun.gguf.architecture as architecture

    def no_metadata(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(architecture.metadata, "version", no_metadata)
    bad = tmp_path / "retnet.gguf"
    write_unknown_arch(bad)
    code = main(["check-pair", "-m", str(bad), "-d", str(tiny["target"])])
    err = capsys.readouterr().err
    assert code == EXIT_FAIL and "'retnet9'" in err and "Traceback" not in err, err


# --- the command itself -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen35", "lfm2", "granitehybrid"])
def test_generate_with_a_hybrid_pair_equals_plain(hybrid, capsys, name):
    common = ["generate", "-m", str(hybrid[name]), "-t", "1", "-p", PROMPTS[0], "-n", "40", "-c", "512", "--temp", "0", "--json"]

    def run_cli(*extra: str) -> dict:
        code = main([*common, *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out)

    want = run_cli("--draft", "none")["tokens"]
    for mode in ("model", "hybrid"):
        got = run_cli("-d", str(hybrid[f"{name}-draft"]), "--draft", mode, "--fixed", "--draft-max", "4")
        assert got["tokens"] == want, (mode, got["stats"])
        assert 0 < got["stats"]["n_accepted"] < got["stats"]["n_drafted"], got["stats"]
    adaptive = run_cli("-d", str(hybrid[f"{name}-draft"]))  # the default: hybrid, adaptive, calibrated first
    assert adaptive["tokens"] == want
