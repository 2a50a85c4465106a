"""Earlier replies per tenant and a shared corpus, for the suffix sources (``decode/sources/suffix.py``).

A tenant is who sent a request: the API key it presented (the server's key, or, on a server
without one, whatever bearer token the client sends) together with its ``user`` field. Each
tenant has an index of its own, and a request drafts from its own tenant's only, so one
tenant's text never drafts another's. Tenants are kept by a digest, never the key itself.

The corpus (the operator's files, ``server/corpus.py``) is one index every tenant drafts from,
read-only: it is never evicted and takes at most half the cap, so that replies always have the
other half.

Everything together holds at most ``cap`` bytes, as the indexes count them; past that, the
oldest reply, whoever's, goes first, and a tenant left with none is dropped.

``SuffixCache`` keeps the replies (never the corpus, read again at each start) in a folder
across restarts: one JSON file, written whole to a temporary file and renamed over the old one,
that names the vocabulary it was made with.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from specrun.decode.sources.suffix import BYTES_PER_TOKEN, N, SuffixIndex
from specrun.errors import UsageError

CONTEXT = 16  # the prompt's last tokens kept before a reply, so that its first tokens are offered too
CACHE_FILE = "suffixes.json"
CACHE_FORMAT, CACHE_VERSION = "specrun-suffixes", 1
SAVE_EVERY = 64  # replies kept between two saves (besides the one at a clean stop): a crash loses at most these
_DIGEST = re.compile(r"[0-9a-f]{64}")

__all__ = ["CACHE_FILE", "SuffixCache", "Suffixes", "tenant"]


def tenant(key: str | None, user: str | None) -> str:
    """Who a request is from, as a digest of its key and ``user``."""
    return hashlib.sha256(f"{key or ''}\n{user or ''}".encode()).hexdigest()


class Kept(NamedTuple):
    """One reply kept: whose, its text's id in their index, its bytes as counted, and how many of
    its tokens are the prompt's tail before it (context, never offered)."""

    tenant: str
    id: int
    bytes: int
    start: int


class Suffixes:
    """Each tenant's earlier replies and the shared corpus, ``cap`` bytes in all, the oldest
    reply evicted first."""

    def __init__(self, cap: int):
        self.cap = cap
        self.tenants: dict[str, SuffixIndex] = {}
        self.order: deque[Kept] = deque()  # oldest first
        self.corpus: SuffixIndex | None = None  # the operator's files, shared (None: none)
        self.corpus_bytes = 0  # ... as counted, within ``held``
        self.corpus_files = 0
        self.held = 0  # bytes, as counted, the corpus's included
        self.evicted = 0  # replies evicted so far
        self.on_kept: Callable[[], None] | None = None  # called after each reply kept (the cache's saver)
        self._lock = threading.Lock()

    def index(self, who: str) -> SuffixIndex | None:
        """The tenant's index (None: nothing of theirs is kept)."""
        with self._lock:
            return self.tenants.get(who)

    def add(self, who: str, tokens: Sequence[int], prompt: Sequence[int] = ()) -> None:
        """Keep a finished reply's tokens, after the ``prompt``'s last CONTEXT tokens (a reply too
        short to look up, or over the room the corpus leaves alone, is not kept)."""
        context = list(prompt[-CONTEXT:])
        if len(tokens) <= N:
            return
        if self._keep(who, [*context, *tokens], len(context)) and self.on_kept is not None:
            self.on_kept()

    def _keep(self, who: str, text: list[int], start: int) -> bool:
        size = len(text) * BYTES_PER_TOKEN
        with self._lock:
            if size > self.cap - self.corpus_bytes:
                return False
            index = self.tenants.setdefault(who, SuffixIndex())
            self.order.append(Kept(who, index.add(text, start), size, start))
            self.held += size
            self._evict()
            return True

    def _evict(self) -> None:
        """The oldest replies go until what is held fits the cap (the lock held; the corpus is at
        most half the cap, and a reply at most the rest: there is always a reply left to go)."""
        while self.held > self.cap:
            old = self.order.popleft()
            self.tenants[old.tenant].remove(old.id)
            self.held -= old.bytes
            self.evicted += 1
            if not self.tenants[old.tenant].texts:
                del self.tenants[old.tenant]

    def add_corpus(self, tokens: Sequence[int]) -> bool:
        """Index one file of the shared corpus, never evicted; False: it would take the corpus past
        half the cap (it is not kept; replies are evicted, oldest first, to make room for one that is)."""
        size = len(tokens) * BYTES_PER_TOKEN
        if len(tokens) <= N:
            return True  # nothing to look up in it
        with self._lock:
            if self.corpus_bytes + size > self.cap // 2:
                return False
            if self.corpus is None:
                self.corpus = SuffixIndex()
            self.corpus.add(tokens)
            self.corpus_bytes += size
            self.corpus_files += 1
            self.held += size
            self._evict()
            return True

    def replies(self) -> list[tuple[str, int, list[int]]]:
        """The replies kept, oldest first: (tenant, context length, the context's and reply's tokens)."""
        with self._lock:
            return [(k.tenant, k.start, self.tenants[k.tenant].texts[k.id].tolist()) for k in self.order]

    def restore(self, replies: Sequence[tuple[str, int, list[int]]]) -> int:
        """Keep replies saved earlier (``replies()``'s form, oldest first): the newest that fit
        beside what is held, as if each had just been added. Returns how many did not fit."""
        room, first = self.cap - self.held, len(replies)
        while first > 0 and len(replies[first - 1][2]) * BYTES_PER_TOKEN <= room:
            first -= 1
            room -= len(replies[first][2]) * BYTES_PER_TOKEN
        for who, start, text in replies[first:]:
            self._keep(who, text, start)
        return first

    def __len__(self) -> int:
        return len(self.order)


class CacheUnusable(Exception):
    """A cache file that cannot be used: ``str`` says why, in a few words."""


class SuffixCache:
    """The replies kept in ``folder/suffixes.json`` across restarts, for the vocabulary whose
    fingerprint is ``vocabulary`` (``models.catalog.fingerprint``). Saved every SAVE_EVERY
    replies kept, on a thread of its own, and at a clean stop; loaded at start."""

    def __init__(self, folder: Path, vocabulary: str, n_vocab: int, notice: Callable[[str], None]):
        self.file = folder / CACHE_FILE
        self.vocabulary, self.n_vocab, self.notice = vocabulary, n_vocab, notice
        self._wake = threading.Event()
        self._stopping = self._due = False
        self._kept = 0
        self.saves = 0  # made so far
        self._save_lock = threading.Lock()
        self._warned: set[str] = set()
        self._thread: threading.Thread | None = None
        self._store: Suffixes | None = None

    @staticmethod
    def check(folder: Path) -> None:
        """Make the folder if need be; a UsageError if it cannot be written (before the models load)."""
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(
                f"{{suffix_cache}} {folder}: cannot make this folder ({e.strerror or e})", "give a folder you can write", "suffix_cache"
            ) from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"{{suffix_cache}} {folder}: this folder cannot be written", "give a folder you can write", "suffix_cache")

    def load(self, store: Suffixes) -> str:
        """Restore the replies saved, into ``store``; returns the line to say (a warning if the
        file was there but could not be used: the store then starts without it; ``{suffix_mb}``
        for the setting)."""
        try:
            replies = self._read(store.cap)
        except FileNotFoundError:
            return f"suffix cache: none yet in {self.file.parent} (saved at every {SAVE_EVERY} replies and at a clean stop)"
        except CacheUnusable as e:
            return f"warning: suffix cache {self.file} {e}; starting without it (it is replaced at the next save)"
        dropped = store.restore(replies)
        left = f"; the {dropped} oldest left out, over {{suffix_mb}}" if dropped else ""
        return f"suffix cache: {_replies(len(replies) - dropped, 'earlier ')} from {self.file}{left}"

    def _read(self, cap: int) -> list[tuple[str, int, list[int]]]:
        try:
            size = self.file.stat().st_size
            if size > 64 * cap + 2**20:  # more than a cache of this cap could be, by far (8 bytes a token, 256 counted)
                raise CacheUnusable(f"is {size} bytes, more than any cache for this {{suffix_mb}}")
            d = json.loads(self.file.read_bytes())
        except FileNotFoundError:
            raise
        except OSError as e:
            raise CacheUnusable(f"cannot be read ({e.strerror or e})") from None
        except (ValueError, RecursionError):
            raise CacheUnusable("is not JSON (corrupt?)") from None
        if not isinstance(d, dict) or d.get("format") != CACHE_FORMAT or d.get("version") != CACHE_VERSION:
            raise CacheUnusable(f"is not a {CACHE_FORMAT} file of version {CACHE_VERSION}")
        if d.get("vocabulary") != self.vocabulary:
            raise CacheUnusable("was made with another vocabulary (another model's tokenizer)")
        replies, out = d.get("replies"), []
        if not isinstance(replies, list):
            raise CacheUnusable("has no list of replies (corrupt?)")
        for r in replies:
            if not (isinstance(r, list) and len(r) == 3):
                raise CacheUnusable("holds a reply of the wrong shape (corrupt?)")
            who, start, tokens = r
            if not (
                isinstance(who, str) and _DIGEST.fullmatch(who) and isinstance(start, int) and isinstance(tokens, list)
                and 0 <= start < len(tokens) and all(type(t) is int and 0 <= t < self.n_vocab for t in tokens)
            ):  # fmt: skip
                raise CacheUnusable("holds a reply that is not a tenant digest, a context length and token ids (corrupt?)")
            out.append((who, start, tokens))
        return out

    def save(self, store: Suffixes) -> None:
        """Write the replies kept now: to a temporary file beside the cache, then renamed over it
        (a reader, or a crash, sees the old file or the new one, never half of one)."""
        with self._save_lock:
            d = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "vocabulary": self.vocabulary, "replies": store.replies()}
            tmp = self.file.with_name(f".{CACHE_FILE}.{os.getpid()}.tmp")
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(d, f, separators=(",", ":"))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.file)
                self.saves += 1
            finally:
                tmp.unlink(missing_ok=True)

    def keep_saving(self, store: Suffixes) -> None:
        """Save every SAVE_EVERY replies the store keeps, on a thread of its own (the requests'
        threads only wake it)."""
        self._store, store.on_kept = store, self._kept_one
        self._thread = threading.Thread(target=self._run, args=(store,), name="specrun-suffix-cache", daemon=True)
        self._thread.start()

    def _kept_one(self) -> None:
        self._kept += 1  # (a lost increment under a race only delays a save)
        if self._kept % SAVE_EVERY == 0:
            self._due = True
            self._wake.set()

    def _run(self, store: Suffixes) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._due:  # (before stopping: a save that came due is made, also at a stop)
                self._due = False
                self._try_save(store)
            if self._stopping:
                return

    def _try_save(self, store: Suffixes) -> bool:
        try:
            self.save(store)
            return True
        except OSError as e:
            line = f"warning: cannot save the suffix cache {self.file} ({e.strerror or e}); the replies stay in memory"
            if line not in self._warned:  # once per kind of failure, not once per save
                self._warned.add(line)
                self.notice(line)
            return False

    def close(self) -> None:
        """Stop the saving thread and save once more (a clean stop)."""
        store = self._store
        if store is None:
            return
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        store.on_kept = None
        if self._try_save(store):
            self.notice(f"suffix cache: {_replies(len(store))} saved to {self.file}")


def _replies(n: int, kind: str = "") -> str:
    return f"{n} {kind}{'reply' if n == 1 else 'replies'}"
