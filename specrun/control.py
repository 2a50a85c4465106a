"""The adaptive controller: measured costs and acceptance in, the next round's plan out.

Each round it picks a draft source (the model, the n-gram lookup or none) and a draft length
K that maximise the expected tokens per second::

    E[tokens | K] = 1 + sum_{i=1..K} prod_{j<=i} a_j          (a_j: acceptance at position j,
                                                               given positions < j were accepted)
    T(K)          = c(K + 1) + K * d                           (c(b): the target's measured time
                                                               to verify a batch of b tokens;
                                                               d: draft time per token, 0 for n-grams)
    rate(K)       = E[tokens | K] / T(K),    K = 0 (plain decoding) gives 1 / c(1)

``c`` is a measured curve, not a formula: on a CPU four tokens cost ~2.4 single steps but
sixteen verify faster than twelve (a GEMM path takes over); on a GPU c is nearly flat. It is
calibrated once per target and machine (and stored), then refined online with every round,
as are ``d`` and the ``a_j`` (exponential moving averages). N-gram runs that continue a span
just accepted have their own acceptance table: they are far more reliable than fresh matches.

p-split (the model drafter stops when its top-token probability falls below it) is set to
the lowest confidence at which a draft token still pays: a draft token of confidence c is
worth proposing if acc(c) * c(1) > d + (c(K + 2) - c(K + 1)), with acc(c) measured per
confidence bin.

K = 0 is a valid outcome. A source not chosen for a while is probed with a short draft, at an
interval that doubles after each probe that does not win (16 rounds up to 256), in case
things change. The draft model is only drafted or probed while it *could* pay: with an
optimistic acceptance (``max(0.9, measured)`` at every position) its best rate must beat
plain decoding by 5%. Where verifying is nearly as dear per token as decoding and the draft
costs half the target (a CPU), it cannot, so it is never run and its cache never has to
catch up; on a GPU it easily can.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

EWMA = 0.15
OPTIMISTIC_ACCEPTANCE = 0.9
MODEL_MARGIN = 1.05
PROBE_MIN, PROBE_MAX = 16, 256
CONF_BINS = 10


@dataclass(frozen=True)
class Plan:
    source: str  # "model", "ngram" or "none"
    k: int
    p_split: float = 0.0
    probe: bool = False


@dataclass
class CostModel:
    """Seconds per target decode by batch size, and per draft-model token."""

    verify: dict[int, float] = field(default_factory=dict)
    draft_per_token: float | None = None

    def verify_cost(self, b: int) -> float:
        """Measured, or linearly interpolated between measured sizes (flat beyond the ends)."""
        if b in self.verify:
            return self.verify[b]
        sizes = sorted(self.verify)
        if not sizes:
            return float(b)  # no data at all: assume cost grows with the batch
        if b <= sizes[0]:
            return self.verify[sizes[0]] * b / sizes[0]
        if b >= sizes[-1]:
            return self.verify[sizes[-1]] * b / sizes[-1]
        for lo, hi in zip(sizes, sizes[1:]):
            if lo < b < hi:
                w = (b - lo) / (hi - lo)
                return self.verify[lo] * (1 - w) + self.verify[hi] * w
        return self.verify[sizes[-1]]  # pragma: no cover

    def observe_verify(self, b: int, seconds: float) -> None:
        old = self.verify.get(b)
        self.verify[b] = seconds if old is None else old + EWMA * (seconds - old)

    def observe_draft(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 0:
            return
        per = seconds / n_tokens
        old = self.draft_per_token
        self.draft_per_token = per if old is None else old + EWMA * (per - old)

    def to_json(self) -> dict:
        return {"verify": {str(k): v for k, v in sorted(self.verify.items())}, "draft_per_token": self.draft_per_token}

    @classmethod
    def from_json(cls, d: dict) -> CostModel:
        return cls({int(k): float(v) for k, v in d.get("verify", {}).items()}, d.get("draft_per_token"))


class CostStore:
    """Cost models kept between runs in a JSON file, keyed by model, threads and placement."""

    def __init__(self, path: Path | None):
        self.path = path

    def load(self, key: str) -> CostModel | None:
        if not self.path or not self.path.exists():
            return None
        try:
            d = json.loads(self.path.read_text()).get(key)
            return CostModel.from_json(d) if d else None
        except (OSError, ValueError, AttributeError):
            return None  # a damaged cache is just a cold start

    def save(self, key: str, cost: CostModel) -> None:
        if not self.path:
            return
        try:
            data = json.loads(self.path.read_text()) if self.path.exists() else {}
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        data[key] = cost.to_json()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.path)
        except OSError:
            pass


def expected_tokens(acc: list[float], k: int) -> float:
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= acc[i]
        total += reach
    return total


class Controller:
    def __init__(
        self,
        sources: list[str],
        *,
        draft_min: int,
        draft_max: int,
        p_split: float,
        fixed: bool,
        cost: CostModel,
    ):
        self.sources = sources  # drafters available, in preference order for fixed mode
        self.draft_min = draft_min
        self.draft_max = draft_max
        self.fixed = fixed
        self.cost = cost
        self.p_split = p_split
        self.acc = {
            "model": [0.7] * draft_max,
            "ngram": [0.4] * draft_max,
            "ngram+": [0.7] * draft_max,  # continuing an accepted span
        }
        self.seen = {t: [0] * draft_max for t in self.acc}  # observations per position
        self.conf_acc = [0.5 + 0.05 * i for i in range(CONF_BINS)]  # acceptance by confidence bin
        self.idle = {s: 0 for s in sources}  # rounds since a source was last used
        self.probe_every = {s: PROBE_MIN for s in sources}
        self.probing: str | None = None

    # --- planning ------------------------------------------------------------------

    def _draft_cost(self, source: str) -> float:
        if source != "model":
            return 0.0
        d = self.cost.draft_per_token
        return d if d is not None else 0.5 * self.cost.verify_cost(1)

    def best_k(self, table: str, source: str, k_max: int) -> tuple[int, float]:
        """The K in {0} U [draft_min, k_max] with the highest expected rate, and that rate."""
        best_k, best_rate = 0, 1.0 / self.cost.verify_cost(1)
        acc, d = self.acceptance(table), self._draft_cost(source)
        total, reach = 1.0, 1.0
        for k in range(1, k_max + 1):
            reach *= acc[k - 1]
            total += reach
            if k < self.draft_min:
                continue
            rate = total / (self.cost.verify_cost(k + 1) + k * d)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def acceptance(self, table: str) -> list[float]:
        """Per-position acceptance; a position never drafted takes the estimate of the last
        one that was, so good news at position 2 lets the controller try position 3."""
        est, seen = self.acc[table], self.seen[table]
        out, last = [], None
        for a, n in zip(est, seen):
            last = a if n or last is None else last
            out.append(last)
        return out

    def plan(self, ngram_available: int = 0, ngram_continued: bool = False, room: int | None = None) -> Plan:
        """Choose the next round. ``ngram_available``: length of the n-gram proposal on offer;
        ``room``: how many draft tokens the context and the token budget still allow."""
        k_cap = self.draft_max if room is None else max(0, min(self.draft_max, room))
        lengths = {"model": k_cap, "ngram": min(ngram_available, k_cap), "none": 0}
        usable = [s for s in self.sources if lengths.get(s, 0) >= max(1, self.draft_min)]
        if not self.fixed and "model" in usable and not self.model_can_pay(lengths["model"]):
            usable.remove("model")
        if self.fixed:
            if not usable:
                return Plan("none", 0)
            s = usable[0]
            return Plan(s, lengths[s], self.p_split if s == "model" else 0.0)

        for s in self.sources:
            self.idle[s] += 1
        best = Plan("none", 0)
        best_rate = 1.0 / self.cost.verify_cost(1)
        for s in usable:
            table = "ngram+" if s == "ngram" and ngram_continued else s
            k, rate = self.best_k(table, s, lengths[s])
            if k and rate > best_rate:
                best, best_rate = Plan(s, k, self._p_split(k)), rate
        if best.source == "none" or any(self.idle[s] > self.probe_every[s] for s in usable):
            for s in usable:
                if s != best.source and self.idle[s] > self.probe_every[s]:
                    self.probe_every[s] = min(PROBE_MAX, self.probe_every[s] * 2)
                    k = min(lengths[s], max(self.draft_min, 2))
                    best = Plan(s, k, self._p_split(k), probe=True)
                    break
        if best.source in self.idle:
            self.idle[best.source] = 0
        return best

    def model_can_pay(self, k_max: int) -> bool:
        """Could the draft model beat plain decoding by MODEL_MARGIN with optimistic acceptance?"""
        saved = self.acc["model"]
        self.acc["model"] = [max(OPTIMISTIC_ACCEPTANCE, a) for a in saved]
        try:
            k, rate = self.best_k("model", "model", k_max)
        finally:
            self.acc["model"] = saved
        return k > 0 and rate > MODEL_MARGIN / self.cost.verify_cost(1)

    def _p_split(self, k: int) -> float:
        """The lowest confidence whose measured acceptance still pays for the extra token."""
        c1 = self.cost.verify_cost(1)
        marginal = self._draft_cost("model") + self.cost.verify_cost(k + 2) - self.cost.verify_cost(k + 1)
        threshold = min(0.95, max(0.0, marginal / c1))
        for b in range(CONF_BINS):
            if all(a >= threshold for a in self.conf_acc[b:]):
                return b / CONF_BINS
        return 1.0

    # --- learning -----------------------------------------------------------------

    def observe(
        self,
        plan: Plan,
        drafted: int,
        accepted: int,
        verify_s: float,
        draft_s: float,
        confidences: list[float] | None = None,
        continued: bool = False,
    ) -> None:
        self.cost.observe_verify(drafted + 1, verify_s)
        if plan.source == "model" and drafted:
            self.cost.observe_draft(drafted, draft_s)
        if not drafted:
            return
        name = "ngram+" if plan.source == "ngram" and continued else plan.source
        table, seen = self.acc[name], self.seen[name]
        # positions 0..accepted-1 were accepted; position `accepted` (if drafted) was rejected
        for i in range(min(drafted, accepted + 1)):
            hit = 1.0 if i < accepted else 0.0
            if not seen[i]:  # first look at this position: start from what the one before knows
                table[i] = self.acceptance(name)[i]
            seen[i] += 1
            table[i] += EWMA * (hit - table[i])
            if confidences and i < len(confidences):
                b = min(CONF_BINS - 1, int(confidences[i] * CONF_BINS))
                self.conf_acc[b] += EWMA * (hit - self.conf_acc[b])
        if plan.probe:
            # a probe that paid for itself resets its source's probing interval
            k_rate = expected_tokens(self.acceptance(name), drafted) / (verify_s + draft_s)
            if k_rate > 1.0 / self.cost.verify_cost(1):
                self.probe_every[plan.source] = PROBE_MIN


def calibrate(measure, sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), repeats: int = 2) -> CostModel:
    """Build a cost model from ``measure(b) -> seconds`` for each batch size (best of repeats)."""
    cost = CostModel()
    for b in sizes:
        cost.verify[b] = min(measure(b) for _ in range(repeats))
    return cost


def now() -> float:
    return time.perf_counter()
