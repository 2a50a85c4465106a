"""What a round costs on this machine, measured, healed online, and kept between runs.

The verify curve ``c(b)`` is the target's time to decode a batch of ``b`` tokens. It starts
from a reference (calibrated at the first run on a machine, or stored by an earlier one) and
every round refines it:

* a size verified in this process has its own estimate: the mean time of its rounds so far (the
  first one replaces a stored value, which was only a prior), then an average that forgets at
  ``EWMA`` a round, so the curve follows a machine that got slower as readily as one that got
  quicker. Throughput is tokens over *mean* time, so the mean is what is estimated, not the
  quickest round; a round far slower (a page fault) moves it a bounded step;
* a size not yet verified in this process follows the reference, scaled by how far the sizes
  that were verified have moved from it (interpolated between the nearest ones), and is never
  dearer than a larger batch that was. A stored curve that has drifted, or was measured on a
  busy machine, heals from the sizes in use. A size not verified is stored as the reference said,
  or as the estimate where that is less (noise only adds time), so one slow round moves no size
  but its own in later runs, while a reference found too dear heals for the next run too;
* where the sizes verified moved from the reference each its own way (``shape_doubt``), a size
  between two of them costs no more than the straight line between them;
* a batch of ``b`` never costs more than ``b`` single steps, nor (``optimistic``) less than a
  smaller batch verified in this process;
* ``drawn(rng)`` is one draw of the whole curve from its posterior, on a log scale, all
  sizes moved by one common factor, each by its own spread: a size the reference measured is as
  sure as one round of it (how far the machine drifted since is read off the sizes verified in
  this process, and the shape of a curve measured on this machine holds), and each round
  verified narrows its spread as a mean of noisy timings does. Where the sizes verified moved
  from the reference each its own way, beyond one round's noise, its shape is in doubt, and every
  size not verified is doubted by as much (``shape_doubt``). How far one round strays from its
  size's mean is itself measured: the pooled spread of the rounds of every size timed more than
  once (the calibration's repeats, then this process's rounds, and stored for the next run), with
  ``NOISE_SIGMA`` as its prior. A size nothing ever measured (longer than the reference's
  longest) may be off by a factor of two (``COST_SIGMA``).
  The chooser acts on such draws, so a longer draft that the curve may wrongly price out gets
  tried now and then, and heals the curve once it is, while one it measured dear is not retried
  in every new process.

Rolling back a rejected draft is free on an attention cache but not on a recurrent state
restored from a checkpoint, so its measured time per rejected round (``rollback_s``) is a cost too.

A calibration that ran while the machine was busy (``c(1)`` before and after disagree, one
size's repeats disagree, or other processes used the CPU) is used for the run that made it but
never stored. Stored entries carry their date and the conditions they were measured under,
(``learned.py``).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import psutil

EWMA = 0.15  # once a size has this many rounds' worth of timings (1 / EWMA), each new round moves
# its estimate this far (trades: following a machine whose speed changed, against noise moving
# the curve)
COST_SIGMA = 0.7  # log-spread of a cost no measurement covers (longer than any size the reference
# or this process measured): a factor of two either way is plausible (trades: finding out fast
# that a long batch is cheap, against trying sizes that are as dear as they look)
NOISE_SIGMA = 0.2  # the prior for the log-spread of one round's time around its size's mean (then
# measured; the prior counts as one round) on a shared machine:
# how much one verified round says (trades: trusting a few rounds, against re-trying a size
# whose cost is already known)
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 64)  # 64: the longest verify (--draft-max 63)

# a calibration is disturbed when...
C1_DRIFT = 1.3  # c(1) before and after differ by more than this factor
SPREAD = 2.0  # one size's repeats differ by more than this factor
MIN_ABS_S = 0.001  # (and by more than this many seconds: tiny models time at noise level)
OTHERS_CPU = 0.3  # other processes used more than this many cores on average


def now() -> float:
    return time.perf_counter()


def _interp(points: dict[int, float], b: np.ndarray) -> np.ndarray | None:
    """Piecewise-linear through ``points`` at each of ``b``; in proportion to the batch beyond
    the ends."""
    if not points:
        return None
    xs = np.array(sorted(points), dtype=float)
    ys = np.array([points[int(x)] for x in xs])
    out = np.interp(b, xs, ys)
    out = np.where(b < xs[0], ys[0] * b / xs[0], out)
    return np.where(b > xs[-1], ys[-1] * b / xs[-1], out)


def _after_rounds(rounds: np.ndarray, noise: float) -> np.ndarray:
    """The log-spread of a size's cost once ``rounds`` rounds of it were timed, each with
    log-spread ``noise``: a guess (``COST_SIGMA``) narrowed by each round as a mean of noisy
    timings is."""
    return 1.0 / np.sqrt(1.0 / COST_SIGMA**2 + rounds / noise**2)


def _interpolated(spread: np.ndarray, known: np.ndarray) -> np.ndarray:
    """``spread`` where ``known``; between two known sizes the larger of theirs; ``COST_SIGMA``
    beyond them."""
    if not known.any():
        return np.full(len(spread), COST_SIGMA)
    sizes = np.flatnonzero(known)
    i = np.arange(len(spread))
    lo = np.searchsorted(sizes, i, side="right") - 1  # the nearest known size at or below each
    hi = np.searchsorted(sizes, i, side="left")  # ... and at or above
    inside = (lo >= 0) & (hi < len(sizes))
    between = np.maximum(spread[sizes[np.maximum(lo, 0)]], spread[sizes[np.minimum(hi, len(sizes) - 1)]])
    return np.where(known, spread, np.where(inside, between, COST_SIGMA))


def stored_noise(value: Any) -> tuple[float, float] | None:
    """A stored pooled spread (squared log deviations, and the rounds they rest on), if it is one."""
    if isinstance(value, list) and len(value) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in value):
        return float(value[0]), float(value[1])
    return None


def _by_size(values: Mapping[int, float], n: int, missing: float = np.nan) -> np.ndarray:
    """``values`` by batch size as an array over sizes 1..n (index b - 1), ``missing`` elsewhere."""
    out = np.full(n, missing)
    for b, v in values.items():
        if b <= n:
            out[b - 1] = v
    return out


@dataclass
class CostModel:
    """Seconds per target decode by batch size, and per draft-model token."""

    verify: dict[int, float] = field(default_factory=dict)  # the reference curve (calibrated or stored)
    seen: dict[int, float] = field(default_factory=dict)  # sizes verified in this process: their estimates
    n_seen: dict[int, int] = field(default_factory=dict)  # ... and how many rounds each estimate rests on
    rollback_s: float = 0.0  # rolling back a rejected draft (a recurrent state's restore and replay)
    # the largest logit difference seen between a batch's first row and a one-token decode at the
    # same position (llama.cpp's batched and one-token kernels add up in different orders)
    kernel_gap: float | None = None
    provisional: bool = False  # measured on a busy machine: used for this run, never stored
    measured: dict[str, Any] = field(default_factory=dict)  # when and under what conditions the reference was measured
    # how far one round strays from its size's mean, pooled over sizes: squared log deviations and
    # the rounds they rest on (the prior, NOISE_SIGMA, as one round)
    noise: tuple[float, float] = (NOISE_SIGMA**2, 1.0)
    # ... worked out from each size's rounds in this process: their number and mean log time
    _logs: dict[int, tuple[int, float]] = field(default_factory=dict, init=False, repr=False, compare=False)
    # the estimates already worked out for the curve as it stands
    _memo: np.ndarray = field(default_factory=lambda: np.zeros(0), init=False, repr=False, compare=False)
    _memo_key: tuple = field(default=(), init=False, repr=False, compare=False)
    _doubt: float = field(default=0.0, init=False, repr=False, compare=False)  # shape_doubt, with them
    _version: int = field(default=0, init=False, repr=False, compare=False)

    def table(self, n: int) -> np.ndarray:
        """The estimates c(1..n) as one array (index b - 1), worked out once for the curve as it
        stands (a round asks for dozens of them)."""
        key = (id(self.verify), len(self.verify), id(self.seen), len(self.seen), self._version)
        if key != self._memo_key or len(self._memo) < n:
            self._memo_key = key
            self._doubt = self._work_out_doubt()
            self._memo = self._estimates(max(n, 64, *self.seen, *self.verify))
        return self._memo[:n]

    def verify_cost(self, b: int) -> float:
        """The current estimate of c(b)."""
        return float(self.table(b)[b - 1])

    def _estimates(self, n: int) -> np.ndarray:
        b = np.arange(1, n + 1, dtype=float)
        seen = _by_size(self.seen, n)
        ref = _interp(self.verify, b)
        if ref is None:  # no reference: what was verified, else a cost that grows with the batch
            est = _interp(self.seen, b)
            return b.copy() if est is None else est
        verified = ~np.isnan(seen)
        if verified.any():  # unverified sizes move as the verified ones moved from the reference
            sizes = b[verified]
            est = ref * np.exp(np.interp(b, sizes, np.log(seen[verified] / ref[verified])))
            # never dearer than a larger batch verified in this process
            above = np.minimum.accumulate(np.where(verified, seen, np.inf)[::-1])[::-1]
            est = np.minimum(est, np.append(above[1:], np.inf))
            if self._doubt > 0:  # the reference's shape is off: between two sizes verified,
                # no dearer than the straight line between them
                inside = (b > sizes[0]) & (b < sizes[-1])
                est = np.where(inside, np.minimum(est, np.interp(b, sizes, seen[verified])), est)
        else:
            est = ref
        est = np.where(verified, seen, est)
        est[1:] = np.where(verified[1:], est[1:], np.minimum(est[1:], b[1:] * est[0]))  # nor than b single steps
        return est

    def optimistic(self, n: int) -> np.ndarray:
        """The least c(1..n) could be: the estimate where verified in this process, else no
        less than the largest smaller batch that was."""
        est, seen = self.table(n), _by_size(self.seen, n)
        idx = np.where(~np.isnan(seen), np.arange(n), -1)
        below = np.maximum.accumulate(idx)  # the largest verified size at or below each
        below = np.append(-1, below[:-1])  # ... strictly below
        floor = np.where(below >= 0, seen[np.maximum(below, 0)], np.inf)
        return np.where(np.isnan(seen), np.minimum(est, floor), seen)

    def spread(self, n: int) -> np.ndarray:
        """The log-spread of c(1..n)'s posterior. A size verified in this process narrows with
        each of its rounds (at most 1 / EWMA of them count: older rounds are forgotten); one the
        reference measured counts as one round (how far the whole curve drifted since is a
        common factor, read off the sizes that were verified; its shape is what a draw doubts).
        A size between two of either is interpolated from them, so it is as uncertain as the
        less certain of the two (the surer of the two ways, where both apply). Beyond them,
        nothing was ever measured: ``COST_SIGMA``."""
        counts = np.minimum(_by_size(self.n_seen, n, 0.0), 1.0 / EWMA)
        own = _after_rounds(counts, self.round_noise)
        verified = counts > 0
        measured = verified | ~np.isnan(_by_size(self.verify, n))
        spread = np.minimum(
            _interpolated(own, verified), _interpolated(np.where(verified, own, _after_rounds(np.ones(n), self.round_noise)), measured)
        )
        return np.where(verified, spread, np.hypot(spread, self.shape_doubt()))

    def shape_doubt(self) -> float:
        """How far the reference's shape is off, on a log scale: how much the sizes verified in
        this process moved from it, each its own way, beyond what one round's noise explains (0
        while they moved together, as a machine that drifted does). A reference measured on a
        busy machine is dear at some sizes only; then every size not verified is doubted by as
        much, so the draws try them and the curve heals. Worked out once for the curve as it
        stands, with the estimates."""
        self.table(1)
        return self._doubt

    def _work_out_doubt(self) -> float:
        sizes = [b for b in self.n_seen if b in self.seen]
        ref = _interp(self.verify, np.array(sizes, dtype=float))
        if ref is None or len(sizes) < 2:
            return 0.0
        moved = np.log(np.array([self.seen[b] for b in sizes]) / ref)
        return math.sqrt(max(0.0, float(np.var(moved)) - self.round_noise**2))

    @property
    def round_noise(self) -> float:
        """The log-spread of one round's time around its size's mean, as measured so far."""
        ss, rounds = self.noise
        return math.sqrt(ss / rounds)

    def _pool(self, b: int, seconds: float) -> None:
        """Count one timing of a batch of ``b`` into the pooled spread (Welford's update, per size)."""
        n, mean = self._logs.get(b, (0, 0.0))
        x = math.log(seconds)
        n, d = n + 1, x - mean
        mean += d / n
        self._logs[b] = (n, mean)
        if n > 1:
            self.noise = (self.noise[0] + d * (x - mean), self.noise[1] + 1.0)

    def drawn(self, rng, n: int) -> np.ndarray:
        """One draw of c(1..n) from its posterior (without ``rng``: the estimate itself). Every
        size moves with one common factor, each by its own spread, between what a smaller
        verified batch costs and ``b`` single steps."""
        est = self.table(n)
        if rng is None:
            return est
        z = float(rng.standard_normal())
        v = np.clip(est * np.exp(z * self.spread(n)), self.optimistic(n), np.arange(1, n + 1) * est[0])
        v[0] = est[0]
        return v

    def observe_verify(self, b: int, seconds: float) -> None:
        """A round verified ``b`` tokens in ``seconds``."""
        old = self.verify_cost(b)
        self._version += 1
        n = self.n_seen[b] = self.n_seen.get(b, 0) + 1
        # noise only adds time, so only a slow round can be an outlier (a page fault): it moves
        # the estimate a bounded step, at most two spreads of a stored value's prior for the
        # first round of a size, a factor of two after that
        seconds = min(seconds, old * (math.exp(2 * COST_SIGMA) if b not in self.seen else 2.0))
        self._pool(b, seconds)
        # the first round in this process replaces a stored value (only a prior); then the mean
        # of the rounds so far, then one that forgets at EWMA a round
        self.seen[b] = seconds if b not in self.seen else old + max(1.0 / n, EWMA) * (seconds - old)

    def observe_rollback(self, seconds: float) -> None:
        """A round with a rejection took ``seconds`` to roll back."""
        self.rollback_s += EWMA * (seconds - self.rollback_s)

    def curve(self) -> dict[int, float]:
        """The current estimate at every size known (reference or verified)."""
        return {b: self.verify_cost(b) for b in sorted(set(self.verify) | set(self.seen))}

    def adopt(self, calibrated: CostModel) -> None:
        """Take a fresh calibration as the reference (its sizes count as verified in this
        process, each as one round: a calibration's padding batches are not quite a round's)."""
        self.verify = dict(calibrated.verify)
        self.seen = dict(calibrated.verify)
        self.n_seen = dict.fromkeys(calibrated.verify, 1)
        self._version += 1
        self.provisional, self.measured, self.noise = calibrated.provisional, dict(calibrated.measured), calibrated.noise
        if calibrated.kernel_gap is not None:
            self.kernel_gap = calibrated.kernel_gap

    def measurements(self) -> dict[int, float]:
        """What to store: each size's mean as verified in this process; else the reference it
        started from, or the estimate worked out from the sizes verified where that is less.
        (Noise only adds time: sizes verified cheaper than the reference said show that it was
        too dear, as a calibration on a busy machine leaves it, while a slow round never moves
        a size but its own in later runs.)"""
        est = self.table(max(self.verify, default=1))
        return {
            b: self.seen[b] if b in self.seen else min(self.verify[b], float(est[b - 1])) for b in sorted(set(self.verify) | set(self.seen))
        }

    def to_json(self) -> dict:
        return {
            "verify": {str(k): v for k, v in self.measurements().items()},
            "rollback_s": self.rollback_s,
            "measured": self.measured,
            "noise": [round(x, 6) for x in self.noise],
            **({"kernel_gap": self.kernel_gap} if self.kernel_gap is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> CostModel:
        verify = {int(k): float(v) for k, v in d.get("verify", {}).items()}
        if any(b < 1 or not (v > 0 and math.isfinite(v)) for b, v in verify.items()):
            raise ValueError("bad verify curve")
        rb, gap, noise = d.get("rollback_s"), d.get("kernel_gap"), stored_noise(d.get("noise"))
        cost = cls(
            verify,
            rollback_s=float(rb) if isinstance(rb, (int, float)) and rb >= 0 else 0.0,
            measured=dict(d.get("measured") or {}),
            kernel_gap=float(gap) if isinstance(gap, (int, float)) and 0 <= gap < 100 else None,
        )
        if noise is not None:
            keep = min(1.0, 1.0 / EWMA / noise[1])  # an earlier run's rounds count as a size's memory at most
            cost.noise = (noise[0] * keep, noise[1] * keep)
        return cost


# --- calibration ---------------------------------------------------------------------------------


class CpuWatch:
    """How many cores other processes kept busy between ``start()`` and ``others()``."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.start()

    @staticmethod
    def _busy(t: Any) -> float:
        return sum(getattr(t, f) for f in ("user", "system", "nice", "irq", "softirq", "steal") if hasattr(t, f))

    def start(self) -> None:
        self.t0 = now()
        self.sys0 = self._busy(psutil.cpu_times())
        mine = self.proc.cpu_times()
        self.self0 = mine.user + mine.system

    def others(self) -> float:
        wall = max(now() - self.t0, 1e-9)
        mine = self.proc.cpu_times()
        sys_busy = self._busy(psutil.cpu_times()) - self.sys0
        return max(0.0, (sys_busy - (mine.user + mine.system - self.self0)) / wall)


def calibrate(
    measure: Callable[[int], float],
    sizes: tuple[int, ...] | list[int] = CALIBRATION_SIZES,
    repeats: int = 3,
    others: Callable[[], float] | None = None,
) -> CostModel:
    """Build a cost model from ``measure(b) -> seconds`` for each batch size (the median of
    ``repeats``: what a round costs as a rule, as throughput counts it), checking that the
    machine stayed quiet: ``c(1)`` is measured before and after, each size's repeats must agree,
    and ``others()`` (cores used by other processes meanwhile) must stay low. A disturbed
    calibration comes back ``provisional`` with the reason.

    ``c(1)`` is timed in a row, as plain decoding runs. The sizes over one are timed in turn, a
    sweep over all of them per repeat, after one untimed sweep: a verify follows a decode of
    another size, and on a GPU that costs more than the same decode repeated (on the H200 the
    first decode of a new shape is 3-5x the settled time, the first after a change of shape
    1.3-2x, and the second in a row at that shape slower again), so timing one size three times
    in a row mixed those costs and flagged every GPU calibration as disturbed. On a CPU the order
    changes nothing."""
    ones = [measure(1) for _ in range(repeats)]
    before = statistics.median(ones)
    cost = CostModel()
    why: list[str] = []
    batches = [b for b in sizes if b > 1]
    for b in batches:
        measure(b)
    samples: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(repeats):
        for b in batches:
            samples[b].append(measure(b))
    for b in batches:
        cost.verify[b] = statistics.median(samples[b])
        for seconds in samples[b]:
            cost._pool(b, max(seconds, 1e-9))
        hi, lo = max(samples[b]), min(samples[b])
        if hi > SPREAD * lo and hi - lo > MIN_ABS_S and not why:
            why.append(f"a {b}-token verify took {1e3 * lo:.1f} to {1e3 * hi:.1f} ms")
    later = [measure(1) for _ in range(repeats)]
    after = statistics.median(later)
    if max(before, after) > C1_DRIFT * min(before, after) and abs(after - before) > MIN_ABS_S:
        why.append(f"one token took {1e3 * before:.1f} ms before and {1e3 * after:.1f} ms after")
    busy = others() if others is not None else 0.0
    if busy > OTHERS_CPU:
        why.append(f"other processes kept {busy:.1f} cores busy")
    cost.verify[1] = statistics.median(ones + later)
    cost.provisional = bool(why)
    cost.measured = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "others_cpu": round(busy, 3),
        "load_avg": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "disturbed": "; ".join(why) or None,
    }
    return cost
