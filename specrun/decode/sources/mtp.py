"""MTP heads as a draft source: the target's own (``llama.MtpHeads``), or Gemma 4's, which come
in a file of their own (``llama.Gemma4Assistant``).

Nothing to load and nothing to catch up: the backend keeps the heads' cache in step with the
target's (every target decode queues its tokens and hidden states for them, the first draft
step feeds the queue, every rollback rolls them back too). Each guess is one head step: the
first from the target's pending token and its last hidden state, each next one from the
previous guess and the head's own state. Several heads run as a chain (guess i is head i's,
over the whole draft so far), so a draft is at most as long as the heads are many. Posteriors,
stop rule and learning are the draft model's (``model.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from specrun.decode.sampling import Sampler
from specrun.decode.sources.model import Autoregressive

if TYPE_CHECKING:
    from specrun.decode.costs import CostModel
    from specrun.llama import DraftHead


class MtpSource(Autoregressive):
    name = "mtp"

    def __init__(
        self,
        heads: DraftHead,
        sampler: Sampler,
        rng: np.random.Generator,
        n_vocab: int,
        cost: CostModel,
        draft_max: int,
        ends_turn: Callable[[int], bool] | None = None,
    ):
        super().__init__(sampler, rng, n_vocab, cost, min(draft_max, heads.max_draft or draft_max), ends_turn)
        self.heads = heads

    def begin(self, prompt: list[int], may_draft: Callable[[], bool]) -> None:
        """The heads follow the target's own prefill; time a head step once in this process."""
        if not self.timed and self.heads.n_past == len(prompt) - 1:
            self.retime(self.measure_token_cost(prompt[-1]))
            self.timed = True

    def prepare(self, tokens: list[int], room: int, left: int) -> int:
        return max(0, min(room, self.heads.n_ctx - len(tokens), len(self.positions.bins)))

    def _start(self, tokens: list[int]) -> tuple[np.ndarray | None, float, int]:
        if self.heads.n_past != len(tokens) - 1:  # out of step with the sequence: no guess
            return None, 0.0, 0
        return self.heads.draft_step(tokens[-1]), 0.0, 0

    def _step(self, x: int) -> np.ndarray:
        return self.heads.draft_step(x)

    def _end(self) -> None:
        self.heads.end_draft()

    def measure_token_cost(self, token: int) -> float:
        """Seconds for one head step past the cache, then undone (best of five, after a warm-up)."""
        best = float("inf")
        for i in range(6):
            t = time.perf_counter()
            self.heads.draft_step(token)
            if i:
                best = min(best, time.perf_counter() - t)
            self.heads.end_draft()
        return best

    def rollback(self, keep: int) -> None:
        pass  # the heads follow the target's own rollback
