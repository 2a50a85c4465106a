"""`specrun serve --parallel N`: several requests decode together in one context (a sequence
each, one batch per step). Real processes on 127.0.0.1, the `openai` package, tiny generated
models. Every wait is a bounded poll."""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_helpers import SPECRUN, Server

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "def add(a, b):\n    return",
    "One, two, three, four,",
]


def tiny_args(tiny, *extra: str) -> list[str]:
    return ["-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "-t", "1", "-c", "512", *extra]


def stream_text(port: int, prompt: str, max_tokens: int, model: str = "target.gguf") -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
    out = []
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True):
        out.append(chunk.choices[0].text if chunk.choices else "")
    return "".join(out)


def plain_generate(model_path, prompt: str, n: int, threads: int = 1) -> dict:
    p = subprocess.run(
        [str(SPECRUN), "generate", "-m", str(model_path), "-t", str(threads), "-c", "512", "--draft", "none", "-p", prompt, "-n", str(n), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def assert_each_as_alone(model_path, prompts: list[str], texts: list[str], n: int, threads: int = 1) -> None:
    """Each text is what plain decoding gives its prompt alone, by tests/test_serve.py's rule:
    the same text, or a first difference where plain decoding's own top two are within
    llama.cpp's batch noise (a row's logits move slightly with the batch it rides in, and which
    other rows share its batch depends on timing)."""
    from test_serve import assert_same_up_to_near_tie

    from specrun.llama import LoadOptions, Model

    with Model(model_path, LoadOptions(n_ctx=256, n_threads=1)) as m:
        prompt_tokens = [m.tokenize(p) for p in prompts]
    for prompt, toks, text in zip(prompts, prompt_tokens, texts):
        assert_same_up_to_near_tie(model_path, toks, plain_generate(model_path, prompt, n, threads), text)


def concurrent_equals_alone(s: Server, model_path, prompts: list[str], max_tokens: int, threads: int = 1) -> None:
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: stream_text(s.port, p, max_tokens, model_path.name), prompts, timeout=600))
    assert len(set(together)) == len(together) and all(together)  # different prompts, different (non-empty) answers
    assert_each_as_alone(model_path, prompts, together, max_tokens, threads)


@pytest.fixture(scope="module")
def par(tiny, tmp_path_factory):
    s = Server(tiny_args(tiny, "--parallel", "4"), tmp_path_factory.mktemp("par"))
    yield s
    assert s.stop() == 143, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


def test_four_streaming_clients_at_once_each_get_what_they_would_alone(par, tiny):
    assert "4 in parallel" in par.stderr
    assert par.get("/health")[2]["parallel"] == 4
    concurrent_equals_alone(par, tiny["target"], PROMPTS, 24)


@pytest.mark.parametrize("draft", ["model", "ngram", "none"])
def test_each_draft_source_stays_exact_in_a_shared_batch(par, tiny, draft):
    def ask(p: str) -> str:
        status, _, r = par.post("/v1/completions", {"prompt": p, "max_tokens": 16, "temperature": 0, "draft": draft})
        assert status == 200, r
        return r["choices"][0]["text"]

    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, PROMPTS, timeout=300))
    assert_each_as_alone(tiny["target"], PROMPTS, together, 16)


def test_requests_run_together_not_in_turn(par):
    """While one long stream runs, a short request finishes: it did not wait in a queue."""
    c = par.conn()
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "stream": True}),
              headers={"Content-Type": "application/json"})  # fmt: skip
    r = c.getresponse()
    seen = 0
    for line in iter(r.readline, b""):
        seen += line.startswith(b"data: ")
        if seen >= 2:
            break
    assert par.get("/health")[2]["running"] == 1 and par.metrics()["llamacpp:requests_processing"] == 1
    status, _, short = par.post("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0})
    assert status == 200 and short["choices"][0]["finish_reason"] == "length"
    # the long one was still going when the short one finished
    line = r.readline()
    assert line and b"[DONE]" not in line
    c.close()


def test_a_conversation_keeps_its_sequence_while_others_come_and_go(par):
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to five."}]
    status, _, r1 = par.post("/v1/chat/completions", {"messages": chat, "max_tokens": 8, "temperature": 0})
    assert status == 200, r1
    for i in range(3):  # unrelated chats in between (they share only the template's opening)
        other = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Name color {i}."}]
        assert par.post("/v1/chat/completions", {"messages": other, "max_tokens": 4, "temperature": 0})[0] == 200
    turn2 = chat + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]}, {"role": "user", "content": "Again."}]
    status, _, r2 = par.post("/v1/chat/completions", {"messages": turn2, "max_tokens": 4, "temperature": 0})
    assert status == 200, r2
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"]


def test_a_regenerate_finds_its_prompt_cached_and_gets_the_same_text(par):
    """The same request again (a chat front end's "regenerate") holds the slot's last request
    whole: it goes to that slot, though it throws its reply away, and not to an empty one where
    its whole prompt would be computed again, in other batches (which can tip a near-tie)."""
    body = {"prompt": "Rivers", "max_tokens": 64, "temperature": 0}  # a reply far longer than its prompt
    status, _, first = par.post("/v1/completions", body)
    assert status == 200, first
    assert len(first["choices"][0]["text"]) > 2 * len(body["prompt"])
    status, _, again = par.post("/v1/completions", body)
    assert status == 200, again
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] - 1  # all but the pending token
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_an_agents_next_request_takes_the_shared_opening_from_the_slot_that_holds_it(par, tiny):
    """An agent resends its long instructions with a new question: the opening is taken from the
    idle slot that holds it (cells shared, not computed again), though that slot's conversation,
    a long reply after it, is kept for a request that goes on with it. The reply is what plain
    decoding gives the prompt alone."""
    opening = "You edit files. Answer with the whole file and nothing else. " * 3
    first = {"prompt": opening + "File: a.py. Add a docstring.", "max_tokens": 160, "temperature": 0, "draft": "none"}
    status, _, r1 = par.post("/v1/completions", first)
    assert status == 200, r1
    assert r1["usage"]["completion_tokens"] > r1["usage"]["prompt_tokens"] // 2  # the slot holds far more than the opening
    prompt = opening + "File: b.py. Rename x."
    status, _, r2 = par.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, "draft": "none"})
    assert status == 200, r2
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] > r2["usage"]["prompt_tokens"] // 2  # the opening, not computed again
    assert_each_as_alone(tiny["target"], [prompt], [r2["choices"][0]["text"]], 12)
    go_on = {**first, "prompt": first["prompt"] + r1["choices"][0]["text"] + " Now b.py.", "max_tokens": 4}
    status, _, r3 = par.post("/v1/completions", go_on)
    assert status == 200, r3
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"] - 1


def test_a_client_that_leaves_frees_its_slot(tiny, tmp_path):
    s = Server(tiny_args(tiny, "--parallel", "2", "--max-queue", "4"), tmp_path)
    try:
        conns = []
        for p in PROMPTS[:2]:  # both slots taken by long streams
            c = s.conn()
            c.request("POST", "/v1/completions", body=json.dumps({"prompt": p, "max_tokens": 450, "stream": True}),
                      headers={"Content-Type": "application/json"})  # fmt: skip
            r = c.getresponse()
            assert r.readline().startswith(b"data: ")
            conns.append((c, r))
        c, _ = conns[0]
        c.sock.shutdown(2)  # one client goes away mid-stream
        c.close()
        status, _, r2 = s.post("/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 4, "temperature": 0})
        assert status == 200 and r2["choices"][0]["finish_reason"] == "length"
        _, r_other = conns[1]
        line = r_other.readline()
        assert line and b"[DONE]" not in line  # served while the other long stream still runs
        conns[1][0].close()
        deadline = time.monotonic() + 60
        while s.get("/health")[2]["busy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not s.get("/health")[2]["busy"]
    finally:
        assert s.stop() == 143
    assert "Traceback" not in s.stderr


def test_parallel_one_serves_in_turn(tiny, tmp_path):
    s = Server(tiny_args(tiny, "--parallel", "1", "--max-queue", "4"), tmp_path)
    try:
        assert "in parallel" not in s.stderr
        first = s.stream("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 300})
        next(first)
        results: list = []
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(lambda: results.append(s.post("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 4})))
            deadline = time.monotonic() + 30
            while s.get("/health")[2]["queued"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert s.get("/health")[2]["queued"] == 1  # it waits for the first: one at a time
            rest = list(first)
            assert rest[-1] == "[DONE]"
            fut.result(60)
        assert results[0][0] == 200
    finally:
        assert s.stop() == 143


def test_parallel_is_refused_for_a_recurrent_model_in_one_line(tmp_path):
    from tiny_hybrid import build_hybrid

    path = build_hybrid(tmp_path / "hybrid")["qwen35"]
    p = subprocess.run(
        [str(SPECRUN), "serve", "--port", "0", "-m", str(path), "--draft", "ngram", "-t", "1", "-c", "256", "--parallel", "2"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "SPECRUN_CACHE_DIR": str(tmp_path / "cache"), "NO_COLOR": "1"},
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in p.stderr and "--parallel 2" in p.stderr and "recurrent" in p.stderr, p.stderr
    assert len([ln for ln in lines if "--parallel" in ln]) == 1, p.stderr


def test_without_parallel_a_recurrent_model_serves_one_at_a_time_and_says_so(tmp_path):
    from tiny_hybrid import build_hybrid

    path = build_hybrid(tmp_path / "hybrid")["qwen35"]
    s = Server(["-m", str(path), "--draft", "ngram", "-t", "1", "-c", "256", "--parallel", "0"], tmp_path)
    try:
        assert "parallel 1:" in s.stderr and "in parallel" not in s.stderr
        status, _, r = s.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
        assert status == 200, r
    finally:
        assert s.stop() == 143
    assert "Traceback" not in s.stderr
