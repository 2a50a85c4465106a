"""Draft sources, one module each, and the one list that names them.

Adding a source is a module with a class that fits ``base.Source`` and one line in ``build``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Outcome, Source
from .model import ModelSource
from .ngram import NgramSource

if TYPE_CHECKING:
    import numpy as np

    from ..backend import Model
    from ..costs import CostModel
    from ..sampling import Sampler

__all__ = ["ModelSource", "NgramSource", "Outcome", "Source", "build"]


def build(
    names: list[str],
    *,
    target: Model,
    draft: Model | None,
    sampler: Sampler,
    rng: np.random.Generator,
    cost: CostModel,
    k_max: int,
    ngram: tuple[int, int],
) -> dict[str, Source]:
    """The sources named (in the order given), each made from what it needs."""
    made: dict[str, Source] = {}
    for name in names:
        if name == "ngram":
            made[name] = NgramSource(*ngram)
        elif name == "model" and draft is not None:
            made[name] = ModelSource(draft, sampler, rng, target.n_vocab, cost, k_max)
    return made
