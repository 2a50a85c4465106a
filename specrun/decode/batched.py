"""A verify's price when it rides in a batch with other sequences' rows.

With several sequences decoding together (``specrun serve --parallel``), one ``llama_decode``
carries every active sequence's pending token and drafts. The batch costs c(o + K + 1) for the
o rows the others bring plus this sequence's K + 1; without this sequence's rows it would have
cost c(o). So the chooser is asked for the marginal cost

    c'(b) = c(o + b) - c(o)        (c itself when the sequence runs alone, o = 0)

where o is what the others put in the last batch this sequence rode in. On a flat (memory-bound)
stretch of the curve extra rows are nearly free and drafting pays as it does alone; once the
batch is large enough for c to grow with every row, c'(K + 1) approaches K + 1 times c'(1) and
drafting stops by itself, with no threshold on the number of clients.

What the sequence observes goes into the shared curve at the batch's real size: a verify of
K + 1 rows in a batch of B rows took c(B) seconds. The sequences run in threads of their own, so
every use of the shared curve holds one lock (its estimates iterate dicts another thread's
observation may grow).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from specrun.decode.costs import CostModel

__all__ = ["BatchCost", "Rows"]

MIN_SHARE = 1e-3  # a marginal cost never below this share of c(1): the rows are never quite free


class Rows(Protocol):
    """What a sequence knows of the last batch it rode in (llama.Sequence)."""

    batch_rows: int  # every row in it, this sequence's own included
    own_rows: int  # this sequence's


class BatchCost:
    """The shared CostModel as one sequence of a batch sees it (everything not priced here is
    the shared model's own)."""

    def __init__(self, shared: CostModel, rows: Rows, lock: threading.RLock):
        """``lock``: the one every BatchCost over ``shared`` holds."""
        self.shared, self.rows, self.lock = shared, rows, lock

    def __getattr__(self, name: str) -> Any:
        got = getattr(self.shared, name)
        if not callable(got):
            return got

        @functools.wraps(got)
        def locked(*args, **kw):
            with self.lock:
                return got(*args, **kw)

        return locked

    @property
    def others(self) -> int:
        return max(0, self.rows.batch_rows - self.rows.own_rows)

    def _marginal(self, curve: Callable[[int], np.ndarray], n: int) -> np.ndarray:
        """c(1..n) as this sequence's rows add to a batch of ``others`` rows: c(o + b) - c(o),
        never below MIN_SHARE of one step."""
        with self.lock:
            o = self.others
            c = curve(o + n)
            if o == 0:
                return c
            return np.maximum(MIN_SHARE * c[0], c[o:] - c[o - 1])

    def table(self, n: int) -> np.ndarray:
        return self._marginal(self.shared.table, n)

    def verify_cost(self, b: int) -> float:
        return float(self.table(b)[b - 1])

    def optimistic(self, n: int) -> np.ndarray:
        return self._marginal(self.shared.optimistic, n)

    def drawn(self, rng, n: int) -> np.ndarray:
        return self._marginal(lambda m: self.shared.drawn(rng, m), n)

    def observe_verify(self, b: int, seconds: float) -> None:
        """A verify of ``b`` rows took ``seconds``: the time of the whole batch it rode in."""
        with self.lock:
            self.shared.observe_verify(max(b, self.rows.batch_rows), seconds)
