"""A block drafter (DFlash, DSpark or DFlash2), given as the draft file (``-d drafter.gguf``), as a
draft source.

The backend (``llama.DFlashHead``) keeps the drafter's cache in step with the target's, and one
decode drafts a whole block: ``[last token, mask x k]``, k the round's planned draft length (at
most what the drafter was trained for), every row a draft. So its cost is one drafter decode
(the injection of a round's new target rows, then the block), whose time is measured at a few
block lengths and read off that curve: on a GPU the curve is flat and the price per drafted
token falls with k; on a CPU every row also pays for the target's output head, and a long block
can cost more than a target step. The block is read as the draft model's tokens are drafted
(``model.py``): its rows one after another, each with its confidence (the drafter's own where
it states one: DSpark's confidence head; else the row's softmax, over its top k where llama.cpp
sampled the rows), so the posteriors, the stop
rule and the learning are the draft model's. Sampling draws each draft from its row's logits
(DFlash2's: from the selector's scores given the draft before it), the law the engine's exact
acceptance is told.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from specrun.decode.round import Proposal, Round
from specrun.decode.sources.model import Autoregressive, _ewma

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
        self.n_draft = max(1, min(draft_max, head.max_draft))  # the longest block
        super().__init__(sampler, rng, n_vocab, cost, self.n_draft, ends_turn)
        self.head = head
        self._block: Block | None = None
        self._row = 0  # the block's row last handed out
        self._rows = self.n_draft  # the drafts the next block holds: the round's planned length
        # a block's seconds by the drafts it holds, measured (the lengths: 1, 2, 4, ... and the longest)
        self.sizes = np.array(sorted({*(2**i for i in range(8) if 2**i < self.n_draft), self.n_draft}), dtype=float)
        self.block_s: np.ndarray | None = None

    def begin(self, prompt: list[int], may_draft: Callable[[], bool]) -> None:
        """Time a block once in this process, at the end of the prompt (a stored time is only a
        prior); its first, discarded, also injects the prompt's rows, as a first draft would."""
        if not self.timed and self._fits(prompt):
            self.block_s = np.array([self.measure_block(prompt[-1], int(n)) for n in self.sizes])
            self.first_s = float(self.block_s[-1])
            self.per_token = 0.0
            self.timed = True

    def _fits(self, tokens: list[int]) -> bool:
        """Is the drafter in step with ``tokens``, with room for a block after them?"""
        pos = len(tokens) - 1
        return self.head.n_past == pos and pos + self.head.rows(self.n_draft) <= self.head.n_ctx

    def prepare(self, tokens: list[int], room: int, left: int) -> int:
        return max(0, min(room, self.n_draft, len(self.positions.bins))) if self._fits(tokens) else 0

    def cost(self, k: int | np.ndarray) -> float | np.ndarray:
        if self.block_s is None:  # before a block is timed (the prompt did not fit): as dear as a target's step
            return (self.first_s if self.first_s is not None else self.verify.verify_cost(1)) + 0.0 * np.asarray(k)
        out = np.interp(np.asarray(k, dtype=float), self.sizes, self.block_s)
        return float(out) if np.ndim(out) == 0 else out

    def propose(
        self, tokens: list[int], k: int, worth: float, offered: int = 0, verify: Sequence[float] = (),
        rival: Callable[[list[int]], float] | None = None,
    ) -> Proposal:  # fmt: skip
        """A block of the round's planned length ``k`` (priced at that length): the stop rule may
        read fewer of its rows, never more."""
        self._rows = max(1, min(k, self.n_draft))
        return super().propose(tokens, k, worth, 0, verify, rival)

    def observe(self, outcome: Round) -> None:
        """Learn the rates as the draft model does, and move the block curve by what this round's
        block took against what the curve said (one factor for every length: the injection, the
        machine's load)."""
        super().observe(outcome)
        p = outcome.proposal
        if outcome.source == self.name and p.tokens and not p.caught_up and self.block_s is not None and p.first_s > 0:
            said = float(np.interp(self._rows, self.sizes, self.block_s))
            self.block_s = self.block_s * (_ewma(said, p.first_s) / said)

    def _start(self, tokens: list[int]) -> tuple[np.ndarray | None, float, int]:
        if not self._fits(tokens):
            return None, 0.0, 0
        queued = self.head.n_past - self.head.injected
        before = self.head.inject_s
        self._block = self.head.draft(tokens[-1], len(tokens) - 1, self._rows)
        self._row = 0
        # more than a verify's rows queued (other sources drafted meanwhile, or a prompt): their
        # injection is a catch-up, not the price of this round's block
        sync = self.head.inject_s - before if queued > self._rows + 1 else 0.0
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
        if b is not None and b.sampled:  # the softmax over the row's top k, from those k alone
            return b.confidence(i)
        return super()._confidence(i, row, x)

    def token_cost(self) -> float:
        return self.per_token or 0.0

    def measure_block(self, token: int, n: int) -> float:
        """Seconds for one decode of a block of ``n`` drafts at the end of the sequence (best of
        three, after a warm-up, which also injects what is queued)."""
        best = float("inf")
        for i in range(4):
            t = time.perf_counter()
            self.head.draft(token, self.head.n_past, n)
            if i:
                best = min(best, time.perf_counter() - t)
        return best

    def rollback(self, keep: int) -> None:
        pass  # the drafter follows the target's own rollback
