"""A block drafter (DFlash, DSpark or DFlash2), given as the draft file (``-d drafter.gguf``), as a
draft source.

The backend (``llama.DFlashHead``) keeps the drafter's cache in step with the target's, and one
decode drafts a whole block: ``[last token, mask x n]``, n fixed for the run (the most this
source offers, up to what the drafter was trained for), every row a draft. So its cost is one
drafter decode whatever K is (the injection of a round's new target rows, then the block), and
its price per drafted token falls with K; reading one more row of the block costs next to
nothing (measured, as the draft model's steps are). The block is read as the draft model's
tokens are drafted (``model.py``): its rows one after another, each with its confidence (the
drafter's own where it states one: DSpark's confidence head; else the row's softmax), so the
posteriors, the stop rule and the learning are the draft model's. Sampling draws each draft
from its row's logits (DFlash2's: from the selector's scores given the draft before it), the
law the engine's exact acceptance is told.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from specrun.decode.sources.model import Autoregressive

if TYPE_CHECKING:
    from specrun.decode.costs import CostModel
    from specrun.decode.sampling import Sampler
    from specrun.llama import Block, DFlashHead


class DFlashSource(Autoregressive):
    name = "dflash"

    def __init__(
        self,
        head: DFlashHead,
        sampler: Sampler,
        rng: np.random.Generator,
        n_vocab: int,
        cost: CostModel,
        draft_max: int,
        ends_turn: Callable[[int], bool] | None = None,
    ):
        self.n_draft = max(1, min(draft_max, head.max_draft))  # every block drafts this many
        super().__init__(sampler, rng, n_vocab, cost, self.n_draft, ends_turn)
        self.head = head
        self._block: Block | None = None
        self._row = 0  # the block's row last handed out

    def begin(self, prompt: list[int], may_draft: Callable[[], bool]) -> None:
        """Time a block once in this process, at the end of the prompt (a stored time is only a
        prior); its first, discarded, also injects the prompt's rows, as a first draft would."""
        if not self.timed and self._fits(prompt):
            self.first_s = self.measure_block(prompt[-1])
            self.per_token = self.per_token or 0.0
            self.timed = True

    def _fits(self, tokens: list[int]) -> bool:
        """Is the drafter in step with ``tokens``, with room for a block after them?"""
        pos = len(tokens) - 1
        return self.head.n_past == pos and pos + self.head.rows(self.n_draft) <= self.head.n_ctx

    def prepare(self, tokens: list[int], room: int, left: int) -> int:
        return max(0, min(room, self.n_draft, len(self.positions.bins))) if self._fits(tokens) else 0

    def cost(self, k: int | np.ndarray) -> float | np.ndarray:
        # before a block is timed (the prompt did not fit): as dear as a target's step
        block = self.first_s if self.first_s is not None else self.verify.verify_cost(1)
        return block + (k - 1) * (self.per_token or 0.0)

    def _start(self, tokens: list[int]) -> tuple[np.ndarray | None, float, int]:
        if not self._fits(tokens):
            return None, 0.0, 0
        queued = self.head.n_past - self.head.injected
        before = self.head.inject_s
        self._block = self.head.draft(tokens[-1], len(tokens) - 1, self.n_draft)
        self._row = 0
        # more than a verify's rows queued (other sources drafted meanwhile, or a prompt): their
        # injection is a catch-up, not the price of this round's block
        sync = self.head.inject_s - before if queued > self.n_draft + 1 else 0.0
        return self._block.row(0), sync, 0

    def _step(self, x: int) -> np.ndarray:
        assert self._block is not None
        self._row += 1
        return self._block.row(self._row, x)

    def _end(self) -> None:
        self._block = None

    def _confidence(self, i: int, row: np.ndarray, x: int) -> float:
        b = self._block
        if b is not None and b.stated is not None and self.head.confidence_head:  # DSpark's confidence head
            return b.stated[i]
        return super()._confidence(i, row, x)

    def token_cost(self) -> float:
        return self.per_token or 0.0

    def measure_block(self, token: int) -> float:
        """Seconds for one block decode at the end of the sequence (best of three, after a
        warm-up, which also injects what is queued)."""
        best = float("inf")
        for i in range(4):
            t = time.perf_counter()
            self.head.draft(token, self.head.n_past, self.n_draft)
            if i:
                best = min(best, time.perf_counter() - t)
        return best

    def rollback(self, keep: int) -> None:
        pass  # the drafter follows the target's own rollback
