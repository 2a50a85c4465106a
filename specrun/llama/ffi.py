"""llama.cpp loaded once: its log captured, the batches counted for leak checks."""

from __future__ import annotations

import ctypes
import sys
import threading
from collections import deque

import llama_cpp as ll

_LOG_LEVEL_ERROR = 4


class _Log:
    """llama.cpp's log, captured: kept quiet unless verbose, errors kept for messages."""

    def __init__(self):
        self.verbose = False
        self.lines: deque[str] = deque(maxlen=400)
        self.errors: deque[str] = deque(maxlen=20)
        self.lock = threading.Lock()
        self._cb = ll.llama_log_callback(self._on_log)  # keep a reference: C holds the pointer
        ll.llama_log_set(self._cb, ctypes.c_void_p(0))

    def _on_log(self, level, text, _user):
        s = text.decode("utf-8", errors="replace") if text else ""
        with self.lock:
            self.lines.append(s)
            if level == _LOG_LEVEL_ERROR:
                self.errors.append(s.strip())
        if self.verbose:
            sys.stderr.write(s)

    def mark(self) -> int:
        with self.lock:
            self.lines.clear()
            self.errors.clear()
        return 0

    def since_mark(self) -> list[str]:
        with self.lock:
            return list(self.lines)


_log: _Log | None = None
_batches_live = [0]  # llama_batch_init minus llama_batch_free, for leak checks


def live_batches() -> int:
    return _batches_live[0]


_init_lock = threading.Lock()


def _ensure_init(verbose: bool | None = None) -> _Log:
    """Initialise llama.cpp once; ``verbose`` (when given) turns its log on stderr on or off."""
    global _log
    with _init_lock:
        if _log is None:
            ll.llama_backend_init()
            _log = _Log()
        if verbose is not None:
            _log.verbose = verbose
        return _log


def version() -> str:
    return getattr(ll, "__version__", "unknown")
