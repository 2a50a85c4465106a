"""Hostile request bodies against a real `specrun serve` on 127.0.0.1: whatever the body
(deep, huge, not UTF-8, not JSON numbers, the wrong types), the answer is a 4xx with an
OpenAI-shaped error, and the server's log holds no traceback. Bodies that are odd but valid
are served (200). Plus the body checks as pure functions (specrun/server/body.py)."""

from __future__ import annotations

import json

import pytest
from serve_helpers import Server

from specrun.server.body import MAX_DEPTH, load_object
from specrun.server.schemas import ApiError

ERROR_KEYS = {"message", "type", "param", "code"}
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
USER = '{"role": "user", "content": "hi"}'


def deep(n: int, inner: str = "1") -> str:
    return "[" * n + inner + "]" * n


def chat_with(extra: str) -> bytes:
    return ('{"messages": [' + USER + "], " + extra + "}").encode()


# (name, path, raw body, status, code or param it must name)
CASES = [
    ("100,000 levels deep", CHAT, deep(100_000).encode(), 400, "invalid_json"),
    ("100,000 objects deep", CHAT, ('{"a":' * 100_000 + "1" + "}" * 100_000).encode(), 400, "invalid_json"),
    (
        "deep inside messages content",
        CHAT,
        ('{"messages": [{"role": "user", "content": ' + deep(100_000, '"x"') + "}]}").encode(),
        400,
        "invalid_json",
    ),
    ("deep under the recursion limit", CHAT, ('{"messages": [' + USER + '], "metadata": ' + deep(500) + "}").encode(), 400, "invalid_json"),
    ("deep inside tools", CHAT, chat_with('"tools": [' + deep(200, "{}") + "]"), 400, "invalid_json"),
    ("NaN temperature", CHAT, chat_with('"temperature": NaN'), 400, "invalid_json"),
    ("Infinity top_p", CHAT, chat_with('"top_p": -Infinity'), 400, "invalid_json"),
    ("a float that overflows", CHAT, chat_with('"temperature": 1e999'), 400, "invalid_json"),
    ("a 5000-digit integer", CHAT, chat_with('"max_tokens": ' + "9" * 5000), 400, "invalid_json"),
    ("a 30-digit seed", CHAT, chat_with('"seed": ' + "1" * 30), 400, "invalid_json"),
    ("a negative seed", CHAT, chat_with('"seed": -5'), 422, "seed"),
    ("not UTF-8", TEXT, b'{"prompt": "\xff\xfe\xfd"}', 400, "invalid_json"),
    ("a lone surrogate", TEXT, b'{"prompt": "abc \\ud800 def"}', 400, "invalid_json"),
    ("a lone surrogate in a key", TEXT, b'{"prompt": "x", "\\udfff": 1}', 400, "invalid_json"),
    ("truncated JSON", CHAT, b'{"messages": [{"role": "user", "content": "hi', 400, "invalid_json"),
    ("empty", CHAT, b"", 400, "invalid_json"),
    ("whitespace", CHAT, b" \r\n\t ", 400, "invalid_json"),
    ("an array", CHAT, b"[1, 2]", 400, "invalid_json"),
    ("a string", CHAT, b'"hello"', 400, "invalid_json"),
    ("null", CHAT, b"null", 400, "invalid_json"),
    ("UTF-16 garbage", CHAT, '{"messages": []}'.encode("utf-16-le")[:-1], 400, "invalid_json"),
    ("messages a string", CHAT, b'{"messages": "hi"}', 422, "messages"),
    ("messages of numbers", CHAT, ('{"messages": [' + ",".join(["1"] * 200_000) + "]}").encode(), 422, "messages[0]"),
    ("content an object", CHAT, b'{"messages": [{"role": "user", "content": {"a": 1}}]}', 422, "messages[0].content"),
    ("role unknown", CHAT, b'{"messages": [{"role": "root", "content": "x"}]}', 422, "messages[0].role"),
    ("max_tokens a string", CHAT, chat_with('"max_tokens": "ten"'), 422, "max_tokens"),
    ("stream a list", CHAT, chat_with('"stream": [1]'), 422, "stream"),
    ("prompt an object", TEXT, b'{"prompt": {"a": 1}}', 422, "prompt"),
    ("prompt of mixed ids", TEXT, b'{"prompt": [1, "a", null]}', 422, "prompt"),
    ("a huge prompt", TEXT, json.dumps({"prompt": "word " * 600_000}).encode(), 400, "prompt"),
    ("a huge unbroken word", TEXT, json.dumps({"prompt": "x" * 1_000_000}).encode(), 400, "prompt"),
    ("100,000 messages", CHAT, ('{"messages": [' + ",".join([USER] * 100_000) + "]}").encode(), 400, "messages"),
    ("a huge stop string", TEXT, json.dumps({"prompt": "x", "stop": "s" * 1_000_000, "max_tokens": 2}).encode(), 400, "stop"),
    (
        "50,000 tools",
        CHAT,
        chat_with('"tools": [' + ",".join(['{"type": "function", "function": {"name": "f"}}'] * 50_000) + "]"),
        400,
        "tools",
    ),
    ("n of 20 digits", CHAT, chat_with('"n": 99999999999999999999'), 400, "n"),
    ("a body over --max-body", TEXT, json.dumps({"prompt": "x" * 5_000_000}).encode(), 413, "request_too_large"),
]

# odd but valid: served
SERVED = [
    ("a seed of -1 (random)", CHAT, chat_with('"seed": -1, "max_tokens": 2')),
    ("a 20-digit max_tokens", CHAT, chat_with('"max_tokens": 99999999999999999999, "stop": ["a"], "temperature": 0')),
    ("a 20-digit top_k", CHAT, chat_with('"max_tokens": 2, "top_k": 99999999999999999999')),
    ("NUL and odd characters", TEXT, json.dumps({"prompt": "a\u0000b\u202e\ufeff\U0001f600", "max_tokens": 2}).encode()),
    ("63 levels of metadata", CHAT, chat_with('"max_tokens": 2, "metadata": ' + deep(MAX_DEPTH - 1))),
    ("a tool call of 1 MB arguments (this template shows no calls)", CHAT, json.dumps({"max_tokens": 2, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{" * 1_000_000}}]},
        {"role": "user", "content": "y"}]}).encode()),
    ("a BOM", TEXT, b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 2}'),
    ("many content parts", CHAT,
     json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 500}], "max_tokens": 2}).encode()),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = Server(["-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024", "--quiet"],
               tmp_path_factory.mktemp("bodies"))  # fmt: skip
    yield s
    s.kill()


@pytest.mark.parametrize("name, path, raw, status, what", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_body_gets_a_4xx_with_the_error_shape(server, name, path, raw, status, what):
    code, _, body = server.post(path, raw, timeout=120)
    assert code == status, (name, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and 0 < len(err["message"]) < 400, err
    assert err["code"] == what or (err["param"] or "").startswith(what), err
    assert "Traceback" not in err["message"] and "internal error" not in err["message"]


@pytest.mark.parametrize("name, path, raw", SERVED, ids=[c[0] for c in SERVED])
def test_an_odd_but_valid_body_is_served(server, name, path, raw):
    code, _, body = server.post(path, raw, timeout=120)
    assert code == 200, (name, body)
    assert body["usage"]["completion_tokens"] >= 1


def test_the_log_holds_no_traceback(server):
    """Run last in this file: every body above has been answered; the server's whole log,
    read after it exits, has no traceback and no internal error."""
    for _, path, raw, *_ in CASES[:3]:  # again, in case this test runs alone
        assert server.post(path, raw)[0] == 400
    assert server.get("/health")[0] == 200
    rc = server.stop()
    assert rc == 143, server.stderr
    assert "Traceback" not in server.stderr and "internal error" not in server.stderr, server.stderr


# --- the checks as functions ---------------------------------------------------------------


def refused(raw: bytes) -> str:
    with pytest.raises(ApiError) as e:
        load_object(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json"
    return e.value.message


def test_depth_is_counted_exactly():
    assert load_object(("{" + '"a":' + deep(MAX_DEPTH - 1) + "}").encode())["a"]
    assert "deeper than" in refused(("{" + '"a":' + deep(MAX_DEPTH) + "}").encode())
    assert "deeper than" in refused(("{" + '"a":' + deep(10**6) + "}").encode())


def test_numbers_strings_and_shapes_are_named():
    assert "integer of 21 digits" in refused(b'{"a": 123456789012345678901}')
    assert load_object(b'{"a": -12345678901234567890}')["a"] == -12345678901234567890
    assert "NaN" in refused(b'{"a": NaN}') and "1e400" in refused(b'{"a": 1e400}')
    assert "\\ud83d" in refused(b'{"a": "\\ud83d"}')
    assert load_object(b'{"a": "\\ud83d\\ude00"}')["a"] == "\U0001f600"  # a whole pair is fine
    assert "not UTF-8" in refused(b'{"a": "\xc3\x28"}')
    assert refused(b"[]").endswith("not an array") and refused(b"3").endswith("not a number")
    assert "empty" in refused(b"")
