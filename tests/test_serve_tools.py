"""Tool calls through `specrun serve`: tools and tool messages rendered by the model's own
chat template, `tool_choice`, the refusals; and, on the real demo target, a parsed
`tool_calls` answer through the `openai` package, whole and streamed, then a final answer
once the tool's result is sent back."""

from __future__ import annotations

import dataclasses
import json

import pytest
from serve_helpers import Server
from tiny_models import CHATML_TEMPLATE, TARGET_SEED, bpe_vocab, make_weights, write_model

from specrun.run.template import ChatTemplate, render_chat, renders_tools
from specrun.run.toolcalls import tool_format
from specrun.server.schemas import ChatRequest

# A short Hermes-style template, as Qwen's shows tools, calls and results
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Paris"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now? Use the tool."}]
ERROR_KEYS = {"message", "type", "param", "code"}


def history(arguments: str = '{"city": "Paris"}') -> list[dict]:
    return ASK + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18, "conditions": "sunny"}'},
    ]  # fmt: skip


def test_tools_calls_and_results_are_rendered_by_the_template():
    req = ChatRequest.model_validate({"messages": history(), "tools": [WEATHER]})
    text = render_chat(ChatTemplate(TOOLS_TEMPLATE), req.conversation(), tools=req.calling())
    assert json.dumps(WEATHER, ensure_ascii=False) in text  # the tool as the template's tojson writes it: keys in order
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text  # arguments as an object
    assert '<tool_response>\n{"temperature_c": 18, "conditions": "sunny"}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
    none = ChatRequest.model_validate({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"})
    assert none.calling() is None and "get_weather" not in render_chat(ChatTemplate(TOOLS_TEMPLATE), none.conversation())


def test_a_template_is_probed_for_tools():
    assert renders_tools(ChatTemplate(TOOLS_TEMPLATE)) and tool_format(TOOLS_TEMPLATE) == "hermes"
    assert not renders_tools(ChatTemplate(CHATML_TEMPLATE)) and not renders_tools(ChatTemplate(None))


@pytest.fixture(scope="module")
def tools_server(tiny, tmp_path_factory):
    home = tmp_path_factory.mktemp("tools")
    vocab = dataclasses.replace(bpe_vocab(), chat_template=TOOLS_TEMPLATE)
    target = write_model(home / "tools-target.gguf", vocab=vocab, weights=make_weights(TARGET_SEED, len(vocab)), name="tiny-tools")
    s = Server(["-m", str(target), "-t", "1", "-c", "2048", "--quiet"], home)
    yield s
    assert s.stop() == 143
    assert "Traceback" not in s.stderr, s.stderr


def test_a_request_with_tools_is_served_with_the_tools_in_its_prompt(tools_server):
    body = {"messages": ASK, "max_tokens": 8, "temperature": 0}
    code, _, plain = tools_server.post("/v1/chat/completions", body)
    assert code == 200, plain
    code, _, r = tools_server.post("/v1/chat/completions", {**body, "tools": [WEATHER], "tool_choice": "auto"})
    assert code == 200, r
    added = len(json.dumps(WEATHER))  # the tool's JSON, tokenized, is in the prompt: at least a token per 8 bytes
    assert r["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + added // 8, (r["usage"], plain["usage"])
    msg = r["choices"][0]
    assert msg["message"]["role"] == "assistant" and msg["finish_reason"] in ("stop", "length", "tool_calls")
    code, _, after = tools_server.post("/v1/chat/completions", {**body, "messages": history(), "tools": [WEATHER]})
    assert code == 200, after
    chunks = list(tools_server.stream("/v1/chat/completions", {**body, "tools": [WEATHER]}))
    assert chunks[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c["choices"])
    assert text == (msg["message"]["content"] or "")  # greedy: streamed and whole agree


def test_with_tools_the_draft_extension_carries_stats_only(tools_server):
    """Text may be held back or turn into a call, so no spans are promised for it."""
    body = {"messages": ASK, "max_tokens": 8, "tools": [WEATHER], "stream_options": {"include_drafts": True}}
    chunks = [c for c in tools_server.stream("/v1/chat/completions", body) if isinstance(c, dict)]
    ext = [c["specrun"] for c in chunks if "specrun" in c]
    assert ext and all(set(e) == {"stats"} for e in ext), ext
    assert ext[-1]["stats"]["generated"] == chunks[-1]["timings"]["predicted_n"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ],
)
def test_unsupported_tool_requests_are_refused_naming_the_field(tools_server, extra, param):
    code, _, r = tools_server.post("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "max_tokens": 4, **extra})
    assert code in (400, 422) and set(r["error"]) == ERROR_KEYS and r["error"]["param"] == param, r


# --- the demo target ------------------------------------------------------------------------


@pytest.mark.demo
def test_demo_template_shows_tools_in_the_hermes_format(demo):
    from specrun.gguf.facts import model_info

    source = model_info(demo["target"]).chat_template
    assert renders_tools(ChatTemplate(source)) and tool_format(source) == "hermes"


@pytest.mark.demo
def test_demo_target_calls_a_tool_through_the_openai_client(demo, demo_store, tmp_path):
    from openai import OpenAI

    # fixed drafting with the model (no calibration at start): every round drafts, the call's JSON included
    args = ["-m", str(demo["target"]), "-d", str(demo["draft"]), "-t", "2", "-c", "2048", "--draft", "model", "--fixed", "--draft-max", "4"]
    s = Server([*args, "--quiet"], tmp_path)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        ask = {"model": model, "messages": ASK, "tools": [WEATHER], "max_tokens": 40, "temperature": 0}
        r = client.chat.completions.create(**ask)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert "paris" in json.loads(call.function.arguments)["city"].lower()
        t = r.model_extra["timings"]
        assert t["draft_n_accepted"] > 0, t  # speculation ran inside the call's JSON (the whole reply is the call)

        # streamed: the deltas rebuild the same call
        name, args, ids, finish = "", "", set(), None
        for chunk in client.chat.completions.create(**ask, stream=True):
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            for tc in d.tool_calls or []:
                assert tc.index == 0
                ids |= {tc.id} if tc.id else set()
                name += (tc.function.name or "") if tc.function else ""
                args += (tc.function.arguments or "") if tc.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and name == "get_weather" and len(ids) == 1
        assert json.loads(args) == json.loads(call.function.arguments)

        # the tool's result goes back: a final answer that uses it ("none": answer now, as clients
        # ask once they have what they need; the 1.5B model calls the tool again if it may)
        messages = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "conditions": "sunny"}'},
        ]
        final = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=32, temperature=0
        )
        answer = final.choices[0]
        assert not answer.message.tool_calls and answer.finish_reason in ("stop", "length"), answer
        assert "18" in answer.message.content, answer.message.content
    finally:
        assert s.stop() == 143
    assert "Traceback" not in s.stderr
