"""Earlier replies drafted from, through `specrun serve` (a real process on 127.0.0.1, tiny
models): the answers stay exact, a tenant (an API key and a `user`) drafts only from its own
replies, and what is kept stays under `--suffix-mb` however many requests come."""

from __future__ import annotations

import pytest
from serve_helpers import Server

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
