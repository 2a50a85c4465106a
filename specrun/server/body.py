"""A request body as a hostile client may send it: bytes in, a JSON object or a 400 out.

``json.loads`` alone takes bodies no OpenAI request holds, and fails on some in ways that
are not a client's JSON error:

* nesting deeper than the interpreter's recursion limit raises ``RecursionError`` (a 500
  with a traceback, before this module); nesting a little shallower passes, and then every
  later walk over the value (validation, a template's ``tojson``) risks the same;
* ``NaN``, ``Infinity`` and overflowing numbers (``1e999``) are not JSON, and would reach the
  sampler as a temperature;
* an integer of thousands of digits is a ``ValueError`` (Python's 4300-digit cap), and no
  field here takes one wider than 64 bits;
* a ``"\\ud800"`` escape gives a string with a lone surrogate, which cannot be encoded as
  UTF-8, so the tokenizer (or the reply that echoes it) would fail.

Each is refused here with a 400 that names it, before validation sees the body.
"""

from __future__ import annotations

import json
import math
from typing import Any

from specrun.server.schemas import ApiError

__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "load_object"]

MAX_DEPTH = 64  # arrays and objects inside each other; a tool's JSON schema needs a dozen or so
MAX_INT_DIGITS = 20  # 2**64 has 20 digits


class _Refused(Exception):
    pass


def _bad(message: str) -> ApiError:
    return ApiError(400, message, None, "invalid_json")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"the body has an integer of {len(text.lstrip('-'))} digits ({text[:12]}...): no field takes more than 64 bits")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the body has the number {text[:24]}, which overflows a double: send a finite number")
    return value


def _constant(name: str) -> Any:
    raise _Refused(f"the body has {name}, which is not JSON: send a finite number")


def load_object(raw: bytes) -> dict:
    """``raw`` as a JSON object, or an ApiError (400, code ``invalid_json``) naming what is wrong."""
    if not raw.strip():
        raise _bad("the body is empty: send a JSON object")
    try:
        data = json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except _Refused as e:
        raise _bad(str(e)) from None
    except RecursionError:
        raise _bad(f"the body nests arrays or objects deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError as e:
        raise _bad(f"the body is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except ValueError as e:  # JSONDecodeError, and what the decoder's own checks raise
        raise _bad(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _bad(f"the body must be a JSON object, not {_kind(data)}")
    _check(data)
    return data


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(type(value), "null")


def _check(data: dict) -> None:
    """Depth and strings, walked without recursion (the value may be as deep as the parser allowed)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _bad(f"the body nests arrays or objects deeper than {MAX_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key)
            if isinstance(item, str):
                _check_text(item)
            elif isinstance(item, (dict, list)):
                stack.append((item, depth + 1))


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(
            f"the body has a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) in a string: escape whole characters only"
        ) from None
