"""The tool-call parser on hand-written replies: whole, and streamed split at every position
(and in every pair of cuts for the short ones), the stream always joining to the whole."""

from __future__ import annotations

import itertools
import json

import pytest

from specrun.run.toolcalls import CallDelta, ToolCall, ToolCallParser, parse_tool_calls, tool_format


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


WEATHER = '{"city": "Paris", "units": ["c", {"nested": "}{\\"]"}]}'

# (format, reply, content, [(name, arguments)])
CASES = [
    ("hermes", "Just text, no calls.", "Just text, no calls.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + "}\n</tool_call>", "", [("get_weather", WEATHER)]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
     "Let me look.\n", [("a", '{"x": 1}'), ("b", "{}")]),
    ("hermes", '<tool_call>{"arguments": {"q": "first"}, "name": "late_name"}</tool_call>', "", [("late_name", '{"q": "first"}')]),
    ("hermes", '<tool_call>{"name": "no_args"}</tool_call>', "", [("no_args", "{}")]),
    ("hermes", '<tool_call>{"name": "s", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("s", '{"a": 1}')]),
    ("hermes", '<tool_call>{"name": "u", "arguments": {"t": "caf\\u00e9 \u65e5\u672c"}}</tool_call>', "", [("u", '{"t": "caf\\u00e9 \u65e5\u672c"}')]),
    ("hermes", "I use <tool_call> tags like <tool_call>this</tool_call>.", "I use <tool_call> tags like <tool_call>this</tool_call>.", []),
    ("hermes", "a < b and <tool_ and <tool_call", "a < b and <tool_ and <tool_call", []),
    ("hermes", '<tool_call>{"name": "cut", "arguments": {"text": "half', "", [("cut", '{"text": "half')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\nDone: see above.', "Done: see above.", [("f", '{"a": 1}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', "", [("f", '{"a": 1}')]),
    ("hermes", '<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
    ("llama3", '{"name": "get_weather", "parameters": ' + WEATHER + "}", "", [("get_weather", WEATHER)]),
    ("llama3", '  <|python_tag|>{"type": "function", "name": "f", "parameters": {"a": [1, 2]}}', "", [("f", '{"a": [1, 2]}')]),
    ("llama3", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": null}}', "", [("a", "{}"), ("b", '{"k": null}')]),
    ("llama3", '{"answer": 42, "name": "not a call"}', '{"answer": 42, "name": "not a call"}', []),
    ("llama3", "The answer is {\"name\": \"x\"}", "The answer is {\"name\": \"x\"}", []),
    ("llama3", "  plain text", "  plain text", []),
    ("llama3", '{"name": "f", "parameters": {"a": 1}} and then some words', "and then some words", [("f", '{"a": 1}')]),
]  # fmt: skip
NAMES = frozenset({"get_weather", "f"})
# JSON without a tag (fenced, as small Qwen models write it, or bare) is a call when it names an offered tool
NAMED = [
    ("hermes", '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```', "", [("get_weather", '{"city": "Paris"}')]),
    ("hermes", 'Sure: {"name": "get_weather", "arguments": {"city": "Paris"}} done', "Sure: done", [("get_weather", '{"city": "Paris"}')]),
    ("hermes", '```\n{"name": "f", "arguments": {}}\n```\n```json\n{"name": "f"}\n```', "", [("f", "{}"), ("f", "{}")]),
    ("hermes", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("hermes", "```python\nx = {'a': 1}\n```", "```python\nx = {'a': 1}\n```", []),
    ("hermes", '```json\n{"a": 1}\n```', '```json\n{"a": 1}\n```', []),
    ("hermes", "use {x} and {y} and ``` and `", "use {x} and {y} and ``` and `", []),
    ("hermes", '<tool_call>{"name": "anything", "arguments": {}}</tool_call>', "", [("anything", "{}")]),
    ("llama3", '{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', []),
]  # fmt: skip
ALL = [(*c, None) for c in CASES] + [(*c, NAMES) for c in NAMED]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(ALL)]


def stream(fmt: str, pieces: list[str], names=None) -> tuple[str, list[ToolCall], list[CallDelta]]:
    """Feed ``pieces``; rebuild the content and calls from the deltas alone, as a client does."""
    p = ToolCallParser(fmt, names, new_id=ids())
    items = [x for piece in pieces for x in p.feed(piece)] + p.finish()
    content = "".join(x for x in items if isinstance(x, str))
    deltas = [x for x in items if isinstance(x, CallDelta)]
    calls: dict[int, list] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls and d.index == len(calls), "a call's header comes first, once, in index order"
            calls[d.index] = [d.id, d.name, d.arguments]
        else:
            assert d.index in calls, "arguments before the call's header"
            calls[d.index][2] += d.arguments
    rebuilt = [ToolCall(i, n, a) for i, n, a in calls.values()]
    assert rebuilt == p.calls
    return content, rebuilt, deltas


@pytest.mark.parametrize("fmt, reply, content, calls, names", ALL, ids=IDS)
def test_whole_replies(fmt, reply, content, calls, names):
    got_content, got_calls = parse_tool_calls(fmt, reply, names, new_id=ids())
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        if c.arguments.rstrip().endswith("}"):
            json.loads(c.arguments)  # what the model wrote whole is JSON text


@pytest.mark.parametrize("fmt, reply, content, calls, names", ALL, ids=IDS)
def test_streamed_split_anywhere_equals_whole(fmt, reply, content, calls, names):
    whole = parse_tool_calls(fmt, reply, names, new_id=ids())
    for cut in range(len(reply) + 1):
        assert stream(fmt, [reply[:cut], reply[cut:]], names)[:2] == whole, cut
    assert stream(fmt, list(reply), names)[:2] == whole  # a character at a time
    if len(reply) <= 80:
        for a, b in itertools.combinations(range(len(reply) + 1), 2):
            assert stream(fmt, [reply[:a], reply[a:b], reply[b:]], names)[:2] == whole, (a, b)


def test_arguments_stream_as_they_are_written():
    """The header goes out as soon as the name is whole, and each argument character as soon
    as it arrives (the draft-friendly part: nothing waits for the end of the call)."""
    reply = '<tool_call>{"name": "f", "arguments": {"path": "a/b.py"}}</tool_call>'
    p = ToolCallParser("hermes", new_id=ids())
    seen: list = []
    for ch in reply:
        seen.append(p.feed(ch))
    name_done = reply.index('"f"') + len('"f"') - 1
    assert seen[name_done] == [CallDelta(0, "call_0", "f", "")]
    args_start = reply.index('{"path"')
    for i in range(args_start, args_start + len('{"path": "a/b.py"}')):
        assert seen[i] == [CallDelta(0, arguments=reply[i])], i
    assert p.finish() == [] and not any(isinstance(x, str) for s in seen for x in s)


def test_text_that_may_be_a_tag_is_held_back_only_while_it_may():
    p = ToolCallParser("hermes", new_id=ids())
    assert p.feed("x <tool") == ["x "]
    assert p.feed("box") == ["<toolbox"]
    assert p.feed("<") == [] and p.finish() == ["<"]


def test_the_format_comes_from_the_template():
    assert tool_format("... <tool_call>\n{{ tool_call.name }} ...") == "hermes"
    assert tool_format("<|start_header_id|>ipython<|end_header_id|> ... parameters") == "llama3"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_format(None) is None
    with pytest.raises(ValueError):
        ToolCallParser("mistral")


def test_the_openai_delta_shape():
    assert CallDelta(0, "call_x", "f", "").to_openai() == {
        "index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}
    }  # fmt: skip
    assert CallDelta(2, arguments='{"a"').to_openai() == {"index": 2, "function": {"arguments": '{"a"'}}
