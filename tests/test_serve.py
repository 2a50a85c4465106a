"""`specrun serve` as a real process on 127.0.0.1, with real clients: the `openai` package and
plain http.client. Tiny generated models (`-t 1`: one thread is fastest for a 64-wide model on
a busy machine); one end-to-end check on the demo pair.

Every loop here is bounded in count and time, and every request goes to the loopback address
the server printed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
from serve_helpers import SPECRUN, Server

from specrun.server.run import is_loopback, listen

PROMPT = "The quick brown fox"  # greedy from here runs to the end of the context, no EOS
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a function that adds two numbers."}]
ERROR_KEYS = {"message", "type", "param", "code"}
BATCH_NOISE = 0.5  # llama.cpp's batched vs one-token logits (see tests/test_demo_pair.py)


def tiny_args(tiny, *extra: str) -> list[str]:
    return ["-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024", *extra]


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = Server(tiny_args(tiny, "--max-body", "200000"), tmp_path_factory.mktemp("serve"))
    yield s
    rc = s.stop()
    assert rc == 143, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


def error_of(status: int, body, want_status: int, param: str | None = None) -> dict:
    """The OpenAI error object, checked: the status, the four keys, the param."""
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def generate_json(tiny, *args: str) -> dict:
    p = subprocess.run(
        [str(SPECRUN), "generate", "-m", str(tiny["target"]), "-t", "1", "-c", "1024", "--draft", "none", "--json", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def assert_same_up_to_near_tie(model_path, prompt_tokens: list[int], plain: dict, served_text: str) -> None:
    """Identical text, or the first difference sits where the plain run's own top-two gap is
    below llama.cpp's batch noise (the documented near-tie rule). A wrong accept or a bad
    rollback shows up at a confident position and fails this."""
    if served_text == plain["text"]:
        return
    from specrun.llama import LoadOptions, Model

    common = len(os.path.commonprefix([served_text, plain["text"]]))
    with Model(model_path, LoadOptions(n_ctx=4096, n_threads=1)) as m:
        tokens = plain["tokens"]
        i = next(i for i in range(len(tokens)) if len(m.detokenize(tokens[: i + 1]).decode("utf-8", "replace")) > common)
        m.eval(prompt_tokens[:-1], logits="none")
        row = None
        for x in (prompt_tokens + tokens)[len(prompt_tokens) - 1 : len(prompt_tokens) + i]:
            row = m.eval([x], logits="last")[0]
        top2 = np.partition(row, -2)[-2:]
        gap = float(abs(top2[1] - top2[0]))
    assert gap < BATCH_NOISE, f"served text differs from plain decoding at token {i}, where the plain gap is {gap:.3f} (confident)"


# --- the openai package --------------------------------------------------------------------


def test_the_openai_client_chats_streams_completes_and_lists(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=60)
    models = client.models.list()
    assert [m.id for m in models.data] == ["target.gguf"]

    r = client.chat.completions.create(model="target.gguf", messages=CHAT, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 10
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    t = r.model_extra["timings"]
    assert t["predicted_n"] == r.usage.completion_tokens and t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens

    chunks = list(client.chat.completions.create(model="target.gguf", messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                                  stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # greedy: streamed and whole agree
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [r.choices[0].finish_reason]

    c = client.completions.create(model="target.gguf", prompt=PROMPT, max_tokens=16, temperature=0)
    assert c.object == "text_completion" and c.choices[0].text and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 16
    streamed = "".join(
        x.choices[0].text for x in client.completions.create(model="target.gguf", prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    )
    assert streamed == c.choices[0].text


# --- exactness and the prompt cache --------------------------------------------------------


@pytest.mark.parametrize("draft", [None, "none", "model", "ngram"])
def test_greedy_completion_equals_plain_generate(server, tiny, draft):
    plain = generate_json(tiny, "-p", PROMPT, "-n", "60")
    body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0}
    if draft:
        body["draft"] = draft
    status, _, r = server.post("/v1/completions", body)
    assert status == 200, r
    assert r["usage"]["completion_tokens"] == len(plain["tokens"]) == 60
    from specrun.llama import LoadOptions, Model

    with Model(tiny["target"], LoadOptions(n_ctx=256, n_threads=1)) as m:
        prompt_tokens = m.tokenize(PROMPT, add_special=True, parse_special=True)
    assert_same_up_to_near_tie(tiny["target"], prompt_tokens, plain, r["choices"][0]["text"])
    if draft == "none":
        assert r["timings"]["draft_n"] == 0


def test_greedy_chat_equals_plain_generate_chat(server, tiny):
    plain = generate_json(tiny, "--chat", "--system", CHAT[0]["content"], "-p", CHAT[1]["content"], "-n", "40")
    status, _, r = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 40, "temperature": 0})
    assert status == 200, r
    assert r["choices"][0]["message"]["content"] == plain["text"]
    assert r["choices"][0]["finish_reason"] == {"stop": "stop", "length": "length"}[plain["finish_reason"]]


def test_a_second_turn_reuses_the_first_from_the_cache(server, tiny):
    first = [{"role": "user", "content": "Tell me about foxes and dogs."}]
    s1, _, r1 = server.post("/v1/chat/completions", {"messages": first, "max_tokens": 30})
    assert s1 == 200, r1
    reply = r1["choices"][0]["message"]["content"]
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And cats?"}]
    s2, _, r2 = server.post("/v1/chat/completions", {"messages": second, "max_tokens": 8})
    assert s2 == 200, r2
    u1, u2, t2 = r1["usage"], r2["usage"], r2["timings"]
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    # the whole first turn, its reply included, came from the cache (the reply's last token
    # was still pending if it ended on the length limit)
    assert cached >= u1["prompt_tokens"] + u1["completion_tokens"] - 1, (u1, u2)
    assert t2["cache_n"] == cached and t2["prompt_n"] == u2["prompt_tokens"] - cached  # only the new tokens were evaluated
    from specrun.llama import LoadOptions, Model

    with Model(tiny["target"], LoadOptions(n_ctx=256, n_threads=1)) as m:  # what the template adds after the reply
        new = m.tokenize(
            "<|im_end|>\n<|im_start|>user\nAnd cats?<|im_end|>\n<|im_start|>assistant\n", add_special=False, parse_special=True
        )
    assert t2["prompt_n"] <= len(new) + 1, (t2, len(new))


def test_eight_concurrent_clients_each_get_what_they_would_alone(server):
    prompts = [f"{PROMPT} number {i}" for i in range(8)]

    def ask(p: str) -> str:
        status, _, r = server.post("/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0})
        assert status == 200, r
        return r["choices"][0]["text"]

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts, timeout=120))
    assert together == alone
    assert len(set(alone)) > 1  # the prompts differ, and so do the answers


def test_a_seed_makes_sampling_reproducible(server):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.9, "draft": "none"}
    a = [server.post("/v1/completions", {**body, "seed": 7})[2]["choices"][0]["text"] for _ in range(2)]
    b = server.post("/v1/completions", {**body, "seed": 8})[2]["choices"][0]["text"]
    assert a[0] == a[1] and a[0] != b


def test_per_request_speculative_settings(server):
    before = server.metrics()
    status, _, r = server.post(
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 60, "draft": "model", "speculative": {"n_max": 2, "n_min": 1, "p_min": 0.0, "fixed": True}},
    )
    assert status == 200, r
    after = server.metrics()
    rounds = after["specrun_draft_length_count"] - before["specrun_draft_length_count"]
    at_most_2 = after['specrun_draft_length_bucket{le="2.0"}'] - before['specrun_draft_length_bucket{le="2.0"}']
    assert rounds > 0 and at_most_2 == rounds  # no round drafted more than n_max
    assert r["timings"]["draft_n"] > 0 and after.get('specrun_rounds_total{source="ngram"}', 0) == before.get(
        'specrun_rounds_total{source="ngram"}', 0
    )


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"messages": "hello"}, 422, "messages"),
        ({}, 422, "messages"),
        ({"messages": CHAT, "max_tokens": "ten"}, 422, "max_tokens"),
        ({"messages": CHAT, "max_tokens": -5}, 422, "max_tokens"),
        ({"messages": CHAT, "max_tokens": 0}, 422, "max_tokens"),
        ({"messages": CHAT, "temperature": -1}, 422, "temperature"),
        ({"messages": CHAT, "top_p": 0}, 422, "top_p"),
        ({"messages": CHAT, "stop": 5}, 422, "stop"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 422, "messages[0].role"),
        ({"messages": CHAT, "n": 2}, 400, "n"),
        ({"messages": CHAT, "logprobs": True}, 400, "logprobs"),
        ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "messages[0].content[0].type",
        ),
        ({"messages": CHAT, "draft": "bogus"}, 422, "draft"),
        ({"messages": CHAT, "speculative": {"n_max": 0}}, 422, "speculative.n_max"),
        ({"messages": CHAT, "speculative": {"n_max": 2, "n_min": 5}}, 422, "speculative.n_min"),
        ({"messages": CHAT, "speculative": {"p_min": 1.5}}, 422, "speculative.p_min"),
        ({"messages": CHAT, "model": "gpt-4o"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "word " * 1500}]}, 400, "messages"),
    ],
)
def test_bad_chat_requests_get_an_openai_error(server, body, status, param):
    code, headers, r = server.post("/v1/chat/completions", body)
    err = error_of(code, r, status, param)
    assert "Traceback" not in err["message"] and "--" not in err["message"].replace("--ctx", "")  # JSON fields, not flags
    if status == 404:
        assert "target.gguf" in err["message"]  # names the served model
    if param == "messages" and status == 400:
        assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": ["a", "b"]}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
        ({"prompt": "x", "echo": True}, 400, "echo"),
        ({"prompt": "word " * 1500}, 400, "prompt"),
        ({"prompt": PROMPT, "max_tokens": -1}, 422, "max_tokens"),
    ],
)
def test_bad_completion_requests_get_an_openai_error(server, body, status, param):
    code, _, r = server.post("/v1/completions", body)
    error_of(code, r, status, param)


def test_a_huge_max_tokens_is_capped_at_the_context_and_said_so(server):
    status, headers, r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**12})
    assert status == 200, r
    room = 1024 - r["usage"]["prompt_tokens"]
    assert "capped at" in headers["x-specrun-notice"] and str(room) in headers["x-specrun-notice"]
    assert r["notices"] and r["usage"]["completion_tokens"] <= room
    assert r["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_body_over_max_body_gets_413_also_when_chunked(server):
    big = {"prompt": "x" * 300_000}
    error_of(*server.post("/v1/completions", big)[::2], 413)
    c = server.conn()
    try:  # no Content-Length: the limit is counted as the body streams in
        c.putrequest("POST", "/v1/completions")
        c.putheader("Content-Type", "application/json")
        c.putheader("Transfer-Encoding", "chunked")
        c.endheaders()
        data = json.dumps(big).encode()
        for i in range(0, len(data), 65536):
            part = data[i : i + 65536]
            c.send(b"%x\r\n%s\r\n" % (len(part), part))
        c.send(b"0\r\n\r\n")
        r = c.getresponse()
        error_of(r.status, json.loads(r.read()), 413)
    finally:
        c.close()


def test_unknown_routes_and_methods_get_the_error_shape(server):
    code, _, r = server.get("/v1/nothing")
    error_of(code, r, 404)
    code, _, r = server.get("/v1/chat/completions")
    error_of(code, r, 405)
    code, _, r = server.get("/v1/models/gpt-4o")
    error_of(code, r, 404, "model")


def test_health_and_metrics(server):
    status, _, r = server.get("/health")
    assert status == 200 and r["status"] == "ok"
    m = server.metrics()
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:spec_decode_num_draft_tokens_total",
                 "llamacpp:spec_decode_num_accepted_tokens_total", "llamacpp:spec_decode_num_drafts_total", "llamacpp:requests_processing"):  # fmt: skip
        assert name in m, name


# --- metrics agree with timings -------------------------------------------------------------


def test_prometheus_counters_agree_with_the_responses_timings(server):
    before = server.metrics()
    sums = {"prompt_n": 0, "predicted_n": 0, "draft_n": 0, "draft_n_accepted": 0, "cache_n": 0}
    bodies = [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 40}),
        ("/v1/completions", {"prompt": PROMPT + " jumps", "max_tokens": 30, "draft": "ngram", "speculative": {"fixed": True}}),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 30, "draft": "model", "speculative": {"fixed": True, "n_max": 4, "p_min": 0}},
        ),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 30, "temperature": 0.8, "seed": 1}),
    ]
    for path, body in bodies:
        status, _, r = server.post(path, body)
        assert status == 200, r
        for k in sums:
            sums[k] += r["timings"][k]
    for path, body in bodies[1:3]:  # streamed: the timings ride on the last chunk
        last = [c for c in server.stream(path, body) if isinstance(c, dict) and c.get("timings")][-1]
        for k in sums:
            sums[k] += last["timings"][k]
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("llamacpp:prompt_tokens_total") == sums["prompt_n"]
    assert delta("llamacpp:tokens_predicted_total") == sums["predicted_n"]
    assert delta("llamacpp:spec_decode_num_draft_tokens_total") == sums["draft_n"]
    assert delta("llamacpp:spec_decode_num_accepted_tokens_total") == sums["draft_n_accepted"]
    assert delta("specrun_prompt_cached_tokens_total") == sums["cache_n"]
    per_pos = sum(delta(k) for k in after if k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == sums["draft_n_accepted"] and sums["draft_n"] > 0
    by_source = sum(delta(k) for k in after if k.startswith("specrun_draft_tokens_total"))
    assert by_source == sums["draft_n"]


# --- disconnects ----------------------------------------------------------------------------


def test_a_client_that_leaves_mid_stream_cancels_and_the_next_request_is_served(server):
    expected = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "temperature": 0})[2]["choices"][0]["text"]
    before = server.metrics()
    c = server.conn()
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": "Once upon a time", "max_tokens": 1000, "stream": True}),
              headers={"Content-Type": "application/json"})  # fmt: skip
    r = c.getresponse()
    got = 0
    for line in iter(r.readline, b""):
        got += line.startswith(b"data: ")
        if got >= 3:
            break
    c.sock.shutdown(2)  # the client goes away mid-stream
    c.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = server.metrics()
        if after.get('specrun_requests_total{finish_reason="interrupted"}', 0) > before.get(
            'specrun_requests_total{finish_reason="interrupted"}', 0
        ):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the abandoned stream was not cancelled")
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] < 1000
    status, _, r2 = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "temperature": 0})
    assert status == 200 and r2["choices"][0]["text"] == expected


def test_a_client_that_leaves_mid_body_gets_no_traceback_in_the_log(server):
    """A body shorter than its Content-Length, then the socket closed: the body parser raises
    Starlette's ClientDisconnect, which has a handler of its own (an empty 499 nobody reads).
    Without it the catch-all handler re-raised it and uvicorn logged "Exception in ASGI
    application" with a traceback. The next request's line on the terminal comes after the
    abandoned one was handled, so the log is read once that line is there."""
    seen = len(server.stderr)
    served = server.stderr.count("completion 127.0.0.1")
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        sock.sendall(head + b'{"prompt": "The quick')  # 21 of the 1000 bytes promised
    finally:
        sock.close()
    status, _, r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200, r
    deadline = time.monotonic() + 30
    while server.stderr.count("completion 127.0.0.1") <= served and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.stderr[seen:]
    assert "completion 127.0.0.1" in log, log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


# --- other servers: a key and a queue, SIGTERM, the soak ----------------------------------------


def test_api_key_queue_limit_and_429(tiny, tmp_path):
    s = Server(
        tiny_args(tiny, "--max-queue", "1", "--parallel", "1"), tmp_path, env={"SPECRUN_API_KEY": "sekrit"}
    )  # one slot: one runs, one waits
    try:
        assert "API key required" in s.stderr
        auth = {"Authorization": "Bearer sekrit"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            code, h, r = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers=headers)
            assert error_of(code, r, 401)["code"] == "invalid_api_key" and h.get("www-authenticate") == "Bearer"
        error_of(*s.get("/v1/models")[::2], 401)
        assert s.get("/health")[0] == 200 and s.get("/metrics")[0] == 200  # open without a key
        assert s.get("/v1/models", headers=auth)[0] == 200

        # one running, one waiting, the third is refused with Retry-After
        first = s.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 900}, headers=auth)
        next(first)
        results: list = []
        waiter = threading.Thread(
            target=lambda: results.append(s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, headers=auth))
        )
        waiter.start()
        deadline = time.monotonic() + 30
        while s.get("/health")[2]["queued"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        code, h, r = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, headers=auth)
        assert error_of(code, r, 429)["code"] == "queue_full" and int(h["retry-after"]) >= 1
        rest = list(first)  # the first finishes, then the waiting one runs
        assert rest[-1] == "[DONE]"
        waiter.join(60)
        assert results and results[0][0] == 200
        assert s.metrics()["specrun_requests_rejected_total"] == 1
    finally:
        assert s.stop() == 143
    assert "Traceback" not in s.stderr


def test_sigterm_during_a_stream_ends_it_with_a_finish_reason_and_exits_143(tiny, tmp_path):
    s = Server(tiny_args(tiny, "-c", "4096", "--quiet", "--parallel", "1"), tmp_path)  # one slot: one runs, one waits
    try:
        events = s.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 4000})
        first = next(events)
        assert first["choices"][0]["finish_reason"] is None
        queued: list = []
        waiter = threading.Thread(target=lambda: queued.append(s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})))
        waiter.start()
        deadline = time.monotonic() + 30
        while s.get("/health")[2]["queued"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.proc.send_signal(signal.SIGTERM)
        rest = list(events)
        assert rest[-1] == "[DONE]"
        finals = [e for e in rest if isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "interrupted"
        assert finals[0]["timings"]["predicted_n"] < 4000
        waiter.join(30)
        assert queued and error_of(queued[0][0], queued[0][2], 503)["code"] == "shutting_down"
        rc = s.wait(30)
        assert rc == 143
    finally:
        s.kill()
    assert "Traceback" not in s.stderr
    assert "tok/s" not in s.stderr  # --quiet: no per-request lines
    assert "stopped by SIGTERM" in s.stderr


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_right_after_listening_still_ends_in_order(tiny, tmp_path, sig, code):
    """A signal as soon as "listening on" is printed (a service manager that stops what it just
    started): the documented exit code and the closing line, as for any stop (the code before
    died by the signal, its learned state unsaved)."""
    s = Server(tiny_args(tiny), tmp_path)
    rc = s.stop(sig)
    assert rc == code, s.stderr
    assert f"stopped by {sig.name}" in s.stderr and "Traceback" not in s.stderr


def test_the_terminal_shows_each_request(server):
    server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
    deadline = time.monotonic() + 10
    while "completion 127.0.0.1" not in server.stderr and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(ln for ln in server.stderr.splitlines() if "completion 127.0.0.1" in ln)
    assert "tok/s" in line and "accept" in line and "rounds" in line and "cached" in line


def test_soak_200_requests_rss_growth_under_50_mb(tiny, tmp_path):
    s = Server(tiny_args(tiny, "--quiet"), tmp_path)
    try:
        proc = psutil.Process(s.proc.pid)
        bodies = [
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12}),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "temperature": 0.7}),
            ("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 12, "draft": "ngram", "speculative": {"n_max": 4}}),
            ("/v1/chat/completions", {"messages": CHAT + [{"role": "user", "content": "again"}], "max_tokens": 12, "draft": "none"}),
        ]
        base = 0.0
        for i in range(200):
            if i == 40:
                base = proc.memory_info().rss / 2**20
            path, body = bodies[i % len(bodies)]
            if i % 3 == 0:
                assert list(s.stream(path, body))[-1] == "[DONE]"
            else:
                assert s.post(path, body)[0] == 200
        growth = proc.memory_info().rss / 2**20 - base
        assert growth < 50, f"RSS grew {growth:.1f} MB over 160 requests"
    finally:
        assert s.stop() == 143


def test_a_taken_port_fails_before_loading(server, tiny):
    p = subprocess.run([str(SPECRUN), "serve", *tiny_args(tiny), "--port", str(server.port)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1].startswith("specrun: error: cannot listen on 127.0.0.1:") and "Traceback" not in p.stderr


def test_loopback_is_told_from_other_addresses():
    sock = listen("127.0.0.1", 0)
    try:
        assert is_loopback(sock)
    finally:
        sock.close()
    from specrun.cli.serve import exposure_warning

    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("0.0.0.0", None) and "API key" in exposure_warning("192.168.1.5", None)
    assert exposure_warning("0.0.0.0", "k") is None


# --- the demo pair --------------------------------------------------------------------------


@pytest.mark.demo
def test_demo_pair_through_serve_matches_plain_generate(demo, demo_store, tmp_path):
    prompt = "Write a Python function that reverses a linked list."
    p = subprocess.run(
        [str(SPECRUN), "generate", "-m", str(demo["target"]), "-t", "2", "-c", "2048", "--draft", "none", "--chat", "-p", prompt, "-n", "64", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    plain = json.loads(p.stdout)
    s = Server(["-m", str(demo["target"]), "-d", str(demo["draft"]), "-t", "2", "-c", "2048", "--quiet"], tmp_path)
    try:
        messages = [{"role": "user", "content": prompt}]
        status, _, r = s.post("/v1/chat/completions", {"messages": messages, "max_tokens": 64, "temperature": 0}, timeout=600)
        assert status == 200, r
        second = messages + [
            {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Now in Rust."},
        ]
        status, _, r2 = s.post("/v1/chat/completions", {"messages": second, "max_tokens": 8}, timeout=600)
        assert status == 200 and r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= r["usage"]["prompt_tokens"]
    finally:
        assert s.stop() == 143
    from specrun.run.config import PairConfig
    from specrun.run.prompt import chat_prompt
    from specrun.run.session import open_pair

    pair = open_pair(demo["target"], None, PairConfig(n_ctx=2048, threads=2))
    try:
        prompt_tokens = chat_prompt(pair, messages)
    finally:
        pair.close()
    assert_same_up_to_near_tie(demo["target"], prompt_tokens, plain, r["choices"][0]["message"]["content"])
