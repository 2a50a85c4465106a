"""Earlier replies drafted from, through `specrun serve` (a real process on 127.0.0.1, tiny
models): the answers stay exact, a tenant (an API key and a `user`) drafts only from its own
replies, and what is kept stays under `--suffix-mb` however many requests come; every tenant
drafts from a shared corpus (`--suffix-corpus`); the replies kept survive a restart on the same
`--suffix-cache`, and a cache that cannot be used, or a bad folder, is one line."""

from __future__ import annotations

import os
import subprocess

import pytest
from serve_helpers import SPECRUN, Server

PROMPT = "The quick brown fox"
N = 40


def args(tiny, *extra: str) -> list[str]:
    return ["-m", str(tiny["target"]), "-t", "1", "-c", "1024", "--quiet", *extra]


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = Server(args(tiny), tmp_path_factory.mktemp("suffix"))  # no API key: a client's bearer token only says who it is
    yield s
    assert s.stop() == 143, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


def ask(server, body: dict, key: str | None = None) -> tuple[str, dict]:
    """The streamed text and the request's drafts by source (the last chunk's stats)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    chunks = [c for c in server.stream("/v1/completions", {"max_tokens": N, "temperature": 0, **body,
                                                          "stream_options": {"include_drafts": True}}, headers=headers)
              if isinstance(c, dict)]  # fmt: skip
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    return text, chunks[-1]["specrun"]["stats"]["by_source"]


def test_a_reply_seen_before_is_drafted_from_and_stays_exact(server):
    """The same prompt three times, the first without drafting: the second learns, from every
    round's offer, that the first reply's continuations go on (a continuation seen once is a
    coin flip to a source with no record), the third drafts from them; all three are the same."""
    plain, _ = ask(server, {"prompt": PROMPT, "draft": "none", "user": "exact"})
    answers = [ask(server, {"prompt": PROMPT, "user": "exact"}) for _ in range(2)]
    assert [text for text, _ in answers] == [plain, plain]
    assert answers[1][1]["suffix"]["accepted"] > N / 2


def test_one_tenants_replies_never_draft_anothers(server):
    """Alice (her key, no user) asks three times, her third drafting from her first two; Bob,
    with another key, and Alice's key with a user of its own, then ask the same: neither drafts
    from what Alice was told."""
    alice, _ = ask(server, {"prompt": PROMPT}, key="alice-key")
    ask(server, {"prompt": PROMPT}, key="alice-key")
    again, by_source = ask(server, {"prompt": PROMPT}, key="alice-key")
    assert again == alice and by_source["suffix"]["accepted"] > N / 2  # her own replies draft hers
    for key, user in (("bob-key", None), ("alice-key", "carol")):
        text, by_source = ask(server, {"prompt": PROMPT, **({"user": user} if user else {})}, key=key)
        assert text == alice and "suffix" not in by_source, (key, user, by_source)


def test_what_is_kept_stays_under_the_cap(tiny, tmp_path):
    cap = int(0.05 * 2**20)  # --suffix-mb 0.05: about 200 tokens, five replies
    s = Server(args(tiny, "--suffix-mb", "0.05"), tmp_path)
    try:
        for i in range(24):
            status, _, r = s.post(
                "/v1/completions", {"prompt": f"{PROMPT} number {i}", "max_tokens": N, "temperature": 0, "user": f"u{i % 4}"}
            )
            assert status == 200, r
            m = s.metrics()
            assert 0 < m["specrun_suffix_bytes"] <= cap, m["specrun_suffix_bytes"]
        assert m["specrun_suffix_evicted_total"] >= 24 - cap // (N * 256) - 1 and 1 <= m["specrun_suffix_replies"] <= cap // (N * 256)
    finally:
        assert s.stop() == 143
    assert "Traceback" not in s.stderr


def test_suffix_mb_0_keeps_nothing(tiny, tmp_path):
    s = Server(args(tiny, "--suffix-mb", "0"), tmp_path)
    try:
        first, _ = ask(s, {"prompt": PROMPT})
        again, by_source = ask(s, {"prompt": PROMPT})
        assert again == first and "suffix" not in by_source
        assert "specrun_suffix_bytes" not in s.metrics()
    finally:
        assert s.stop() == 143


# --- a shared corpus, and the replies kept across a restart (the real `openai` client) -----------


def openai_ask(server, prompt: str, key: str, max_tokens: int = N) -> tuple[str, dict]:
    """The streamed text and the request's drafts by source, as a client of another tenant (``key``) sees them."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0, timeout=120)
    extra = {"stream_options": {"include_drafts": True}}
    chunks = list(
        client.completions.create(model="target.gguf", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, extra_body=extra)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-1].model_extra["specrun"]["stats"]["by_source"]


# The tiny target writes arbitrary tokens, most of which no text tokenizes back to (bytes of a
# character cut in two, words split where the tokenizer would not split them), so a file cannot
# hold most replies as the model wrote them. After this prompt, its first 18 tokens are text
# that tokenizes back to the same tokens, so a file can hold them.
CORPUS_PROMPT, CORPUS_N = "score wins when we decode greedily,", 18


def test_every_tenant_drafts_from_the_corpus_and_none_from_anothers_replies(server, tiny, tmp_path):
    """The corpus holds the prompt and what the model says after it (among files that are
    skipped: hidden, binary). A first tenant asks; then Alice and Bob, each asking for the first
    time, draft most of their answer from the corpus and nothing from earlier replies (the first
    tenant's are there, but not theirs)."""
    plain, _ = ask(server, {"prompt": CORPUS_PROMPT, "max_tokens": CORPUS_N, "draft": "none", "user": "corpus-plain"})
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "story.txt").write_text(CORPUS_PROMPT + plain)
    (repo / "README.md").write_text("A repository with one story in it.\n")
    (repo / ".git").mkdir()
    (repo / ".git" / "objects").write_text("never read " * 50)
    (repo / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0" * 20)
    s = Server(args(tiny, "--suffix-corpus", str(repo)), tmp_path)
    try:
        assert "suffix corpus: 2 files" in s.stderr, s.stderr
        assert openai_ask(s, CORPUS_PROMPT, "first-key", CORPUS_N)[0] == plain
        for key in ("alice-key", "bob-key"):
            text, by_source = openai_ask(s, CORPUS_PROMPT, key, CORPUS_N)
            assert text == plain and "suffix" not in by_source, (key, by_source)  # no reply of theirs yet, and none of another's
            assert by_source["corpus"]["accepted"] >= CORPUS_N / 2, (key, by_source)
        m = s.metrics()
        assert m['specrun_accepted_tokens_total{source="corpus"}'] >= CORPUS_N and m["specrun_suffix_corpus_files"] == 2
        assert 0 < m["specrun_suffix_corpus_bytes"] < m["specrun_suffix_bytes"] <= 64 * 2**20
    finally:
        assert s.stop() == 143
    assert "Traceback" not in s.stderr, s.stderr


def test_the_replies_kept_survive_a_restart_on_the_same_cache(tiny, tmp_path):
    """A tenant asks twice (the second teaches the source that the first's continuations go on);
    the server stops and starts again on the same --suffix-cache: the tenant's first request
    after the restart drafts most of its answer from the replies made before it; another
    tenant's drafts from none of them."""
    cache = tmp_path / "suffix-cache"
    s = Server(args(tiny, "--suffix-cache", str(cache)), tmp_path)
    try:
        assert "suffix cache: none yet" in s.stderr
        plain = [openai_ask(s, PROMPT, "alice-key")[0] for _ in range(2)]
    finally:
        assert s.stop() == 143
    assert "suffix cache: 2 replies saved to" in s.stderr and "Traceback" not in s.stderr, s.stderr
    assert "alice-key" not in (cache / "suffixes.json").read_text()
    s = Server(args(tiny, "--suffix-cache", str(cache)), tmp_path)  # the same home: the same learned rates
    try:
        assert "suffix cache: 2 earlier replies from" in s.stderr, s.stderr
        text, by_source = openai_ask(s, PROMPT, "alice-key")
        assert text == plain[0] == plain[1] and by_source["suffix"]["accepted"] > N / 2, by_source
        text, by_source = openai_ask(s, PROMPT, "bob-key")
        assert text == plain[0] and "suffix" not in by_source, by_source
        assert s.metrics()["specrun_suffix_replies"] == 4
    finally:
        assert s.stop() == 143
    assert "suffix cache: 4 replies saved to" in s.stderr and "Traceback" not in s.stderr, s.stderr


def test_a_cache_for_another_vocabulary_or_corrupt_is_one_warning_line(tiny, tmp_path):
    cache = tmp_path / "suffix-cache"
    s = Server(args(tiny, "--suffix-cache", str(cache)), tmp_path)
    try:
        ask(s, {"prompt": PROMPT})
    finally:
        assert s.stop() == 143
    saved = (cache / "suffixes.json").read_bytes()
    for model, content, why in ((tiny["vocab-changed"], saved, "another vocabulary"), (tiny["target"], saved[:-9], "is not JSON")):
        (cache / "suffixes.json").write_bytes(content)
        s = Server(["-m", str(model), *args(tiny)[2:], "--suffix-cache", str(cache)], tmp_path)
        try:
            warned = [ln for ln in s.lines if "suffix cache" in ln and "warning" in ln]
            assert len(warned) == 1 and why in warned[0] and "starting without it" in warned[0], s.stderr
            assert ask(s, {"prompt": PROMPT})[0] and s.metrics()["specrun_suffix_replies"] == 1  # serves, from nothing kept
        finally:
            assert s.stop() == 143
        assert "Traceback" not in s.stderr, s.stderr


@pytest.mark.parametrize(
    "extra, rc, says",
    [
        (["--suffix-corpus", "{tmp}/missing"], 3, "--suffix-corpus {tmp}/missing: no such folder; give the folder"),
        (["--suffix-corpus", "{tmp}/hidden-only"], 3, "no text file in it"),
        (["--suffix-cache", "{tmp}/a-file"], 2, "--suffix-cache {tmp}/a-file: cannot make this folder"),
        (["--suffix-mb", "0", "--suffix-corpus", "{tmp}"], 2, "--suffix-corpus needs --suffix-mb above 0"),
    ],
)
def test_a_bad_suffix_folder_is_refused_in_one_line_before_loading(tiny, tmp_path, extra, rc, says):
    (tmp_path / "hidden-only" / ".git").mkdir(parents=True)
    (tmp_path / "hidden-only" / ".git" / "HEAD").write_text("ref: main\n")
    (tmp_path / "a-file").write_text("not a folder")
    p = subprocess.run(
        [str(SPECRUN), "serve", "--port", "0", *args(tiny), *(e.format(tmp=tmp_path) for e in extra)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"},
    )  # fmt: skip
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == rc and len(lines) == 1 and says.format(tmp=tmp_path) in lines[0], p.stderr
    assert lines[0].startswith("specrun: error: ")
