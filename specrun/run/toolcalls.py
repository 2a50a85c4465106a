"""Tool calls in a model's output text: content and calls apart, whole or as it streams in.

Two formats, chosen from the chat template that asked for them (:func:`tool_format`):

* ``hermes`` (Qwen 2.5/3, Hermes, many fine-tunes): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, anywhere in the text; the
  same JSON in a Markdown code fence or bare (as small Qwen models write it, and as
  llama.cpp reads it) is a call when it opens with ``"name"`` naming a tool offered;
* ``llama3`` (Llama 3.1+ JSON tool calling): the reply *starts* with
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), more calls
  separated by ``;``. A reply that starts with any other JSON object is content.

Either key, ``arguments`` or ``parameters``, is taken in both. A call's ``arguments`` are the
JSON text exactly as the model wrote it (a JSON string value is decoded to its text), so the
streamed pieces join to what the whole parse gives, however the text was split.

:class:`ToolCallParser` is fed text deltas and returns, in order, content text (``str``)
and :class:`CallDelta` pieces in OpenAI's streaming shape: a call's first delta has its
index, id and name, later ones carry pieces of its arguments. Text that could still turn out
to be the start of a call (``<tool_c``, a code fence, a ``{``) is held back until it shows
whether it is. A call whose JSON breaks before its name is known goes back into the content
as written; one that breaks after keeps what it had (its arguments may then be incomplete
JSON, as with any reply cut short). After the first call, whitespace between calls is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["CallDelta", "ToolCall", "ToolCallParser", "parse_tool_calls", "tool_format"]

FORMATS = ("hermes", "llama3")
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")


def tool_format(template_source: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, or None if it shows none."""
    src = template_source or ""
    if OPEN_TAG in src:
        return "hermes"
    if "<|start_header_id|>" in src and ("ipython" in src or "parameters" in src):
        return "llama3"
    return None


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class CallDelta:
    index: int
    id: str | None = None  # on a call's first delta only, with its name
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        """The ``delta.tool_calls[0]`` object of a chat.completion.chunk."""
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class _Broken(Exception):
    """The text is not (or no longer) the JSON object a call should be."""


class _ObjectScanner:
    """A JSON object, one character at a time: reports each top-level key, where its value
    starts and where it ends. Nested values are skipped by depth, strings by their quotes."""

    WS = " \t\r\n"
    BETWEEN_TOKENS = frozenset({"start", "key_or_end", "comma", "colon", "value_start"})  # white space is skipped

    def __init__(self) -> None:
        self.state = "start"  # start | key_or_end | key | colon | value_start | value | prim | comma | done
        self.key = ""  # the current top-level key, raw (escapes undone at the end)
        self.key_raw: list[str] = []
        self.value_start = -1
        self.depth = 0  # inside the current value
        self.in_string = False
        self.escape = False
        self.values: dict[str, tuple[int, int]] = {}  # key -> [start, end) of its value, once complete
        self.keys: list[str] = []

    def feed(self, ch: str, i: int) -> None:
        """Advance over ``ch`` at buffer index ``i``; raises _Broken on what JSON cannot be."""
        s = self.state
        if s in self.BETWEEN_TOKENS and ch in self.WS:
            return
        if s == "start":
            if ch != "{":
                raise _Broken()
            self.state = "key_or_end"
        elif s in ("key_or_end", "comma"):
            if ch == "}":
                self.state = "done"
            elif s == "key_or_end" and ch == '"':
                self.state, self.key_raw, self.escape = "key", [], False
            elif s == "comma" and ch == ",":
                self.state = "key_or_end"
            else:
                raise _Broken()
        elif s == "key":
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                try:
                    self.key = json.loads('"' + "".join(self.key_raw) + '"')
                except ValueError:
                    raise _Broken() from None
                self.keys.append(self.key)
                self.state = "colon"
                return
            self.key_raw.append(ch)
        elif s == "colon":
            if ch != ":":
                raise _Broken()
            self.state = "value_start"
        elif s == "value_start":
            self.value_start = i
            if ch in "{[":
                self.state, self.depth, self.in_string = "value", 1, False
            elif ch == '"':
                self.state, self.depth, self.in_string, self.escape = "value", 0, True, False
            elif ch in "-0123456789tfn":
                self.state = "prim"
            else:
                raise _Broken()
        elif s == "value":
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self._end_value(i + 1)
            elif ch == '"':
                self.in_string, self.escape = True, False
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self._end_value(i + 1)
        elif s == "prim":
            if ch in self.WS or ch in ",}":
                self._end_value(i)
                self.feed(ch, i)
            elif ch not in "0123456789+-.eEtruefalsn":
                raise _Broken()
        elif s == "done":
            raise _Broken()  # nothing belongs to the object after its "}"

    def _end_value(self, end: int) -> None:
        self.values[self.key] = (self.value_start, end)
        self.state = "comma"

    def open_value(self) -> str | None:
        """The key whose value is being read right now (None between values)."""
        return self.key if self.state in ("value", "prim") else None


@dataclass
class _Call:
    """The call being read: its JSON text so far and how much of its arguments went out."""

    index: int
    opener: str = ""  # the text that opened it ("<tool_call>", a code fence, or nothing)
    closer: str = ""  # what may close it after its JSON ("</tool_call>", "```", or nothing)
    tentative: bool = False  # opened by bare JSON: a call only if it starts with a known name
    buf: list[str] = field(default_factory=list)
    scan: _ObjectScanner = field(default_factory=_ObjectScanner)
    id: str | None = None  # set once its header (id, name) went out
    name: str | None = None
    args_sent: int = -1  # buffer index up to which the arguments went out (-1: none yet)
    args_text: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.buf)

    def value(self, key: str) -> object:
        start, end = self.scan.values[key]
        try:
            return json.loads(self.text[start:end])
        except ValueError:
            return None


# a Markdown code fence around a call's JSON, as small models often write it (llama.cpp takes it too)
FENCE = re.compile(r"```(?:json)?[ \t]*\r?\n\s*(?=\{)")
FENCE_START = re.compile(r"`{1,3}|```j(?:s(?:o(?:n)?)?)?|```(?:json)?[ \t]*\r?\n?\s*")  # could still become one


class ToolCallParser:
    def __init__(self, fmt: str, names: set[str] | frozenset[str] | None = None, new_id: Callable[[], str] = new_call_id):
        """``names``: the tools offered; JSON without a tag (bare or in a code fence) is a call
        only when it names one of them (any name, when None)."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
        self.fmt, self.names, self.new_id = fmt, names, new_id
        self.mode = "lead" if fmt == "llama3" else "content"  # lead | content | call | after
        self.held = ""  # text not yet decided on (a possible opener, whitespace between calls)
        self.call: _Call | None = None
        self.closer = ""  # the last call's closer, looked for after it
        self.calls: list[ToolCall] = []
        self.out: list[str | CallDelta] = []
        self.out_since_call = 0  # content characters since the last call

    def feed(self, text: str) -> list[str | CallDelta]:
        """What ``text`` (the next piece of the reply) makes certain, in order."""
        self.held += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[str | CallDelta]:
        """The end of the reply: whatever was held back is decided now."""
        self._run(final=True)
        if self.call is not None:  # cut short inside a call
            if self.call.id is not None:
                self._close_call()
            else:
                self._fallback()
            self._run(final=True)
        rest, self.held = self.held, ""
        if self.mode == "after" and self.closer.startswith(rest.strip()):
            rest = ""  # a closing tag cut short, or blanks after the last call
        if self.calls and not rest.strip():
            rest = ""
        self._say(rest)
        return self._take()

    def _take(self) -> list[str | CallDelta]:
        merged: list[str | CallDelta] = []
        for item in self.out:  # adjacent content pieces as one
            if isinstance(item, str) and merged and isinstance(merged[-1], str):
                merged[-1] += item
            else:
                merged.append(item)
        self.out = []
        return merged

    def _say(self, text: str) -> None:
        if text:
            self.out.append(text)

    def _run(self, final: bool) -> None:
        step = {"lead": self._lead, "content": self._content, "call": self._call, "after": self._after}
        while self.held and step[self.mode](final):
            pass

    # --- the modes: each takes what it can from ``held`` and says whether it did ----------

    def _lead(self, final: bool) -> bool:
        """llama3: the reply's first non-blank text decides whether it is calls or content."""
        text = self.held.lstrip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(text) and not final:
            return False  # blank, or maybe the start of the tag
        if not text and not final:
            return False
        if text.startswith("{"):
            self.held = text
            self._start_call(tentative=True)
        else:
            self.mode = "content"
        return True

    def _content(self, final: bool) -> bool:
        if self.fmt == "llama3":  # content, to the end
            self._say(self.held)
            self.held = ""
            return False
        start, end, closer, hold = self._opening(final)
        ready = self.held[: start if start >= 0 else hold]
        if self.calls and not ready.strip() and start < 0:
            return False  # blanks after a call: dropped unless content follows (finish drops them)
        if self.calls and self.out_since_call == 0:
            ready = ready.lstrip()  # the text after a call starts at its first word
        self.out_since_call += len(ready)
        self._say(ready)
        if start < 0:
            self.held = self.held[hold:]
            return False
        opener, self.held = self.held[start:end], self.held[end:]
        self._start_call(opener, closer, tentative=opener != OPEN_TAG)
        return True

    def _opening(self, final: bool) -> tuple[int, int, str, int]:
        """hermes: the first call opener in ``held`` as (start, end, closer), or start -1 and how
        much of ``held`` is surely content (the rest could still open a call)."""
        text = self.held
        tag = text.find(OPEN_TAG)
        fence = FENCE.search(text)
        brace = text.find("{")
        found = [(tag, tag + len(OPEN_TAG), CLOSE_TAG)] if tag >= 0 else []
        found += [(fence.start(), fence.end(), "```")] if fence else []
        found += [(brace, brace, "")] if brace >= 0 else []
        if found:
            start, end, closer = min(found)
            return start, end, closer, start
        if final:
            return -1, -1, "", len(text)
        hold = len(text) - _prefix_overlap(text, OPEN_TAG)
        tick = text.find("`")
        while 0 <= tick < hold:
            if FENCE_START.fullmatch(text, tick):
                hold = tick
                break
            tick = text.find("`", tick + 1)
        return -1, -1, "", hold

    def _after(self, final: bool) -> bool:
        """After a call's JSON: its closer (hermes) or ``;`` and the next call (llama3)."""
        text = self.held.lstrip()
        if not text:
            return False
        if self.fmt == "hermes":
            if self.closer and text.startswith(self.closer):
                self.held, self.mode = text[len(self.closer) :], "content"
                return True
            if self.closer.startswith(text) and not final:
                return False
        elif text.startswith(";"):
            rest = text[1:].lstrip()
            if not rest and not final:
                return False
            if rest.startswith("{"):
                self.held = rest
                self._start_call(tentative=True)
                return True
        self.held, self.mode = text, "content"
        return True

    def _call(self, final: bool) -> bool:
        call = self.call
        assert call is not None
        scan = call.scan
        for n, ch in enumerate(self.held):
            try:
                scan.feed(ch, len(call.buf))
            except _Broken:
                self.held = self.held[n:]
                return self._broken()
            call.buf.append(ch)
            if call.tentative and call.id is None and self._not_a_call():
                self.held = self.held[n + 1 :]
                self._fallback()
                return True
            if scan.state == "done":
                self.held = self.held[n + 1 :]
                return self._broken() if self._progress() is None else self._close_call()
        self.held = ""
        self._progress()
        return False

    def _not_a_call(self) -> bool:
        """JSON without a tag is a call only if it opens with a name (llama3: or a type) and
        that name is one of the tools offered."""
        call = self.call
        assert call is not None
        keys = call.scan.keys
        if keys and keys[0] not in (("name", "type") if self.fmt == "llama3" else ("name",)):
            return True
        if "name" in call.scan.values:
            name = call.value("name")
            return not isinstance(name, str) or (self.names is not None and name not in self.names)
        return False

    # --- a call -------------------------------------------------------------------------

    def _start_call(self, opener: str = "", closer: str = "", tentative: bool = False) -> None:
        self.call = _Call(len(self.calls), opener, closer, tentative)
        self.mode = "call"

    def _progress(self) -> str | None:
        """Send what the call's text so far makes certain: its header, then its arguments.
        Returns the call's id once its header is out."""
        call = self.call
        assert call is not None
        scan = call.scan
        if call.id is None:
            if "name" not in scan.values:
                return None
            name = call.value("name")
            if not isinstance(name, str) or not name:
                return None
            call.id, call.name = self.new_id(), name
            self.out.append(CallDelta(call.index, call.id, name, ""))
        key = next((k for k in scan.keys if k in ARGUMENT_KEYS), None)
        if key is None:
            return call.id
        if key in scan.values:
            start, end = scan.values[key]
        elif scan.open_value() == key:
            start, end = scan.value_start, len(call.buf)
        else:
            return call.id
        text = call.text
        if text[start] in "{[":  # streams as it is written
            begin = max(call.args_sent, start)
            if end > begin:
                self._args(text[begin:end])
                call.args_sent = end
        elif key in scan.values and call.args_sent < 0:  # a string or a scalar: once it is whole
            value = call.value(key)
            self._args(value if isinstance(value, str) else "{}" if value is None else text[start:end])
            call.args_sent = end
        return call.id

    def _broken(self) -> bool:
        """The call's text stopped being a call's JSON at the start of ``held``."""
        call = self.call
        assert call is not None
        if self._progress() is None:
            self._fallback()
        else:
            self._close_call()
        return True

    def _fallback(self) -> None:
        """Not a call after all (or it broke before its name was known): its text is content."""
        call = self.call
        assert call is not None
        self._say(call.opener + call.text)
        self.out_since_call += len(call.opener + call.text)
        self.call, self.mode = None, "content"  # what broke it is read as content next

    def _close_call(self) -> bool:
        call = self.call
        assert call is not None and call.id is not None and call.name is not None
        if call.args_sent < 0:  # no arguments written: none needed
            self._args("{}")
        self.calls.append(ToolCall(call.id, call.name, "".join(call.args_text)))
        self.call, self.mode, self.closer, self.out_since_call = None, "after", call.closer, 0
        return True

    def _args(self, piece: str) -> None:
        call = self.call
        assert call is not None
        call.args_sent = max(call.args_sent, 0)
        if piece:
            call.args_text.append(piece)
            self.out.append(CallDelta(call.index, arguments=piece))


def _prefix_overlap(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_calls(
    fmt: str, text: str, names: set[str] | frozenset[str] | None = None, new_id: Callable[[], str] = new_call_id
) -> tuple[str, list[ToolCall]]:
    """A whole reply: its content (the text outside the calls) and its calls."""
    p = ToolCallParser(fmt, names, new_id)
    items = p.feed(text) + p.finish()
    return "".join(i for i in items if isinstance(i, str)), p.calls
