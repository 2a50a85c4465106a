"""Earlier replies per tenant, for the suffix source (``decode/sources/suffix.py``).

A tenant is who sent a request: the API key it presented (the server's key, or, on a server
without one, whatever bearer token the client sends) together with its ``user`` field. Each
tenant has an index of its own, and a request drafts from its own tenant's only, so one
tenant's text never drafts another's. Tenants are kept by a digest, never the key itself.

All tenants together hold at most ``cap`` bytes, as the indexes count them; past that, the
oldest reply, whoever's, goes first, and a tenant left with none is dropped.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Sequence

from specrun.decode.sources.suffix import BYTES_PER_TOKEN, N, SuffixIndex

CONTEXT = 16  # the prompt's last tokens kept before a reply, so that its first tokens are offered too

__all__ = ["Suffixes", "tenant"]


def tenant(key: str | None, user: str | None) -> str:
    """Who a request is from, as a digest of its key and ``user``."""
    return hashlib.sha256(f"{key or ''}\n{user or ''}".encode()).hexdigest()


class Suffixes:
    """Each tenant's earlier replies, ``cap`` bytes in all, the oldest evicted first."""

    def __init__(self, cap: int):
        self.cap = cap
        self.tenants: dict[str, SuffixIndex] = {}
        self.order: deque[tuple[str, int, int]] = deque()  # (tenant, text id, bytes), oldest first
        self.held = 0  # bytes, as counted
        self.evicted = 0  # replies evicted so far
        self._lock = threading.Lock()

    def index(self, who: str) -> SuffixIndex | None:
        """The tenant's index (None: nothing of theirs is kept)."""
        with self._lock:
            return self.tenants.get(who)

    def add(self, who: str, tokens: Sequence[int], prompt: Sequence[int] = ()) -> None:
        """Keep a finished reply's tokens, after the ``prompt``'s last CONTEXT tokens (a reply too
        short to look up, or over the cap alone, is not kept)."""
        context = list(prompt[-CONTEXT:])
        size = (len(context) + len(tokens)) * BYTES_PER_TOKEN
        if len(tokens) <= N or size > self.cap:
            return
        with self._lock:
            index = self.tenants.setdefault(who, SuffixIndex())
            self.order.append((who, index.add([*context, *tokens], len(context)), size))
            self.held += size
            while self.held > self.cap:
                old, i, n = self.order.popleft()
                self.tenants[old].remove(i)
                self.held -= n
                self.evicted += 1
                if not self.tenants[old].texts:
                    del self.tenants[old]

    def __len__(self) -> int:
        return len(self.order)
