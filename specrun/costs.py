"""What a round costs on this machine, measured, healed online, and kept between runs.

The verify curve ``c(b)`` is the target's time to decode a batch of ``b`` tokens. It starts
from a reference (calibrated at the first run on a machine, or stored by an earlier one) and
every round refines it:

* a size verified in this process has its own estimate. Timing noise on a shared machine only
  ever adds time (another process, a page fault), so a round faster than the estimate is news
  (the first one in this process replaces a stored value, later ones move the estimate half way)
  and a slower one moves it by a small, bounded step;
* a size not yet verified in this process follows the reference, scaled by how far the sizes
  that were verified have moved from it (interpolated between the nearest ones), and is never
  dearer than a larger batch that was. A stored curve that has drifted, or was measured on a
  busy machine, heals from the sizes in use;
* ``optimistic(b)`` is the least a not-yet-verified size could cost: a batch costs at least
  what a smaller batch verified in this process costs. The controller uses it to explore, now
  and then, a longer draft that the stored curve may wrongly price out.

A calibration that ran while the machine was busy (``c(1)`` before and after disagree, one
size's repeats disagree, or other processes used the CPU) is used for the run that made it but
never stored. Stored entries carry their date and the conditions they were measured under,
and what the controller learned about copies and near-ties, so a fresh process starts where
the last one left off. A damaged or foreign file is a cold start.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

EWMA = 0.15  # how far one slower-than-expected round moves an estimate
FAST = 0.5  # how far one faster-than-expected round moves it
CATCH_UP_ROUNDS = 4  # a catch-up of the draft model's cache is paid once for about this many rounds
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)
STORE_VERSION = 2

# a calibration is disturbed when...
C1_DRIFT = 1.3  # c(1) before and after differ by more than this factor
SPREAD = 2.0  # one size's repeats differ by more than this factor
MIN_ABS_S = 0.001  # (and by more than this many seconds: tiny models time at noise level)
OTHERS_CPU = 0.3  # other processes used more than this many cores on average


def now() -> float:
    return time.perf_counter()


def _interp(points: dict[int, float], b: int) -> float | None:
    """Piecewise-linear through ``points``; in proportion to the batch beyond the ends."""
    if not points:
        return None
    if b in points:
        return points[b]
    sizes = sorted(points)
    if b < sizes[0]:
        return points[sizes[0]] * b / sizes[0]
    if b > sizes[-1]:
        return points[sizes[-1]] * b / sizes[-1]
    hi = next(s for s in sizes if s > b)
    lo = max(s for s in sizes if s < b)
    w = (b - lo) / (hi - lo)
    return points[lo] * (1 - w) + points[hi] * w


@dataclass
class CostModel:
    """Seconds per target decode by batch size, and per draft-model token."""

    verify: dict[int, float] = field(default_factory=dict)  # the reference curve (calibrated or stored)
    draft_per_token: float | None = None
    seen: dict[int, float] = field(default_factory=dict)  # sizes verified in this process: their estimates
    catch_up_per_token: float | None = None  # the draft model evaluating a stretch it missed, per token
    provisional: bool = False  # measured on a busy machine: used for this run, never stored
    measured: dict[str, Any] = field(default_factory=dict)  # when and under what conditions the reference was measured
    # estimates already worked out for the curve as it stands (a plan asks for dozens of them)
    _memo: dict[tuple[str, int], float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _memo_key: tuple = field(default=(), init=False, repr=False, compare=False)
    _version: int = field(default=0, init=False, repr=False, compare=False)

    def _memoised(self, kind: str, b: int, work: Callable[[int], float]) -> float:
        key = (id(self.verify), len(self.verify), id(self.seen), len(self.seen), self._version)
        if key != self._memo_key:
            self._memo, self._memo_key = {}, key
        got = self._memo.get((kind, b))
        if got is None:
            got = self._memo[(kind, b)] = work(b)
        return got

    def verify_cost(self, b: int) -> float:
        """The current estimate of c(b)."""
        return self._memoised("c", b, self._estimate)

    def _estimate(self, b: int) -> float:
        if b in self.seen:
            return self.seen[b]
        ref = _interp(self.verify, b)
        if ref is None:
            seen = _interp(self.seen, b)
            return float(b) if seen is None else seen  # no data at all: assume cost grows with the batch
        est = ref * self._drift(b)
        above = [v for s, v in self.seen.items() if s > b]
        return min(est, min(above)) if above else est  # never dearer than a larger batch verified in this process

    def _drift(self, b: int) -> float:
        """How far the sizes verified in this process have moved from the reference, at ``b``
        (log-interpolated between the nearest such sizes; the nearest one's beyond them)."""
        ratios = {s: math.log(v / r) for s, v in self.seen.items() if (r := _interp(self.verify, s))}
        if not ratios:
            return 1.0
        sizes = sorted(ratios)
        if b <= sizes[0]:
            return math.exp(ratios[sizes[0]])
        if b >= sizes[-1]:
            return math.exp(ratios[sizes[-1]])
        hi = next(s for s in sizes if s > b)
        lo = max(s for s in sizes if s < b)
        w = (b - lo) / (hi - lo)
        return math.exp(ratios[lo] * (1 - w) + ratios[hi] * w)

    def optimistic(self, b: int) -> float:
        """The least c(b) could be: its estimate if verified in this process, else no less
        than the largest smaller batch that was."""
        return self._memoised("o", b, self._optimistic)

    def _optimistic(self, b: int) -> float:
        if b in self.seen:
            return self.seen[b]
        below = [s for s in self.seen if s < b]
        est = self.verify_cost(b)
        return min(est, self.seen[max(below)]) if below else est

    def unseen(self, b: int) -> bool:
        return b not in self.seen

    def observe_verify(self, b: int, seconds: float) -> None:
        old = self.verify_cost(b)
        self._version += 1
        if seconds < old:  # noise only adds time: a quicker round is real (the first in this process, wholly)
            self.seen[b] = seconds if b not in self.seen else old + FAST * (seconds - old)
        else:  # one slow round (a page fault, another process) moves the estimate a bounded step
            self.seen[b] = old + EWMA * (min(seconds, 2.0 * old) - old)

    def observe_draft(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 0:
            return
        per = seconds / n_tokens
        old = self.draft_per_token
        self.draft_per_token = per if old is None else old + EWMA * (per - old)

    def observe_catch_up(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 0 or seconds <= 0:
            return
        per = seconds / n_tokens
        old = self.catch_up_per_token
        self.catch_up_per_token = per if old is None else old + EWMA * (per - old)

    def catch_up_cost(self, lag: int) -> float:
        """Seconds for the draft model to evaluate ``lag`` tokens it missed (a round's usual
        one or two are part of its per-token cost), per round of the few a switch back to the
        draft model usually lasts (CATCH_UP_ROUNDS). Unmeasured: half a drafted token each."""
        if lag <= 2:
            return 0.0
        per = self.catch_up_per_token
        if per is None:
            per = 0.5 * (self.draft_per_token if self.draft_per_token is not None else 0.5 * self.verify_cost(1))
        return lag * per / CATCH_UP_ROUNDS

    def curve(self) -> dict[int, float]:
        """The current estimate at every size known (reference or verified)."""
        return {b: self.verify_cost(b) for b in sorted(set(self.verify) | set(self.seen))}

    def adopt(self, calibrated: CostModel) -> None:
        """Take a fresh calibration as the reference (its sizes count as verified in this process)."""
        self.verify = dict(calibrated.verify)
        self.seen = dict(calibrated.verify)
        self._version += 1
        self.provisional, self.measured = calibrated.provisional, dict(calibrated.measured)
        if calibrated.draft_per_token is not None:
            self.draft_per_token = calibrated.draft_per_token

    def to_json(self) -> dict:
        return {
            "verify": {str(k): v for k, v in self.curve().items()},
            "draft_per_token": self.draft_per_token,
            "catch_up_per_token": self.catch_up_per_token,
            "measured": self.measured,
        }

    @classmethod
    def from_json(cls, d: dict) -> CostModel:
        verify = {int(k): float(v) for k, v in d.get("verify", {}).items()}
        if any(b < 1 or not (v > 0 and math.isfinite(v)) for b, v in verify.items()):
            raise ValueError("bad verify curve")
        dpt, cup = d.get("draft_per_token"), d.get("catch_up_per_token")
        return cls(
            verify,
            float(dpt) if dpt is not None else None,
            catch_up_per_token=float(cup) if cup is not None else None,
            measured=dict(d.get("measured") or {}),
        )


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
    """Build a cost model from ``measure(b) -> seconds`` for each batch size (best of
    ``repeats``), checking that the machine stayed quiet: ``c(1)`` is measured before and after,
    each size's repeats must agree, and ``others()`` (cores used by other processes meanwhile)
    must stay low. A disturbed calibration comes back ``provisional`` with the reason."""
    before = min(measure(1) for _ in range(repeats))
    cost = CostModel()
    why: list[str] = []
    for b in sizes:
        samples = [measure(b) for _ in range(repeats)]
        cost.verify[b] = min(samples)
        hi, lo = max(samples), min(samples)
        if hi > SPREAD * lo and hi - lo > MIN_ABS_S and not why:
            why.append(f"a {b}-token verify took {1e3 * lo:.1f} to {1e3 * hi:.1f} ms")
    after = min(measure(1) for _ in range(repeats))
    if max(before, after) > C1_DRIFT * min(before, after) and abs(after - before) > MIN_ABS_S:
        why.append(f"one token took {1e3 * before:.1f} ms before and {1e3 * after:.1f} ms after")
    busy = others() if others is not None else 0.0
    if busy > OTHERS_CPU:
        why.append(f"other processes kept {busy:.1f} cores busy")
    cost.verify[1] = min(cost.verify.get(1, before), before, after)
    cost.provisional = bool(why)
    cost.measured = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "others_cpu": round(busy, 3),
        "load_avg": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "disturbed": "; ".join(why) or None,
    }
    return cost


# --- the store -----------------------------------------------------------------------------------


@dataclass
class Learned:
    """What one pair on one machine and placement has taught specrun: costs, copies, ties."""

    cost: CostModel
    copy: dict | None = None  # CopyModel.to_json()
    tie_rate: float | None = None
    updated: str | None = None


class CostStore:
    """Learned costs kept between runs in a JSON file, keyed by model, threads and placement."""

    def __init__(self, path: Path | None):
        self.path = path

    def _read(self) -> dict:
        if not self.path or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != STORE_VERSION or not isinstance(data.get("entries"), dict):
            return {}  # a damaged or foreign file (or one from an older specrun): a cold start
        return data["entries"]

    def entries(self) -> dict[str, dict]:
        return {k: v for k, v in self._read().items() if isinstance(v, dict)}

    def load(self, key: str) -> Learned | None:
        d = self._read().get(key)
        if not isinstance(d, dict):
            return None
        try:
            cost = CostModel.from_json(d.get("cost") or {})
            tie = d.get("tie_rate")
            return Learned(
                cost,
                d.get("copy") if isinstance(d.get("copy"), dict) else None,
                float(tie) if isinstance(tie, (int, float)) and 0 <= tie <= 1 else None,
                d.get("updated"),
            )
        except (TypeError, ValueError, AttributeError):
            return None  # a damaged entry is just a cold start

    def save(self, key: str, learned: Learned) -> None:
        """Store what was learned; what it does not say (no copy statistics, say) stays as
        stored. A provisional curve (measured on a busy machine) is never stored."""
        if not self.path:
            return
        entries = self._read()
        old = entries.get(key)
        old = old if isinstance(old, dict) else {}
        entry: dict[str, Any] = {k: v for k, v in old.items() if k in ("cost", "copy", "tie_rate")}  # kept unless replaced
        entry["updated"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        if not learned.cost.provisional and (learned.cost.verify or learned.cost.seen):
            entry["cost"] = learned.cost.to_json()
        if learned.copy is not None:
            entry["copy"] = learned.copy
        if learned.tie_rate is not None:
            entry["tie_rate"] = round(learned.tie_rate, 4)
        entries[key] = entry
        self._write(entries)

    def remove(self, match: str = "") -> list[str]:
        """Forget the entries whose key contains ``match`` (all of them for ""); returns their keys."""
        entries = self._read()
        gone = [k for k in entries if match in k]
        for k in gone:
            del entries[k]
        if gone:
            self._write(entries)
        return gone

    def _write(self, entries: dict) -> None:
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"version": STORE_VERSION, "entries": entries}, indent=1))
            os.replace(tmp, self.path)
        except OSError:
            pass
