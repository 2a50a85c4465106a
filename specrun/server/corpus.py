"""The operator's corpus for the suffix sources (``serve --suffix-corpus DIR``): the text files
under a folder, usually the repository the agents work on, tokenized once at start into one
index every tenant drafts from (``Suffixes.add_corpus``).

What is read: every regular file under DIR, in path order (folders sorted, depth first), so the
same folder gives the same corpus. Skipped: hidden files and folders (``.git``, ``.venv``...),
``__pycache__`` and ``node_modules``, links, files over MAX_FILE bytes (lock files, minified
bundles, data: not what an agent writes) and files that are not UTF-8 text (a NUL byte among
their first bytes, or bytes that do not decode). Reading stops at the first file that would take
the corpus past half of the suffix cap; the start line says how much was read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from specrun.errors import InputError
from specrun.server.suffixes import Suffixes

MAX_FILE = 1 << 20  # bytes
SKIPPED_FOLDERS = frozenset({"__pycache__", "node_modules"})
_SNIFF = 8192  # bytes looked at for a NUL before the whole file is decoded

__all__ = ["MAX_FILE", "check", "load", "texts"]

_FIX = "give the folder of the repository to draft from"


def _candidates(root: Path) -> Iterator[Path]:
    """The regular files under ``root`` that are not skipped by name, link or size, in path order."""
    for top, folders, names in os.walk(root, followlinks=False):
        folders[:] = sorted(d for d in folders if not d.startswith(".") and d not in SKIPPED_FOLDERS)
        for name in sorted(names):
            if name.startswith("."):
                continue
            path = Path(top, name)
            try:
                st = path.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE:  # (lstat: a link is not a regular file)
                continue
            yield path


def _text(path: Path) -> str | None:
    """The file's text, or None: binary, not UTF-8, or unreadable."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:_SNIFF]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def texts(root: Path) -> Iterator[tuple[Path, str]]:
    """Each text file under ``root`` that is read (see the module's docstring), with its text."""
    for path in _candidates(root):
        text = _text(path)
        if text:
            yield path, text


def check(root: Path) -> None:
    """An InputError, before any model loads, if ``root`` is not a readable folder with a text file in it."""
    if not root.exists():
        raise InputError(f"{{suffix_corpus}} {root}: no such folder", _FIX, "suffix_corpus")
    if not root.is_dir():
        raise InputError(f"{{suffix_corpus}} {root}: not a folder", _FIX, "suffix_corpus")
    try:
        os.listdir(root)
    except OSError as e:
        raise InputError(
            f"{{suffix_corpus}} {root}: cannot be read ({e.strerror or e})", "give a folder you can read", "suffix_corpus"
        ) from None
    if next(texts(root), None) is None:
        raise InputError(
            f"{{suffix_corpus}} {root}: no text file in it (hidden folders, links, binary files and files over "
            f"{MAX_FILE >> 20} MiB are skipped)",
            _FIX,
            "suffix_corpus",
        )


def load(store: Suffixes, root: Path, tokenize: Callable[[str], list[int]]) -> str:
    """Index the text files under ``root`` into ``store``'s corpus, until the next would not fit;
    returns the line to say (``{suffix_mb}`` for the setting)."""
    read, tokens, stopped = 0, 0, None
    for path, text in texts(root):
        ids = tokenize(text)
        if not store.add_corpus(ids):
            stopped = path
            break
        read, tokens = read + 1, tokens + len(ids)
    line = f"suffix corpus: {read} files, {tokens} tokens from {root} ({store.corpus_bytes / 2**20:.1f} MiB of {{suffix_mb}})"
    if stopped is not None:
        line += f"; stopped at {stopped.relative_to(root)}: the corpus may take half of {{suffix_mb}} (raise it to read more)"
    return line
