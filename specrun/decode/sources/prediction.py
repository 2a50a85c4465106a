"""The prediction source: the text a client expects the reply to be (OpenAI's Predicted Outputs).

A coding agent that asks for an edit of a file knows most of the reply already: the file, as it
is. It sends it as a prediction, and the reply follows it with edits: lines inserted, lines
deleted, names replaced. That is what the n-gram lookup's copies already handle over the
sequence itself (``NgramDrafter``: a copy goes on while the reply follows it, learns a
replacement, resumes where it broke after an insertion, finds its place again by lookup after
a deletion), so this source is the n-gram source given a reference to copy from instead of the
sequence: the prediction, opened by the prompt's last tokens, so that the reply's first tokens
are offered the prediction's first (the prediction is the reply that follows this prompt).

It is a source of its own, not extra reference tokens for the n-gram source, for three reasons:
how often a prediction's copies go on is its own question (a client's prediction of this reply,
against the context's repetitions, which in chat rarely go on), so it keeps copy-rate posteriors
of its own, learned as the n-gram source learns them (every round scores the copy on offer,
drafted or not); its drafts are told apart in the statistics; and the chooser then weighs it
against the others like any source, a prediction that keeps missing drafting no more than it
pays. An n-gram copy of the prompt that holds the same file stays on offer beside it.

What the reply followed of the prediction is counted for OpenAI's ``usage``: each prediction
token the target wrote where the prediction's copy had it, once, whichever source drafted it
(this one, another, or none: a plain step). That is ``Prediction.followed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specrun.decode.round import Prediction, Proposal, Round
from specrun.decode.sources.ngram import MATCH_CAP, NgramSource


class PredictionSource(NgramSource):
    """Copies of the reply's prediction, with the n-gram source's edits, resumes and rates."""

    name = "prediction"

    def __init__(
        self,
        prediction: Prediction,
        n_min: int = 2,
        n_max: int = 6,
        ends_line: Callable[[int], bool] | None = None,
        ends_turn: Callable[[int], bool] | None = None,
    ):
        """``prediction``: the engine's record of the reply's prediction (read at each ``begin``);
        the rest as for the n-gram source."""
        super().__init__(n_min, n_max, ends_line, ends_turn)
        self.prediction = prediction
        self.anchor = 0  # the reference's first tokens, the prompt's last: context, not copied
        self.hit = bytearray()  # per prediction token: did the reply write it where the prediction had it?

    def begin(self, prompt: list[int], may_draft: Callable[[], bool]) -> None:
        super().begin(prompt, may_draft)
        predicted = list(self.prediction.tokens)
        # the prompt's last tokens, as many as a copy's match is ever counted back: the reply's
        # start matches the prediction's start further back than anything inside it could
        anchor = prompt[-MATCH_CAP:] if predicted else []
        self.anchor = len(anchor)
        self.drafter.refer(anchor + predicted, self.anchor)
        self.hit = bytearray(len(predicted))
        self.prediction.followed = 0

    def prepare(self, tokens: list[int], room: int, left: int) -> int:
        if not self.hit:  # no prediction for this reply
            self.offer = Proposal()
            return 0
        # the copy is looked up one token further than it is offered: the round scores the copy
        # on offer, so the token the target writes after the drafts (or with no room at all, at a
        # budget's last) is counted as followed or not, as every other
        return min(super().prepare(tokens, room + 1, left), room)

    def peek(self, seq: list[int], room: int) -> list[float]:
        return super().peek(seq, room) if self.hit else []

    def observe(self, outcome: Round) -> None:
        if self.hit:
            super().observe(outcome)

    def _followed(self, start: int, written: Sequence[int]) -> None:
        reference = self.drafter.reference or []
        for i, t in enumerate(written, start):
            if (
                self.anchor <= i < len(reference) and reference[i] == t and not self.hit[i - self.anchor]
            ):  # (an edit is not the prediction's)
                self.hit[i - self.anchor] = 1
                self.prediction.followed += 1
