"""Draft sources, one module each, and the one table that names them.

Adding a source is a module with a class that fits ``base.Source`` and one line in ``MAKERS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specrun.decode.round import History, Prediction
from specrun.decode.sources.base import Source
from specrun.decode.sources.dflash import DFlashSource
from specrun.decode.sources.eagle3 import Eagle3Source
from specrun.decode.sources.model import ModelSource
from specrun.decode.sources.mtp import MtpSource
from specrun.decode.sources.ngram import NgramSource
from specrun.decode.sources.prediction import PredictionSource
from specrun.decode.sources.suffix import CorpusSource, SuffixSource

if TYPE_CHECKING:
    import numpy as np

    from specrun.decode.costs import CostModel
    from specrun.decode.sampling import Sampler
    from specrun.llama import DFlashHead, Eagle3Head, Model, MtpHeads

__all__ = [
    "CorpusSource", "DFlashSource", "Eagle3Source", "ModelSource", "MtpSource", "NgramSource", "PredictionSource", "Source", "SuffixSource", "build",
]  # fmt: skip


@dataclass(frozen=True)
class SourceInputs:
    """What a source may be made from."""

    target: Model
    draft: Model | None
    heads: MtpHeads | None
    eagle3: Eagle3Head | None
    dflash: DFlashHead | None
    sampler: Sampler
    rng: np.random.Generator
    cost: CostModel
    draft_max: int
    ngram: tuple[int, int]
    prediction: Prediction = field(default_factory=Prediction)  # the reply's, set by the engine before each
    history: History = field(default_factory=History)  # ... and the earlier replies and corpus it may draft from


def _ends_line(m: SourceInputs) -> Callable[[int], bool]:
    """Does a token's text hold a line break? (the copy sources price a new line apart)"""
    return lambda t: b"\n" in m.target.piece(t)


# name -> how to make it (None: not possible with what is at hand)
MAKERS: dict[str, Callable[[SourceInputs], Source | None]] = {
    "ngram": lambda m: NgramSource(*m.ngram, ends_line=_ends_line(m), ends_turn=m.target.is_eog),
    "prediction": lambda m: PredictionSource(m.prediction, *m.ngram, ends_line=_ends_line(m), ends_turn=m.target.is_eog),
    "suffix": lambda m: SuffixSource(m.history, ends_turn=m.target.is_eog),
    "corpus": lambda m: CorpusSource(m.history, ends_turn=m.target.is_eog),
    "model": lambda m: ModelSource(m.draft, m.sampler, m.rng, m.target.n_vocab, m.cost, m.draft_max, m.target.is_eog) if m.draft else None,
    "mtp": lambda m: MtpSource(m.heads, m.sampler, m.rng, m.target.n_vocab, m.cost, m.draft_max, m.target.is_eog) if m.heads else None,
    "eagle3": lambda m: (
        Eagle3Source(m.eagle3, m.sampler, m.rng, m.target.n_vocab, m.cost, m.draft_max, m.target.is_eog) if m.eagle3 else None
    ),
    "dflash": lambda m: (
        DFlashSource(m.dflash, m.sampler, m.rng, m.target.n_vocab, m.cost, m.draft_max, m.target.is_eog) if m.dflash else None
    ),
}


def build(names: list[str], inputs: SourceInputs) -> dict[str, Source]:
    """The sources named that can be made (in the order given)."""
    made = {name: MAKERS[name](inputs) for name in names}
    return {name: s for name, s in made.items() if s is not None}
