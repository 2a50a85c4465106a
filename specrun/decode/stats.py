"""Statistics as data: one record per round, one aggregate per run. Nothing here prints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def add_per_position(proposed_at: list[int], accepted_at: list[int], run: RunStats) -> None:
    """Add ``run``'s drafts proposed and accepted at each draft position to the two lists,
    which grow to the longest draft seen."""
    for i, (p, a) in enumerate(zip(run.proposed_at, run.accepted_at)):
        if i >= len(proposed_at):
            proposed_at.append(0)
            accepted_at.append(0)
        proposed_at[i] += p
        accepted_at[i] += a


@dataclass(frozen=True)
class RoundStats:
    source: str  # which draft source proposed ("model", "ngram", ...) or "none" (a plain decode step)
    drafted: int  # draft tokens sent to the target
    accepted: int  # of those, how many the target kept
    emitted: int  # tokens this round added to the output (accepted + correction/bonus)
    draft_s: float
    verify_s: float
    sample_s: float
    checked: int = 0  # greedy: positions checked for a near-tie this round (see engine) ...
    ties: int = 0  # ... and of those, near-ties (at most one: a near-tie ends the round)
    rollback_s: float = 0.0  # step 4: both caches forgetting the rejected drafts (a restore and replay on hybrid models)
    tree: bool = False  # the draft was a token tree (``drafted``: its nodes, all verified in the one decode)
    on_branch: int = 0  # a tree's: of the accepted drafts, those off its trunk (> 0: a branch other than the first won)
    depth: int = 0  # a tree's longest branch, in drafts: the positions it proposed (its nodes sit side by side at them)


@dataclass
class RunStats:
    n_prompt_tokens: int = 0  # tokens prefilled for this request (only the new ones in a chat)
    n_cached_tokens: int = 0  # prompt tokens the KV cache already held (reused, not evaluated)
    n_generated: int = 0
    prompt_s: float = 0.0
    wall_s: float = 0.0  # generation time, from the first round to the last
    draft_s: float = 0.0
    verify_s: float = 0.0
    sample_s: float = 0.0
    n_rounds: int = 0
    n_target_decodes: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_drafted_rounds: int = 0
    proposed_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [rounds, drafted, accepted]
    draft_lengths: list[int] = field(default_factory=list)  # history, one per round
    finish_reason: str | None = None
    last_round: RoundStats | None = None
    idle_reason: str | None = None  # why the chooser drafts little or nothing lately, in words
    n_predicted: int = 0  # the request's prediction, in tokens (OpenAI's Predicted Outputs; 0: none) ...
    n_prediction_followed: int = 0  # ... and of those, the ones the reply wrote where the prediction had them
    n_tree_rounds: int = 0  # rounds that verified a token tree (--tree) ...
    n_tree_nodes: int = 0  # ... the nodes those trees held ...
    n_branch_wins: int = 0  # ... and the rounds where the path kept left the trunk (a branch other than the first won)

    def snapshot(self) -> RunStats:
        """A copy that later rounds do not change."""
        return dataclasses.replace(
            self,
            proposed_at=list(self.proposed_at),
            accepted_at=list(self.accepted_at),
            by_source={k: list(v) for k, v in self.by_source.items()},
            draft_lengths=list(self.draft_lengths),
        )

    def add(self, r: RoundStats) -> None:
        self.n_rounds += 1
        self.n_target_decodes += 1
        self.n_generated += r.emitted
        self.draft_s += r.draft_s
        self.verify_s += r.verify_s
        self.sample_s += r.sample_s
        self.n_drafted += r.drafted
        self.n_accepted += r.accepted
        self.draft_lengths.append(r.drafted)
        src = self.by_source.setdefault(r.source, [0, 0, 0])
        src[0] += 1
        src[1] += r.drafted
        src[2] += r.accepted
        if r.drafted:
            self.n_drafted_rounds += 1
            positions = r.depth if r.tree else r.drafted  # a tree proposes each depth once, along whichever branch
            while len(self.proposed_at) < positions:
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            for i in range(positions):
                self.proposed_at[i] += 1
                if i < r.accepted:
                    self.accepted_at[i] += 1
        if r.tree:
            self.n_tree_rounds += 1
            self.n_tree_nodes += r.drafted
            self.n_branch_wins += r.on_branch > 0
        self.last_round = r

    def merge(self, other: RunStats) -> None:
        """Add another run's numbers to this one (a chat session's running total)."""
        for name in (
            "n_prompt_tokens n_cached_tokens n_generated prompt_s wall_s draft_s verify_s sample_s n_rounds "
            "n_target_decodes n_drafted n_accepted n_drafted_rounds n_predicted n_prediction_followed n_tree_rounds n_tree_nodes "
            "n_branch_wins"
        ).split():
            setattr(self, name, getattr(self, name) + getattr(other, name))
        add_per_position(self.proposed_at, self.accepted_at, other)
        for k, v in other.by_source.items():
            mine = self.by_source.setdefault(k, [0, 0, 0])
            for i in range(3):
                mine[i] += v[i]
        self.draft_lengths.extend(other.draft_lengths)
        self.finish_reason = other.finish_reason
        self.last_round = other.last_round
        self.idle_reason = other.idle_reason

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_accept_len(self) -> float:
        """Draft tokens accepted per round that drafted anything."""
        return self.n_accepted / self.n_drafted_rounds if self.n_drafted_rounds else 0.0

    @property
    def tokens_per_decode(self) -> float:
        """Tokens per target decode: per verify (a round's one decode, a plain step's included)."""
        return self.n_generated / self.n_target_decodes if self.n_target_decodes else 0.0

    @property
    def branch_win_rate(self) -> float:
        """Of the rounds that verified a tree, the share a branch other than the first won."""
        return self.n_branch_wins / self.n_tree_rounds if self.n_tree_rounds else 0.0

    @property
    def accept_per_position(self) -> list[float]:
        return [a / p if p else 0.0 for p, a in zip(self.proposed_at, self.accepted_at)]

    @property
    def generation_tps(self) -> float:
        return self.n_generated / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.draft_s - self.verify_s - self.sample_s)

    @property
    def current_draft_len(self) -> int:
        return self.draft_lengths[-1] if self.draft_lengths else 0

    def to_json(self) -> dict:
        return {
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_cached_tokens": self.n_cached_tokens,
            "n_generated": self.n_generated,
            "prompt_tps": round(self.prompt_tps, 3),
            "generation_tps": round(self.generation_tps, 3),
            "n_drafted": self.n_drafted,
            "n_accepted": self.n_accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accept_len": round(self.mean_accept_len, 4),
            "tokens_per_decode": round(self.tokens_per_decode, 4),
            "accept_per_position": [round(x, 4) for x in self.accept_per_position],
            "n_rounds": self.n_rounds,
            "n_tree_rounds": self.n_tree_rounds,
            "n_tree_nodes": self.n_tree_nodes,
            "n_branch_wins": self.n_branch_wins,
            "branch_win_rate": round(self.branch_win_rate, 4),
            "by_source": {k: {"rounds": v[0], "drafted": v[1], "accepted": v[2]} for k, v in self.by_source.items()},
            "prompt_s": round(self.prompt_s, 6),
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "sample_s": round(self.sample_s, 6),
            "other_s": round(self.other_s, 6),
            "wall_s": round(self.wall_s, 6),
            "draft_lengths": self.draft_lengths,
            "finish_reason": self.finish_reason,
            "idle_reason": self.idle_reason,
        }
