"""Statistics as data (specrun/decode/stats.py): rounds add up into a run, runs merge into a session's
total, and the per-position counts line up however long each run's drafts were."""

from __future__ import annotations

from specrun.decode.stats import RoundStats, RunStats, add_per_position


def round_(source: str, drafted: int, accepted: int) -> RoundStats:
    return RoundStats(source, drafted, accepted, emitted=accepted + 1, draft_s=0.01, verify_s=0.02, sample_s=0.001)


def run(*rounds: RoundStats) -> RunStats:
    s = RunStats()
    for r in rounds:
        s.add(r)
    return s


def test_rounds_add_up_per_position_and_per_source():
    s = run(round_("model", 3, 2), round_("ngram", 1, 0), round_("none", 0, 0))
    assert (s.n_rounds, s.n_drafted, s.n_accepted, s.n_generated, s.n_drafted_rounds) == (3, 4, 2, 5, 2)
    assert s.proposed_at == [2, 1, 1] and s.accepted_at == [1, 1, 0]
    assert s.by_source == {"model": [1, 3, 2], "ngram": [1, 1, 0], "none": [1, 0, 0]}
    assert s.accept_per_position == [0.5, 1.0, 0.0]


def test_runs_merge_into_a_total_whatever_their_draft_lengths():
    short, long = run(round_("model", 1, 1)), run(round_("model", 4, 4), round_("ngram", 2, 0))
    total = run(round_("model", 2, 0))
    total.merge(short)
    total.merge(long)
    assert total.proposed_at == [4, 3, 1, 1] and total.accepted_at == [2, 1, 1, 1]
    assert total.n_rounds == 4 and total.n_drafted == 9 and total.n_accepted == 5
    assert total.by_source == {"model": [3, 7, 5], "ngram": [1, 2, 0]}
    assert total.draft_lengths == [2, 1, 4, 2]


def test_per_position_counts_grow_to_the_longest_draft():
    proposed, accepted = [5], [3]
    add_per_position(proposed, accepted, run(round_("model", 3, 1)))
    assert proposed == [6, 1, 1] and accepted == [4, 0, 0]


def tree_round(drafted: int, accepted: int, on_branch: int) -> RoundStats:
    return RoundStats("model", drafted, accepted, accepted + 1, 0.01, 0.02, 0.001, tree=True, on_branch=on_branch)


def test_tree_rounds_count_their_nodes_and_the_rounds_a_branch_won_and_merge():
    s = run(tree_round(6, 2, 0), tree_round(5, 3, 1), round_("model", 4, 4), tree_round(7, 1, 1))
    assert (s.n_tree_rounds, s.n_tree_nodes, s.n_branch_wins) == (3, 18, 2)
    assert s.branch_win_rate == 2 / 3 and s.to_json()["n_branch_wins"] == 2 and s.to_json()["n_tree_nodes"] == 18
    chains = run(round_("model", 4, 2), round_("none", 0, 0))
    assert (chains.n_tree_rounds, chains.n_tree_nodes, chains.n_branch_wins, chains.branch_win_rate) == (0, 0, 0, 0.0)
    chains.merge(s)
    assert (chains.n_tree_rounds, chains.n_tree_nodes, chains.n_branch_wins) == (3, 18, 2)


def test_a_trees_positions_are_its_depths_not_its_nodes():
    """A tree of 5 nodes, 2 deep, proposed positions 0 and 1 (a draft at each depth along any
    branch), not 0..4: acceptance per position is by depth, as a chain's is."""
    s = RunStats()
    s.add(RoundStats("model", 5, 2, 3, 0.0, 0.0, 0.0, tree=True, on_branch=1, depth=2))
    s.add(RoundStats("model", 3, 1, 2, 0.0, 0.0, 0.0))  # a chain of 3, its first kept
    assert s.proposed_at == [2, 2, 1] and s.accepted_at == [2, 1, 0]
    assert s.n_drafted == 8 and s.n_tree_nodes == 5
