"""Chained MTP heads (llama.cpp's chain mode: head i makes a draft's guess i), on a tiny mimo2
with three taught heads (tests/tiny_mimo2.py), through the real llama.cpp: what the header
says (inspect, check-pair, drafts), exact greedy output with ``--draft mtp`` and with the
default chooser, drafts no longer than the heads are many, the heads in step with the target
after every round, and the chain's drafts against a reference that computes them from scratch
(a fresh MTP context that decodes the whole history under each head in turn).

mimo2 is attention only: the target rolls back by trimming its cache, so a draft is bounded by
the heads alone."""

from __future__ import annotations

import ctypes
import json
from collections import Counter
from pathlib import Path

import heads_run
import llama_cpp as ll
import numpy as np
import pytest
from heads_run import N_TOKENS, PROMPTS
from llama_cpp import llama_cpp_ext as ll_ext
from tiny_mimo2 import N_HEADS, N_LAYER, build_mimo2

from specrun.cli.main import main
from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.gguf.facts import model_info
from specrun.gguf.heads import heads_of
from specrun.llama import DraftHead, LoadOptions, Model, MtpHeads

K = 6  # asked for per round: more than the heads can make


@pytest.fixture(scope="session")
def mimo2(tmp_path_factory) -> Path:
    return build_mimo2(tmp_path_factory.mktemp("mimo2"))["mimo2"]


def load(path: Path) -> Model:
    m = Model(path, LoadOptions(n_ctx=1024, n_threads=1, n_batch=64, load_mtp=True))
    MtpHeads(m)
    return m


@pytest.fixture(scope="module")
def target(mimo2):
    m = load(mimo2)
    yield m
    m.close()


@pytest.fixture(scope="module")
def fresh(mimo2):
    """A second copy, to catch up from scratch and compare with."""
    m = load(mimo2)
    yield m
    m.close()


class ChainReference:
    """The chain's drafts computed from scratch, with llama.cpp alone: a target context gives
    the target's state after every token of the history; then, for draft step i, a fresh MTP
    context (its memory cleared) runs head i (``llama_set_nextn_layer_offset``) over the whole
    history, each token p paired with the target's state at p - 1, followed by the draft so
    far: the pending token with the target's last state, then each guess t < i with the state
    head t gave it. Nothing is cached between steps or calls."""

    def __init__(self, path: Path, n_ctx: int = 1024):
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.load_mtp = True
        self.model = ll.llama_model_load_from_file(str(path).encode(), mp)
        assert self.model
        self.n_ctx = n_ctx
        self.n_vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model)))
        self.n_embd = int(ll.llama_model_n_embd_out(self.model))
        self.tgt = ll.llama_init_from_model(self.model, self._params())
        self.mtp = ll.llama_init_from_model(self.model, self._params(mtp=True))
        assert self.tgt and self.mtp
        ll_ext.llama_set_embeddings_nextn(self.tgt, True, False)  # a state for every token
        ll_ext.llama_set_embeddings_nextn(self.mtp, True, True)  # and for the head's output row
        self.batch = ll.llama_batch_ext_init(self.mtp)
        self.pos = (ll.llama_pos * 4)()

    def _params(self, mtp: bool = False):
        cp = ll.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = self.n_ctx  # the whole history in one batch
        cp.n_threads = cp.n_threads_batch = 1
        if mtp:
            cp.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
            cp.ctx_other = self.tgt
            cp.n_outputs_max = 1
            cp.n_rs_seq = 0
        return cp

    def states(self, history: list[int]) -> np.ndarray:
        """The target's state (``embeddings_nextn``) after each token of ``history``, in one decode."""
        ll.llama_memory_clear(ll.llama_get_memory(self.tgt), True)
        b = ll.llama_batch_init(len(history), 0, 1)
        try:
            for i, t in enumerate(history):
                b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = t, i, 1, 0, i == len(history) - 1
            b.n_tokens = len(history)
            assert ll.llama_decode(self.tgt, b) == 0
            return np.ctypeslib.as_array(ll_ext.llama_get_embeddings_nextn(self.tgt), shape=(len(history), self.n_embd)).copy()
        finally:
            ll.llama_batch_free(b)

    def _add(self, token: int, pos: int, h: np.ndarray, output: bool) -> int:
        idx = ll.llama_batch_ext_add_token(self.batch, 0, token)
        self.pos[0] = pos
        ll.llama_batch_ext_set_pos(self.batch, idx, self.pos)
        row = np.ascontiguousarray(h, dtype=np.float32)
        embd = ll.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.size)
        assert ll.llama_batch_ext_set_embd_token(self.batch, idx, embd)  # copies the row
        if output:
            ll.llama_batch_ext_set_output_logits(self.batch, idx, True)
        return idx

    def drafts(self, history: list[int], pending: int, guesses: list[int]) -> list[np.ndarray]:
        """Head i's logits after ``history``, ``pending`` and ``guesses[:i]``, for each i
        (the guesses fed are given, so that both sides judge the same drafts)."""
        states = self.states(history)
        before = [np.zeros(self.n_embd, np.float32), *states]  # the state before position p is states[p - 1]
        rows = [(t, p, before[p]) for p, t in enumerate(history)]
        chain = [(pending, len(history), before[-1])]
        out = []
        for i in range(len(guesses)):
            ll.llama_memory_clear(ll.llama_get_memory(self.mtp), True)
            ll_ext.llama_set_nextn_layer_offset(self.mtp, i)
            *first, last = rows + chain
            for token, pos, h in first:
                self._add(token, pos, h, False)
            idx = self._add(*last, True)
            rc = ll.llama_process(self.mtp, ll.LLAMA_PROCESS_TYPE_DECODE, self.batch)
            ll.llama_batch_ext_clear(self.batch)
            assert rc == 0
            out.append(np.ctypeslib.as_array(ll.llama_get_logits_ith(self.mtp, idx), shape=(self.n_vocab,)).copy())
            h = np.ctypeslib.as_array(ll_ext.llama_get_embeddings_nextn_ith(self.mtp, idx), shape=(self.n_embd,)).copy()
            chain.append((guesses[i], len(history) + i + 1, h))
        ll_ext.llama_set_nextn_layer_offset(self.mtp, 0)
        return out

    def close(self) -> None:
        ll.llama_batch_ext_free(self.batch)
        ll.llama_free(self.mtp)
        ll.llama_free(self.tgt)
        ll.llama_model_free(self.model)


@pytest.fixture(scope="module")
def reference(mimo2):
    r = ChainReference(mimo2)
    yield r
    r.close()


def run(target: Model, settings: Settings, prompt: list[int], n: int = N_TOKENS, **kw):
    return heads_run.run(target, settings, prompt, n, **kw)


def chain_drafts(m: Model, pending: int) -> tuple[list[int], list[np.ndarray]]:
    """The greedy draft the chained heads of ``m`` make from its cache and ``pending`` (every
    head in turn), then forgotten: the guesses and each step's logits."""
    h = m.heads
    assert h is not None and h.chain
    guesses, logits = [], []
    x = pending
    for _ in range(h.n_heads):
        row = h.draft_step(x).copy()
        logits.append(row)
        x = int(np.argmax(row))
        guesses.append(x)
    h.end_draft()
    return guesses, logits


def check_against_reference(m: Model, reference: ChainReference, seq: list[int]) -> None:
    """The chain's draft from the cache ``m`` holds (``seq`` less its pending last token)
    equals the reference's, token for token, its logits within the batched-vs-incremental gap."""
    guesses, logits = chain_drafts(m, seq[-1])
    want = reference.drafts(seq[:-1], seq[-1], guesses)
    for i, (got, ref) in enumerate(zip(logits, want, strict=True)):
        assert int(np.argmax(ref)) == guesses[i], f"guess {i}"
        np.testing.assert_allclose(got, ref, atol=2e-2, err_msg=f"head {i}")


def check_in_step(target: Model, fresh: Model, seq: list[int]) -> None:
    """The heads account for exactly the target's positions (in their cache, or queued for it),
    their pending state is the target's state at the last cached position, and their draft
    equals that of heads that caught up with the same sequence in one batch."""
    h = target.heads
    assert h is not None and fresh.heads is not None
    assert target.n_past == h.n_past == h.cached + h.queued == len(seq) - 1
    assert h.queued <= N_HEADS + 1  # what the last verify kept, not yet fed
    fresh.reset()
    fresh.eval(seq[:-1], logits="none")
    np.testing.assert_allclose(h.state_before(h.n_past), fresh.heads.state_before(fresh.heads.n_past), atol=2e-3)
    got, got_logits = chain_drafts(target, seq[-1])
    want, want_logits = chain_drafts(fresh, seq[-1])
    assert got == want
    np.testing.assert_allclose(np.array(got_logits), np.array(want_logits), atol=2e-2)
    assert h.cached == h.n_past and h.queued == 0  # the queue went in with the draft, whose positions are forgotten again


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# --- the header ---------------------------------------------------------------------------


def test_the_header_names_chained_heads(mimo2, capsys):
    h = heads_of(model_info(mimo2))
    assert (h.count, h.first_block, h.usable, h.chained, h.max_draft) == (N_HEADS, N_LAYER, True, True, N_HEADS)
    assert h.describe() == f"built-in MTP: {N_HEADS} heads, chained (one per draft position)"
    for argv in (["inspect", str(mimo2)], ["check-pair", "-m", str(mimo2)], ["drafts", str(mimo2)]):
        code, out, _ = cli(argv, capsys)
        assert code == 0 and f"built-in MTP: {N_HEADS} heads, chained" in " ".join(out.split()), argv
    code, out, _ = cli(["inspect", str(mimo2), "--json"], capsys)
    assert json.loads(out)["mtp_heads"]["chained"] is True


def test_the_backend_runs_them_as_a_chain(target):
    h = target.heads
    assert h is not None and (h.n_heads, h.chain, h.max_draft) == (N_HEADS, True, N_HEADS)


# --- drafting through the engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(target):
    return {p: run(target, Settings("none"), target.tokenize(p))[0] for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_chained_mtp_equals_plain(target, fresh, reference, plain, prompt):
    """64 tokens with the chained heads alone come out as plain decoding's; every round drafts
    at most as many tokens as there are heads (K asks for more), and after every round the
    heads are in step with the target and their draft is the reference's."""
    seen = Counter()

    def on_step(e: Engine, step) -> None:
        r = step.round
        assert r.drafted <= N_HEADS
        seen["full"] += r.drafted == N_HEADS
        seen["accept"] += r.accepted > 0
        seen["reject"] += r.accepted < r.drafted
        check_in_step(target, fresh, e.tokens)
        check_against_reference(target, reference, e.tokens)

    s = Settings("mtp", draft_max=K, p_min=0.0, fixed=True)
    out, stats = run(target, s, target.tokenize(prompt), on_step=on_step)
    assert out == plain[prompt]
    assert stats.by_source["mtp"][2] > 0 and seen["accept"] and seen["reject"] and seen["full"]


# a verify that costs 10 ms whatever its size, as on a large memory-bound target: drafting with
# the heads pays, and the chooser should see it
FLAT = {b: 0.01 for b in range(1, 34)}


def test_hybrid_chooses_among_ngram_and_the_chained_heads(target, plain):
    """The default mode: the n-gram lookup and the chained heads, chosen by the chooser;
    exact either way. Where verifying is dear it drafts with the heads, never longer than they
    are many."""
    used, longest = Counter(), Counter()

    def on_step(e: Engine, step) -> None:
        r = step.round
        used[r.source] += 1
        longest[r.source] = max(longest[r.source], r.drafted)

    for prompt in PROMPTS:
        out, stats = run(target, Settings("hybrid", draft_max=K), target.tokenize(prompt), on_step=on_step, cost=CostModel(dict(FLAT)))
        assert out == plain[prompt]
        assert set(stats.by_source) <= {"mtp", "ngram", "none"}
    assert used["mtp"] > 0 and 0 < longest["mtp"] <= N_HEADS, (used, longest)


def test_a_prompt_of_several_batches(target, fresh, reference):
    """A prompt over three times the batch size: the target prefills it in chunks, every head
    catches up chunk by chunk; exact, in step, and the reference's draft."""
    prompt = target.tokenize(" ".join(PROMPTS) * 4)
    assert len(prompt) > 3 * target.n_batch

    def on_step(e: Engine, step) -> None:
        check_in_step(target, fresh, e.tokens)
        check_against_reference(target, reference, e.tokens)

    s = Settings("mtp", draft_max=K, p_min=0.0, fixed=True)
    out, _ = run(target, s, prompt, n=16, on_step=on_step)
    assert out == run(target, Settings("none"), prompt, n=16)[0]


@pytest.mark.parametrize("broken", ["the head offset never set", "catch-up feeds head 0 only"])
def test_the_reference_tells_a_broken_chain_apart(mimo2, reference, plain, broken, monkeypatch):
    """The reference check fails for a chain that runs every step under head 0, or whose
    catch-up feeds the first head only (the others then attend over nothing but the draft)."""
    if broken == "the head offset never set":
        monkeypatch.setattr(MtpHeads, "_head", lambda self, i: None)
    else:

        def head_0_only(self, entries) -> None:
            self._head(0)
            DraftHead._catch_up(self, entries)

        monkeypatch.setattr(MtpHeads, "_catch_up", head_0_only)
    m = load(mimo2)
    try:
        prompt = m.tokenize(PROMPTS[0])
        seq = prompt + plain[PROMPTS[0]][:8]
        m.eval(seq[:-1], logits="none")
        with pytest.raises(AssertionError):
            check_against_reference(m, reference, seq)
    finally:
        m.close()


def test_generate_with_the_chained_heads_from_the_cli(mimo2, capsys):
    """`generate --draft mtp` on the file: the heads load as a chain, and the text is plain decoding's."""
    base = ["generate", "-m", str(mimo2), "-t", "1", "-p", PROMPTS[1], "-n", "32", "--json"]
    code, out, err = cli([*base, "--draft", "mtp", "--draft-max", str(K), "--fixed"], capsys)
    assert code == 0, err
    with_heads = json.loads(out)
    assert f"own MTP heads ({N_HEADS}, chained: a draft is at most {N_HEADS} long)" in " ".join(err.split())
    assert with_heads["stats"]["by_source"]["mtp"]["rounds"] > 0
    code, out, _ = cli([*base, "--draft", "none"], capsys)
    assert code == 0 and json.loads(out)["tokens"] == with_heads["tokens"]
