"""Streaming token bytes to text without ever showing half a character.

A token is a run of bytes, and one UTF-8 character can span two tokens (common for Japanese
and emoji). :class:`Utf8Stream` holds back an incomplete tail until the next bytes complete
it, so the screen never shows U+FFFD for a character that is merely split.
"""

from __future__ import annotations

import codecs


class Utf8Stream:
    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        """Text completed by ``data``; an unfinished character waits for the next call."""
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        """Whatever is left at the end (a truly invalid tail becomes U+FFFD here)."""
        return self._decoder.decode(b"", final=True)

    @property
    def pending(self) -> int:
        return len(self._decoder.getstate()[0])
