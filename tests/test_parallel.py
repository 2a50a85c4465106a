"""Several sequences in one context: the Gate's batches through the real llama.cpp on the tiny
models (each sequence's greedy output, its tokens and its text, equals what it gives alone), and the batch price of a
verify on hand-made numbers (drafting fades as the batch fills)."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import numpy as np
import pytest

from specrun.decode.batched import BatchCost
from specrun.decode.chooser import Chooser
from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.sampling import Sampler
from specrun.run.stream import stream_generate

PROMPTS = ["The quick brown fox", "Once upon a time there was", "def add(a, b):\n    return"]


def run_alone(target, draft, settings: Settings, prompt: list[int], n: int) -> tuple[list[int], str]:
    """The tokens and the text, streamed as the server's slots stream them."""
    eng = Engine(target, draft, settings, Sampler(temperature=0.0), CostModel({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.0, 32: 3.0}))
    events = list(stream_generate(eng, prompt, n))
    return [t for e in events for t in e.tokens], "".join(e.text for e in events)


@pytest.mark.parametrize("draft_mode", ["none", "model", "ngram"])
def test_three_sequences_in_one_context_each_equal_alone(tiny, draft_mode, monkeypatch):
    import llama_cpp

    from specrun.llama import Gate, LoadOptions, Model, Sequence

    settings = Settings(mode=draft_mode)
    with (
        Model(tiny["target"], LoadOptions(n_ctx=256, n_threads=1)) as t1,
        Model(tiny["draft-perturbed"], LoadOptions(n_ctx=256, n_threads=1)) as d1,
    ):
        prompts = [t1.tokenize(p) for p in PROMPTS]
        alone = [run_alone(t1, d1 if draft_mode == "model" else None, settings, p, 24) for p in prompts]
        for t in (t1, d1):
            t.reset()
    gate = Gate()
    decoders: set[int] = set()  # the threads llama_decode ran on
    real_decode = llama_cpp.llama_decode
    opts = LoadOptions(n_ctx=256, n_threads=1, n_seq_max=3, n_outputs_max=192)
    with Model(tiny["target"], opts) as tn, Model(tiny["draft-perturbed"], opts) as dn:
        assert tn.n_ctx >= 256
        monkeypatch.setattr(llama_cpp, "llama_decode", lambda ctx, b: decoders.add(threading.get_ident()) or real_decode(ctx, b))
        got: list[tuple[list[int], str] | None] = [None] * 3
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                got[i] = run_alone(
                    Sequence(tn, i, gate), Sequence(dn, i, gate) if draft_mode == "model" else None, settings, prompts[i], 24
                )
            except BaseException as e:  # surfaced below
                errors.append(e)
            finally:
                gate.leave()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for _ in threads:
            gate.join()  # all three are members before any decodes: they meet in every batch
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        assert not errors, errors
        assert got == alone
        assert len({text for _, text in alone}) == 3
        assert gate.rows > gate.passes  # batches carried more than one sequence's rows
        # every batch ran on one thread, none of the members' (see llama.on_own_thread)
        assert len(decoders) == 1 and not decoders & {th.ident for th in threads} and threading.get_ident() not in decoders
        # ... and that thread ends once every member has left (it would keep its OpenMP team)
        for runner in [t for t in threading.enumerate() if t.ident in decoders]:
            runner.join(60)
            assert not runner.is_alive()


def test_work_done_once_runs_on_a_thread_that_has_ended():
    from specrun.llama import on_own_thread

    seen: list[threading.Thread] = []
    assert on_own_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(KeyError, match="gone"):
        on_own_thread(lambda: {}["gone"])


def test_a_sequence_rolls_back_alone(tiny):
    from specrun.llama import Gate, LoadOptions, Model, Sequence

    gate = Gate()
    with Model(tiny["target"], LoadOptions(n_ctx=128, n_threads=1, n_seq_max=2)) as m:
        a, b = Sequence(m, 0, gate), Sequence(m, 1, gate)
        toks = m.tokenize(PROMPTS[0])
        ra = a.eval(toks, logits="last").copy()
        b.eval(toks[:2], logits="none")
        b.eval(toks[2:], logits="last")
        a.rollback(2)
        assert a.n_past == 2 and b.n_past == len(toks)
        again = a.eval(toks[2:], logits="last")
        assert abs(again - ra).max() < 1e-3  # its own positions again, untouched by b's
        with pytest.raises(ValueError):
            Sequence(m, 2, gate)


def test_the_slots_threads_turn_tokens_into_text_at_once(tiny):
    """The server's slots stream at the same time, each thread turning its tokens into text
    through the one Model: every thread gets the text it gets alone. (A buffer the Model kept
    for llama_token_to_piece, shared by the threads while ctypes let go of the GIL, once gave
    a stream another token's bytes: the served text differed from plain decoding at a
    confident position, with the same tokens.)"""
    from specrun.llama import Gate, LoadOptions, Model, Sequence

    with Model(tiny["target"], LoadOptions(n_ctx=64, n_threads=1, n_seq_max=4)) as m:
        gate = Gate()
        seqs = [Sequence(m, i, gate) for i in range(4)]
        parts = [list(range(i, m.n_vocab, 4)) for i in range(4)]  # each thread its own tokens
        alone = [[m.piece(t) for t in part] for part in parts]
        assert all(len(set(p)) > 1 for p in alone)
        wrong = [0] * 4

        def detokenize(i: int) -> None:
            for _ in range(20):
                wrong[i] += sum(seqs[i].piece(t) != want for t, want in zip(parts[i], alone[i]))

        threads = [threading.Thread(target=detokenize, args=(i,)) for i in range(4)]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # the threads take turns as often as the interpreter allows
        try:
            for th in threads:
                th.start()
            for th in threads:
                th.join(120)
        finally:
            sys.setswitchinterval(interval)
        assert not any(th.is_alive() for th in threads)
        assert wrong == [0] * 4


@dataclass
class Rows:
    batch_rows: int
    own_rows: int


# a compute-bound curve past 8 rows: each row costs 0.25 of a step there
CURVE = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 3.2, 32: 7.2, 64: 15.2}


def test_alone_a_verify_costs_the_curve_and_in_a_batch_what_its_rows_add():
    shared = CostModel(dict(CURVE))
    alone = BatchCost(shared, Rows(5, 5), threading.RLock())
    assert alone.verify_cost(4) == shared.verify_cost(4)
    busy = BatchCost(shared, Rows(20, 4), threading.RLock())  # 16 rows from others
    assert busy.verify_cost(4) == pytest.approx(shared.verify_cost(20) - shared.verify_cost(16))
    busy.observe_verify(4, 4.0)  # the whole batch's seconds, at its real size
    assert 20 in shared.seen and 4 not in shared.seen


def test_drafting_fades_as_the_batch_fills():
    shared = CostModel(dict(CURVE))
    acc = np.full(8, 0.7)
    draft = 0.02 * np.arange(1, 9)
    for others, drafts in ((0, True), (32, False)):
        bc = BatchCost(shared, Rows(others + 1, 1), threading.RLock())
        k, _ = Chooser({}, bc).best(acc, draft, bc.table(9), 0.0)  # type: ignore[arg-type]
        assert (k > 0) == drafts, (others, k)
