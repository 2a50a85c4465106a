"""Utf8Stream: a character split across tokens is held back, never shown as U+FFFD."""

from __future__ import annotations

import pytest
from tiny_models import SPLIT_CHAR

from specrun.llama import LoadOptions, Model
from specrun.run.text import Utf8Stream

REPLACEMENT = "\ufffd"
EMOJI = "😀"  # four bytes, four byte tokens in the tiny vocabulary


@pytest.fixture(scope="module")
def target(tiny):
    m = Model(tiny["target"], LoadOptions(n_ctx=256, n_threads=1))
    yield m
    m.close()


def stream_pieces(pieces: list[bytes]) -> tuple[list[str], str]:
    s = Utf8Stream()
    chunks = [s.feed(p) for p in pieces]
    return chunks, s.flush()


@pytest.mark.parametrize("text", [SPLIT_CHAR, EMOJI, f"a{SPLIT_CHAR}b{EMOJI}c", f"{SPLIT_CHAR * 3}{EMOJI * 2}é"])
def test_real_tokens_piece_by_piece(target, text):
    tokens = target.tokenize(text, add_special=False, parse_special=False)
    pieces = [target.piece(t) for t in tokens]
    assert b"".join(pieces) == text.encode()
    # the point of the test: at least one character really is split between tokens
    assert any(_incomplete(p) for p in pieces)
    chunks, tail = stream_pieces(pieces)
    assert "".join(chunks) + tail == text
    assert tail == ""
    assert all(REPLACEMENT not in c for c in chunks)


def _incomplete(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_split_char_is_held_back_until_complete(target):
    first, second = target.tokenize(SPLIT_CHAR, add_special=False, parse_special=False)
    s = Utf8Stream()
    assert s.feed(target.piece(first)) == ""
    assert s.pending == 2
    assert s.feed(target.piece(second)) == SPLIT_CHAR
    assert s.pending == 0


@pytest.mark.parametrize("text", ["ぬ", "😀", "é", "aé😀ぬz", "日本語のテキスト"])
def test_every_synthetic_byte_split(text):
    data = text.encode()
    # one byte at a time
    chunks, tail = stream_pieces([data[i : i + 1] for i in range(len(data))])
    assert "".join(chunks) + tail == text and REPLACEMENT not in "".join(chunks)
    # every two-way split
    for cut in range(len(data) + 1):
        chunks, tail = stream_pieces([data[:cut], data[cut:]])
        assert "".join(chunks) == text and tail == ""


def test_empty_feeds_are_harmless():
    s = Utf8Stream()
    assert s.feed(b"") == ""
    assert s.feed(b"\xe3") == ""
    assert s.feed(b"") == ""
    assert s.feed(b"\x81\xac") == "ぬ"
    assert s.flush() == ""


def test_flush_of_a_truly_invalid_tail():
    s = Utf8Stream()
    assert s.feed(b"ok\xf0\x9f") == "ok"  # half an emoji: waits
    assert s.pending == 2
    assert s.flush() == REPLACEMENT  # the stream ended: the half character is invalid
    assert s.pending == 0


def test_invalid_bytes_in_the_middle_are_replaced_not_held():
    s = Utf8Stream()
    # a lone continuation byte can never start a character: replaced at once
    assert s.feed(b"a\x80b") == f"a{REPLACEMENT}b"
    # a lead byte followed by a non-continuation byte: the lead byte is invalid
    assert s.feed(b"\xe3x") == f"{REPLACEMENT}x"
    assert s.flush() == ""
