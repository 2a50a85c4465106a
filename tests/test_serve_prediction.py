"""OpenAI's Predicted Outputs through `specrun serve`, a real process on 127.0.0.1, with the real
`openai` client: the answer is the same with a prediction or without, right or wrong; `usage`
says how much of the prediction the answer followed; a bad prediction is an OpenAI-shaped
error. Tiny generated models, and one check on the demo pair (marked demo)."""

from __future__ import annotations

import pytest
from serve_helpers import Server

from specrun.llama import LoadOptions, Model

# The tiny models write random tokens, bytes that are not UTF-8 among them: the reply's text,
# sent back as a prediction, reads as other tokens where it holds a U+FFFD. These prompts' replies
# read back the most alike (about 2 tokens in 3); the engine's own tests (tests/test_prediction.py)
# and the demo check below give predictions the reply follows to the end.
PROMPT = "word if char in"
CHAT = [{"role": "user", "content": "-> None: self.value = start"}]
N = 60


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = Server(["-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024"], tmp_path_factory.mktemp("predict"))
    yield s
    rc = s.stop()
    assert rc == 143, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def n_tokens(tiny):
    """A text's length in tokens, as the server reads a prediction."""
    with Model(tiny["target"], LoadOptions(n_ctx=256, n_threads=1)) as m:
        yield lambda text: len(m.tokenize(text, add_special=False, parse_special=True))


def wrongly(text: str) -> str:
    """The text with a line's worth deleted, a word replaced and a line inserted."""
    cut = len(text) // 3
    return text[:cut] + text[cut + 12 :].replace(" ", " and ", 1) + "\nan inserted line\n" if len(text) > 40 else "no"


def details(usage) -> tuple[int, int]:
    d = usage.completion_tokens_details
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens


def test_chat_answers_the_same_with_a_prediction_right_partly_wrong_or_wrong(client, n_tokens):
    ask = dict(model="target.gguf", messages=CHAT, max_tokens=N, temperature=0)
    plain = client.chat.completions.create(**ask)
    text = plain.choices[0].message.content
    assert text and details(plain.usage) == (0, 0)  # no prediction: nothing accepted or rejected
    cases = {"right": text, "partly wrong": wrongly(text), "wrong": "Completely unrelated words about the weather in spring. " * 3}
    for name, predicted in cases.items():
        r = client.chat.completions.create(**ask, prediction={"type": "content", "content": predicted})
        assert r.choices[0].message.content == text, name
        assert r.choices[0].finish_reason == plain.choices[0].finish_reason
        accepted, rejected = details(r.usage)
        assert accepted + rejected == n_tokens(predicted), name  # every prediction token is one or the other
        assert accepted <= r.usage.completion_tokens
        if name == "right":
            assert r.usage.completion_tokens == N and accepted >= N / 2, (accepted, r.usage)
            assert r.model_extra["timings"]["draft_n_accepted"] >= accepted / 2  # drafted from, not only counted
        if name == "wrong":
            assert accepted <= 4, accepted


def test_completions_take_a_prediction_in_text_parts_and_stream_its_usage(client, n_tokens):
    ask = dict(model="target.gguf", prompt=PROMPT, max_tokens=N, temperature=0)
    plain = client.completions.create(**ask)
    text = plain.choices[0].text
    half = len(text) // 2
    parts = [{"type": "text", "text": text[:half]}, {"type": "text", "text": text[half:]}]
    r = client.completions.create(**ask, extra_body={"prediction": {"type": "content", "content": parts}})
    assert r.choices[0].text == text
    accepted, rejected = details(r.usage)
    assert accepted + rejected == n_tokens(text) and accepted >= N / 2
    chunks = list(
        client.completions.create(**ask, stream=True, stream_options={"include_usage": True},
                                  extra_body={"prediction": {"type": "content", "content": wrongly(text)}})
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    accepted, rejected = details(chunks[-1].usage)
    assert accepted + rejected == n_tokens(wrongly(text)) and 0 < accepted < n_tokens(wrongly(text))


def test_drafts_from_a_prediction_are_shown_as_such(server):
    """(Each request as a user of its own: no earlier reply of theirs offers the same text.)"""
    status, _, plain = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "user": "shown-1"})
    assert status == 200, plain
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "prediction": {"type": "content", "content": plain["choices"][0]["text"]},
            "stream_options": {"include_drafts": True}, "user": "shown-2"}  # fmt: skip
    chunks = [c for c in server.stream("/v1/completions", body) if isinstance(c, dict) and c.get("specrun")]
    spans = [s for c in chunks for s in c["specrun"].get("spans", ())]  # (the last chunk has stats only)
    assert "".join(t for t, _ in spans) == plain["choices"][0]["text"]
    assert any(source == "prediction" for _, source in spans)
    assert chunks[-1]["specrun"]["stats"]["by_source"]["prediction"]["accepted"] > 0


@pytest.mark.parametrize(
    "path, prediction, status, param",
    [
        ("/v1/chat/completions", "just a string", 422, "prediction"),
        ("/v1/chat/completions", {"type": "file", "content": "x"}, 422, "prediction.type"),
        ("/v1/chat/completions", {"type": "content"}, 422, "prediction.content"),
        ("/v1/chat/completions", {"type": "content", "content": 5}, 422, "prediction.content"),
        ("/v1/chat/completions", {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, 400,
         "prediction.content[0].type"),
        ("/v1/completions", {"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}, 400,
         "prediction.content[1].type"),
        ("/v1/chat/completions", {"type": "content", "content": "word " * 1500}, 400, "prediction"),  # over the 1024-token context
        ("/v1/completions", {"type": "content", "content": "word " * 40_000}, 400, "prediction"),  # counted in pieces, never whole
    ],
)  # fmt: skip
def test_a_bad_prediction_gets_an_openai_error_naming_it(server, path, prediction, status, param):
    body = {"prediction": prediction, "max_tokens": 4, **({"messages": CHAT} if "chat" in path else {"prompt": PROMPT})}
    for stream in (False, True):  # refused before a stream starts: a status, not an event
        code, _, r = server.post(path, {**body, "stream": stream})
        assert code == status, r
        assert set(r) == {"error"} and set(r["error"]) == {"message", "type", "param", "code"}, r
        assert r["error"]["param"] == param and r["error"]["type"] == "invalid_request_error", r
        assert "Traceback" not in r["error"]["message"] and "--" not in r["error"]["message"].replace("--ctx", "")
        if param == "prediction" and status == 400:
            assert r["error"]["code"] == "context_length_exceeded" and "1024" in r["error"]["message"]


def test_an_empty_prediction_is_none(client):
    r = client.completions.create(model="target.gguf", prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"prediction": {"type": "content", "content": ""}})  # fmt: skip
    assert details(r.usage) == (0, 0)


@pytest.mark.demo
def test_demo_pair_edits_a_file_the_same_with_its_prediction(demo, demo_store, tmp_path):
    """A coding agent's edit: the file goes in the prompt and, as it is, in the prediction."""
    source = (
        "def mean(values):\n"
        "    total = 0\n"
        "    for v in values:\n"
        "        total += v\n"
        "    return total / len(values)\n"
        "\n"
        "\n"
        "def spread(values):\n"
        "    return max(values) - min(values)\n"
    )
    messages = [
        {"role": "system", "content": "You edit code. Reply with the whole edited file in one Python code block, nothing else."},
        {"role": "user", "content": f"Rename the parameter `values` to `xs` everywhere in this file:\n\n```python\n{source}```"},
    ]
    s = Server(["-m", str(demo["target"]), "-d", str(demo["draft"]), "-t", "2", "-c", "2048", "--quiet"], tmp_path)
    try:
        body = {"messages": messages, "max_tokens": 120, "temperature": 0}
        status, _, plain = s.post("/v1/chat/completions", body, timeout=600)
        assert status == 200, plain
        predicted = f"```python\n{source}```"
        status, _, r = s.post("/v1/chat/completions", {**body, "prediction": {"type": "content", "content": predicted}}, timeout=600)
        assert status == 200, r
    finally:
        assert s.stop() == 143
    assert r["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert "xs" in r["choices"][0]["message"]["content"]
    d = r["usage"]["completion_tokens_details"]
    assert d["accepted_prediction_tokens"] > 0 and d["rejected_prediction_tokens"] > 0  # most lines kept, the renamed ones not
    assert d["accepted_prediction_tokens"] <= r["usage"]["completion_tokens"]
