"""Token trees (issue 56): the tree record, the multi-candidate rule, and the engine verifying a
tree in one decode on the real llama.cpp: greedy output is plain decoding's, the caches are
those of a run that caught up from scratch, and at T > 0 the target's law is kept."""

from __future__ import annotations

import math

import llama_cpp as ll
import numpy as np
import pytest

from specrun.decode import engine as engine_module
from specrun.decode.chooser import Plan, tree_nodes
from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings, rollback, speculative_round
from specrun.decode.learned import Learned
from specrun.decode.round import Proposal
from specrun.decode.sampling import Dist, Sampler, accept_among, residual
from specrun.llama import LoadOptions, Model

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a",
    "The quick brown fox jumps over the lazy dog. The quick brown cat sleeps. The quick brown",
    "こんにちは、世界。今日はいい天気ですね。こんにちは、友達。こんにちは",
]
# a cost model that makes the chooser draft: verifying is nearly free
FLAT = {b: 0.001 * (1 + 0.01 * b) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}
BRANCHES = 8
ALPHA_Z = 3.09  # the chi-square tests' one-sided level: 0.001
KERNEL_NOISE = 1e-2  # batched against one-token logits on the tiny models: up to ~1e-3


@pytest.fixture(scope="module")
def loaded(tiny):
    # one thread: thousands of tiny decodes, on a machine whose other core may be busy (two
    # threads then wait on each other at every decode)
    models = {
        "tree-target": Model(tiny["target"], LoadOptions(n_ctx=512, n_threads=1, tree_branches=BRANCHES)),
        "target": Model(tiny["target"], LoadOptions(n_ctx=512, n_threads=1)),
        "draft-perturbed": Model(tiny["draft-perturbed"], LoadOptions(n_ctx=512, n_threads=1)),
        "draft-unrelated": Model(tiny["draft-unrelated"], LoadOptions(n_ctx=512, n_threads=1)),
    }
    yield models
    for m in models.values():
        m.close()


def engine(target, draft, settings, sampler=None):
    learned = Learned(CostModel(dict(FLAT)), {"model": {"per_token": 0.0001}})
    return Engine(target, draft, settings, sampler or Sampler(0.0), learned=learned)


def count_trees(monkeypatch, model) -> list[int]:
    """How many trees ``model`` verifies from now on (a list of one count)."""
    seen = [0]
    verify = model.eval_tree

    def counted(tokens, parents):
        seen[0] += 1
        return verify(tokens, parents)

    monkeypatch.setattr(model, "eval_tree", counted)
    return seen


def chi_square_rejects(counts: dict[int, int], law: Dist) -> bool:
    """Do the counts reject ``law`` at ALPHA_Z (Pearson's statistic, Wilson-Hilferty's
    approximation of the quantile; tokens the law gives no mass reject it outright)?"""
    n = sum(counts.values())
    if any(law.prob(t) == 0 for t in counts):
        return True
    stat = sum((counts.get(int(t), 0) - n * p) ** 2 / (n * p) for t, p in zip(law.ids, law.probs))
    df = len(law.ids) - 1
    quantile = df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3
    return stat > quantile


# --- the tree record --------------------------------------------------------------------


def test_a_chain_is_a_tree_whose_trunk_is_all_of_it_and_grow_branches_off_the_shared_prefix():
    one = [Dist.one_hot(t) for t in range(10)]
    chain = Proposal([1, 2, 3], one[:3])
    assert not chain.is_tree and chain.trunk == 3 and chain.children() == {-1: [0], 0: [1], 1: [2], 2: []}
    tree = chain.grow([1, 5, 6], one[:3])  # shares the first node, then a branch of two
    assert tree.is_tree and tree.tokens == [1, 2, 3, 5, 6] and tree.parents == [-1, 0, 1, 0, 3]
    assert tree.trunk == 3 and tree.path(4) == [0, 3, 4]
    assert tree.grow([1, 2], one[:2]) is tree  # nothing new
    assert tree.grow([7, 8, 9], one[:3], most=1).parents == [-1, 0, 1, 0, 3, -1]
    assert tree.cut(4).parents == [-1, 0, 1, 0]


def test_a_trees_nodes_beyond_its_trunk_are_kept_while_their_chance_pays_for_their_rows():
    reach = [0.5, 0.3, 0.1]  # the chance the path to each extra node is accepted
    flat = [1.0 + 0.001 * b for b in range(64)]
    assert tree_nodes(reach, 4, worth=2.0, c=flat) == 3  # rows nearly free: all of them
    steep = [float(b + 1) for b in range(64)]  # each row a whole step
    assert tree_nodes(reach, 4, worth=2.0, c=steep) == 0  # 0.5 tokens for a step: less than worth's 2
    assert tree_nodes(reach, 4, worth=0.4, c=steep) == 1  # only the first beats 0.4 a step
    step = [1.0] * 8 + [3.0] * 56  # a step at 9 rows: a trunk of 4 is 5 rows, and 3 more fit
    assert tree_nodes(reach, 4, worth=1.0, c=step) == 3
    assert tree_nodes(reach, 6, worth=1.0, c=step) == 1  # 7 rows: one more fits
    assert tree_nodes(reach, 4, worth=1.0, c=[1.0, 1.0]) == 3  # past the curve: its last slope (flat)


# --- the rule: several candidates for one position --------------------------------------


def wrong_accept_among(candidates, p, rng):
    """A wrong rule: each candidate tried against the target's law itself, with no residual
    between them (only the last rejection's)."""
    for i, (x, q) in enumerate(candidates):
        if rng.random() < min(1.0, p.prob(x) / q.prob(x)):
            return i, None
    return None, residual(p, candidates[-1][1]).sample(rng) if candidates else p.sample(rng)


def draw_without_replacement(q: Dist, n: int, rng) -> list[tuple[int, Dist]]:
    out = []
    for _ in range(n):
        if q.probs.sum() <= 0 or len(q.ids) == 0:
            break
        x = q.sample(rng)
        out.append((x, q))
        rest = q.ids != x
        q = Dist(q.ids[rest], q.probs[rest] / q.probs[rest].sum()) if rest.any() else Dist(q.ids[:0], q.probs[:0])
    return out


@pytest.mark.parametrize("how", ["sampled", "one-hot"])
def test_trying_several_candidates_in_turn_keeps_the_targets_law_and_a_rule_without_residuals_does_not(how):
    ids = np.arange(6)
    p = Dist(ids, np.array([0.30, 0.25, 0.20, 0.12, 0.08, 0.05]))
    q = Dist(ids, np.array([0.05, 0.10, 0.15, 0.20, 0.20, 0.30]))

    def counts(rule, seed):
        rng, out = np.random.default_rng(seed), {}
        for _ in range(20_000):
            if how == "sampled":  # a draft model: the second drawn from the rest of q
                cands = draw_without_replacement(q, 2, rng)
            else:  # copies: fixed tokens, each with a one-hot law
                cands = [(3, Dist.one_hot(3)), (0, Dist.one_hot(0))]
            i, y = rule(cands, p, rng)
            t = cands[i][0] if i is not None else y
            out[t] = out.get(t, 0) + 1
        return out

    assert not chi_square_rejects(counts(accept_among, 1), p)
    assert chi_square_rejects(counts(wrong_accept_among, 1), p)


def test_one_candidate_draws_as_the_chain_rule_does():
    from specrun.decode.sampling import accept_or_resample

    ids = np.arange(4)
    p, q = Dist(ids, np.array([0.4, 0.3, 0.2, 0.1])), Dist(ids, np.array([0.1, 0.2, 0.3, 0.4]))
    for seed in range(50):
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        i, y = accept_among([(3, q)], p, a)
        ok, z = accept_or_resample(3, p, q, b)
        assert (i == 0) == ok and y == z


# --- the engine on the real llama.cpp ---------------------------------------------------


@pytest.fixture(scope="module")
def plain(loaded):
    out = {}
    for p in PROMPTS:
        e = engine(loaded["target"], None, Settings("none"))
        out[p] = [t for step in e.generate(loaded["target"].tokenize(p), 64) for t in step.tokens]
    return out


SOURCES = [("model", "draft-perturbed"), ("model", "draft-unrelated"), ("ngram", None)]


@pytest.mark.parametrize("mode, draft", SOURCES)
def test_greedy_trees_give_plain_decodings_tokens_and_leave_the_caches_as_a_catch_up_would(loaded, plain, mode, draft, monkeypatch):
    target, drafter = loaded["tree-target"], loaded[draft] if draft else None
    trees = count_trees(monkeypatch, target)
    mem = ll.llama_get_memory(target._ctx)
    for p in PROMPTS:
        e = engine(target, drafter, Settings(mode, draft_max=4, p_min=0.0, fixed=True, tree=True))
        assert e.branches == BRANCHES
        out = []
        for step in e.generate(target.tokenize(p), 64):
            out.extend(step.tokens)
            seq = e.tokens
            # the invariant, and nothing of any branch left: sequence 0 holds positions 0..n_past-1
            assert target.tokens == seq[:-1]
            assert ll.llama_memory_seq_pos_min(mem, 0) == 0 and ll.llama_memory_seq_pos_max(mem, 0) == target.n_past - 1
            assert all(ll.llama_memory_seq_pos_max(mem, b) == -1 for b in range(1, BRANCHES + 1))
            if drafter is not None:  # the draft holds a prefix of the sequence: no rejected branch's token
                assert drafter.tokens == seq[: drafter.n_past]
        assert out == plain[p], p
    assert trees[0] > 0


def fresh_logits(path, prompt: list[int], seq: list[int]) -> np.ndarray:
    """The logits after ``seq`` from a model that caught up from scratch: the prompt but its last
    token in one batch (as prefill does), then one token at a time."""
    with Model(path, LoadOptions(n_ctx=512, n_threads=1)) as fresh:
        fresh.eval(prompt[:-1], logits="none")
        for t in seq[len(prompt) - 1 :]:
            row = fresh.eval([t], logits="last")[0].copy()
    return row


def test_after_tree_rounds_the_next_logits_are_those_of_a_run_that_caught_up_from_scratch(loaded, tiny, monkeypatch):
    """Random accepts and rejects in trees at T > 0; then the target's and the draft's next
    logits against fresh models'. A cache holding a wrong token, or one at a wrong position,
    is off by whole logits; the tree's cells were computed in batches of up to 13 tokens, which
    differ from one-token decodes by up to about 1e-3 here (tiny_models.py)."""
    target, draft = loaded["tree-target"], loaded["draft-perturbed"]
    trees = count_trees(monkeypatch, target)
    e = engine(target, draft, Settings("model", draft_max=6, p_min=0.0, fixed=True, tree=True), Sampler(1.0, seed=5))
    prompt = target.tokenize(PROMPTS[1])
    stats = None
    for step in e.generate(prompt, 100):
        stats = step.stats
    assert trees[0] > 0 and 0 < stats.n_accepted < stats.n_drafted
    seq = e.tokens
    got = target.eval([seq[-1]], logits="last")[0].copy()
    target.rollback(len(seq) - 1)
    np.testing.assert_allclose(got, fresh_logits(tiny["target"], prompt, seq), atol=KERNEL_NOISE)
    # the draft: a prefix of the sequence, its next logits a fresh decode's
    assert draft.tokens == seq[: draft.n_past]
    nxt = draft.eval(seq[draft.n_past :], logits="last")[0].copy()
    draft.rollback(len(seq) - 1)
    np.testing.assert_allclose(nxt, fresh_logits(tiny["draft-perturbed"], prompt, seq), atol=KERNEL_NOISE)


def first_tokens(loaded, prompt: list[int], sampler: Sampler, n: int) -> tuple[dict[int, int], int]:
    """The first token of ``n`` tree rounds after ``prompt``, each from the same cache, and how
    many of the rounds offered the first position a second candidate."""
    target, draft = loaded["tree-target"], loaded["draft-perturbed"]
    e = engine(target, draft, Settings("model", draft_max=4, p_min=0.0, fixed=True, tree=True), sampler)
    e.prefill(prompt)
    src = e.sources["model"]
    counts: dict[int, int] = {}
    siblings = 0
    for _ in range(n):
        r = speculative_round(target, src, prompt, Plan("model", 4), sampler, e.rng, others=[src], branches=e.branches)
        siblings += len(r.proposal.children()[-1]) > 1
        counts[r.emitted[0]] = counts.get(r.emitted[0], 0) + 1
        rollback(target, [src], len(prompt) - 1)
    return counts, siblings


def test_at_temperature_the_first_tokens_law_is_the_targets_and_a_wrong_rule_is_caught(loaded, monkeypatch):
    """A draft close to the target (so that second candidates are often accepted) and a flat law
    (a high temperature), where trying a second candidate against the target's law itself,
    rather than what is left of it, shows."""
    target = loaded["target"]
    prompt = target.tokenize(PROMPTS[0])
    target.rollback(0)
    target.eval(prompt[:-1], logits="none")
    row = target.eval([prompt[-1]], logits="last")[0].copy()
    target.rollback(0)
    law = Sampler(3.0, top_k=6, top_p=1.0, min_p=0.0).dist(row)
    n = 2000
    counts, siblings = first_tokens(loaded, prompt, Sampler(3.0, top_k=6, top_p=1.0, min_p=0.0, seed=3), n)
    assert siblings > n // 2  # the rule over siblings was exercised
    assert not chi_square_rejects(counts, law)
    monkeypatch.setattr(engine_module, "accept_among", wrong_accept_among)
    counts, _ = first_tokens(loaded, prompt, Sampler(3.0, top_k=6, top_p=1.0, min_p=0.0, seed=3), n)
    assert chi_square_rejects(counts, law)


@pytest.mark.parametrize("mode, draft", SOURCES)
def test_adaptive_trees_are_priced_kept_where_rows_are_cheap_and_exact(loaded, plain, mode, draft, monkeypatch):
    """With the chooser on, a tree keeps the nodes beyond its trunk that pay: on a flat verify
    curve some do (and the output is still plain decoding's), where every row costs a whole
    step none do and every round verifies a chain."""
    target, drafter = loaded["tree-target"], loaded[draft] if draft else None
    trees = count_trees(monkeypatch, target)
    for p in PROMPTS:
        e = engine(target, drafter, Settings(mode, tree=True))
        assert [t for step in e.generate(target.tokenize(p), 64) for t in step.tokens] == plain[p], p
    assert trees[0] > 0
    steep = {b: 0.001 * b for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}
    trees[0] = 0
    for p in PROMPTS:
        e = Engine(
            target, drafter, Settings(mode, tree=True), Sampler(0.0), learned=Learned(CostModel(steep), {"model": {"per_token": 1e-6}})
        )
        assert [t for step in e.generate(target.tokenize(p), 64) for t in step.tokens] == plain[p], p
    assert trees[0] == 0


def test_a_target_not_opened_for_trees_keeps_chains_and_says_so(loaded, plain):
    e = engine(loaded["target"], loaded["draft-perturbed"], Settings("model", draft_max=4, fixed=True, tree=True))
    assert e.branches == 0 and e.tree_note is not None and "chains" in e.tree_note
    assert not Settings().tree


def test_a_pair_opened_for_trees_gives_its_target_branch_ids_and_the_cli_takes_the_flag(tiny):
    from specrun.cli.options import Options
    from specrun.run.config import PairConfig
    from specrun.run.session import open_pair

    for tree in (True, False):
        pair = open_pair(tiny["target"], tiny["draft-perturbed"], PairConfig(n_ctx=512, threads=1), tree=tree)
        try:
            assert (pair.target.tree_branches > 0) == tree and pair.target.n_ctx >= 512
            assert pair.draft is not None and pair.draft.tree_branches == 0  # the draft never branches
        finally:
            pair.close()
    assert Options.build({"tree": True}).settings.tree


def test_generate_with_trees_from_the_cli_gives_plain_decodings_tokens(tiny, capsys):
    import json

    from specrun.cli.main import main

    base = ["generate", "-m", str(tiny["target"]), "-t", "1", "-c", "512", "-p", PROMPTS[0], "-n", "32", "--json"]
    tree = [*base, "-d", str(tiny["draft-perturbed"]), "--draft", "model", "--draft-max", "4", "--fixed", "--tree"]
    assert main(tree) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["stats"]["by_source"]["model"]["rounds"] > 0
    assert main([*base, "--draft", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == got["tokens"]


def test_a_hybrid_target_is_given_no_branch_ids_and_its_engine_keeps_chains(tmp_path, tiny):
    from tiny_hybrid import build_hybrid

    path = build_hybrid(tmp_path)["qwen35"]
    with Model(path, LoadOptions(n_ctx=256, n_threads=1, tree_branches=BRANCHES)) as target:
        assert target.recurrent and target.tree_branches == 0
        e = engine(target, None, Settings("ngram", tree=True))
        assert e.branches == 0 and e.tree_note is not None


# --- what a run reports: tree rounds, their nodes, and the rounds a branch won ----------


class TreeSpy:
    """What the target's tree decodes did, read off its calls to ``Model.eval_tree`` and
    ``Model.keep_branch`` (not off the engine's counters): the trees verified, their nodes, the
    rounds whose kept path left the trunk (the first chain from the root), and the tokens of
    those paths' nodes off the trunk."""

    def __init__(self, monkeypatch):
        self.rounds = self.nodes = self.wins = self.depths = 0  # depths: the trees' longest branches, summed
        self.off_trunk: list[int] = []
        tree: list[tuple[list[int], list[int]]] = []
        verify, keep = Model.eval_tree, Model.keep_branch

        def eval_tree(model, tokens, parents):
            tree[:] = [(list(tokens), list(parents))]
            return verify(model, tokens, parents)

        def keep_branch(model, path):
            tokens, parents = tree.pop()
            # rows 1 .. trunk - 1 follow one another from the root: the trunk
            trunk = next((i for i in range(1, len(parents)) if parents[i] != i - 1), len(parents))
            off = [row for row in path if row >= trunk]
            self.rounds += 1
            self.nodes += len(tokens) - 1
            depth = [0] * len(parents)  # row 0 is the root
            for row in range(1, len(parents)):
                depth[row] = depth[parents[row]] + 1
            self.depths += max(depth)
            self.wins += bool(off)
            self.off_trunk += [tokens[row] for row in off]
            return keep(model, path)

        monkeypatch.setattr(Model, "eval_tree", eval_tree)
        monkeypatch.setattr(Model, "keep_branch", keep_branch)


TREE_RUNS = [(temp, p) for temp in (0.0, 1.0) for p in PROMPTS]  # greedy and sampled: branches win in some


def test_a_run_counts_its_trees_and_the_rounds_a_branch_won_as_the_target_verified_them(loaded, monkeypatch):
    """The counts against the target's own calls, run by run; a branch must have won somewhere
    (the perturbed draft's runner-up is the target's token now and then). The text the stream
    marks as a branch's is the text of the tokens off the trunk."""
    from specrun.run.stream import stream_generate

    target, draft = loaded["tree-target"], loaded["draft-perturbed"]
    wins = shown = 0
    for temp, p in TREE_RUNS:
        spy = TreeSpy(monkeypatch)
        e = engine(target, draft, Settings("model", draft_max=4, p_min=0.0, fixed=True, tree=True), Sampler(temp, seed=5))
        events = list(stream_generate(e, target.tokenize(p), 64))
        s = events[-1].stats
        assert (s.n_tree_rounds, s.n_tree_nodes, s.n_branch_wins) == (spy.rounds, spy.nodes, spy.wins), (temp, p)
        assert s.n_tree_rounds > 0 and s.n_tree_nodes > s.n_tree_rounds
        assert s.to_json()["n_branch_wins"] == spy.wins
        # acceptance per position counts a tree once per depth (a chain once per draft)
        assert sum(s.proposed_at) == (s.n_drafted - s.n_tree_nodes) + spy.depths < s.n_drafted, (temp, p)
        text = "".join(ev.text for ev in events)
        if text.isascii():  # no character split across tokens: a run's text is its tokens' pieces
            marked = "".join(text for ev in events for text, _, branch in ev.segments if branch)
            assert marked.encode() == b"".join(target.piece(t) for t in spy.off_trunk if not target.is_eog(t)), (temp, p)
            shown += bool(marked)
        wins += spy.wins
    assert wins > 0 and shown > 0


def test_without_trees_nothing_is_counted_and_nothing_marked(loaded, monkeypatch):
    from specrun.run.stream import stream_generate

    target, draft = loaded["tree-target"], loaded["draft-perturbed"]
    spy = TreeSpy(monkeypatch)
    for temp, p in TREE_RUNS:
        e = engine(target, draft, Settings("model", draft_max=4, p_min=0.0, fixed=True), Sampler(temp, seed=5))
        events = list(stream_generate(e, target.tokenize(p), 64))
        s = events[-1].stats
        assert s.n_drafted > 0 and (s.n_tree_rounds, s.n_tree_nodes, s.n_branch_wins) == (0, 0, 0)
        assert not any(branch for ev in events for _, _, branch in ev.segments)
    assert spy.rounds == 0


def test_generate_json_reports_tokens_per_verify_and_the_trees_a_branch_won(tiny, capsys, monkeypatch):
    import json

    from specrun.cli.main import main

    base = ["generate", "-m", str(tiny["target"]), "-t", "1", "-c", "512", "-n", "64", "--json"]
    base += ["-d", str(tiny["draft-perturbed"]), "--draft", "model", "--draft-max", "4", "--fixed", "--draft-p-min", "0"]
    wins = 0
    for p in PROMPTS:
        spy = TreeSpy(monkeypatch)
        assert main([*base, "-p", p, "--tree"]) == 0
        s = json.loads(capsys.readouterr().out)["stats"]
        assert (s["n_tree_rounds"], s["n_tree_nodes"], s["n_branch_wins"]) == (spy.rounds, spy.nodes, spy.wins) and spy.rounds > 0
        assert s["branch_win_rate"] == round(spy.wins / spy.rounds, 4)
        assert s["tokens_per_decode"] == round(s["n_generated"] / s["n_rounds"], 4)  # one verify a round
        wins += spy.wins
    assert wins > 0
    spy = TreeSpy(monkeypatch)
    assert main([*base, "-p", PROMPTS[0]]) == 0
    s = json.loads(capsys.readouterr().out)["stats"]
    assert (s["n_tree_rounds"], s["n_tree_nodes"], s["n_branch_wins"], s["branch_win_rate"]) == (0, 0, 0, 0.0) and spy.rounds == 0
