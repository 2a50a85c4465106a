"""What specrun has learned about a pair on a machine, kept between runs: one load, one save.

An entry holds the target's verify curve (``costs.CostModel``), what each draft source learned
(its acceptance posteriors and its own costs, as the source writes them) and the near-tie rate,
keyed by models, threads and placement. A damaged or foreign file, or one from an older specrun,
is a cold start; a damaged entry is a cold start for that pair.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specrun.decode.costs import CostModel

STORE_VERSION = 4  # 4: verify costs are means of rounds (3 stored the quickest); an older file is a cold start


@dataclass
class Learned:
    """What one pair on one machine and placement has taught specrun."""

    cost: CostModel
    sources: dict[str, dict] = field(default_factory=dict)  # source name -> what it stored
    tie_rate: float | None = None
    updated: str | None = None


class CostStore:
    """Learned state kept between runs in a JSON file, keyed by model, threads and placement."""

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
            sources = d.get("sources")
            return Learned(
                cost,
                {k: v for k, v in sources.items() if isinstance(v, dict)} if isinstance(sources, dict) else {},
                float(tie) if isinstance(tie, (int, float)) and 0 <= tie <= 1 else None,
                d.get("updated"),
            )
        except (TypeError, ValueError, AttributeError):
            return None  # a damaged entry is just a cold start

    def save(self, key: str, learned: Learned) -> None:
        """Store what was learned; what it does not say (no source statistics, say) stays as
        stored. A provisional curve (measured on a busy machine) is never stored."""
        if not self.path:
            return
        entries = self._read()
        old = entries.get(key)
        old = old if isinstance(old, dict) else {}
        entry: dict[str, Any] = {k: v for k, v in old.items() if k in ("cost", "sources", "tie_rate")}  # kept unless replaced
        entry["updated"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        if not learned.cost.provisional and (learned.cost.verify or learned.cost.seen):
            entry["cost"] = learned.cost.to_json()
        if learned.sources:
            entry["sources"] = {**(entry.get("sources") or {}), **learned.sources}
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
