"""The chat page at `GET /`, in a real headless Chromium (Debian's `chromium`, driven by
Playwright) against a real `specrun serve` on 127.0.0.1 with an API key: the key typed into
the page, a message sent, the reply streamed, drafted text tinted by source, live stats, a
screenshot. And the stream extension the page reads (``stream_options.include_drafts``).

Chromium is never downloaded here (no `playwright install`): scripts/test.sh installs
Debian's package when it is missing, and without it this test fails, it does not skip."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
from serve_helpers import Server

CHROMIUM = Path(os.environ.get("SPECRUN_CHROMIUM", "/usr/bin/chromium"))
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]  # fmt: skip
KEY = "page-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = "Tell me about foxes and dogs."


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    # greedy, drafting every round with a draft that agrees often: tinted spans are certain
    args = ["-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024", "--temp", "0",
            "--draft", "model", "--fixed", "--draft-max", "4", "--quiet"]  # fmt: skip
    s = Server(args, tmp_path_factory.mktemp("page"), env={"SPECRUN_API_KEY": KEY})
    yield s
    assert s.stop() == 143
    assert "Traceback" not in s.stderr, s.stderr


def test_the_page_and_its_files_are_served_with_a_same_origin_policy(server):
    status, headers, html = server.get("/")  # open without the key: it is static, its API calls need it
    assert status == 200 and headers["content-type"].startswith("text/html") and '<script src="/page/page.js">' in html
    policy = headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'self'" in policy
    for name, kind in (("page.js", "text/javascript"), ("page.css", "text/css")):
        status, headers, _ = server.get(f"/page/{name}")
        assert status == 200 and headers["content-type"].startswith(kind)
    for bad in ("/page/nothing.js", "/page/..%2f..%2fpyproject.toml", "/page/index.html"):
        code, _, r = server.get(bad)
        assert code == 404 and set(r["error"]) == {"message", "type", "param", "code"}, (bad, r)
    js = server.get("/page/page.js")[2]
    assert re.findall(r"fetch\(\"([^\"]+)\"", js) == ["/v1/models", "/v1/chat/completions"]  # relative: this origin only


def test_the_stream_says_which_text_came_from_which_drafts(server):
    body = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 40, "stream_options": {"include_drafts": True}}
    chunks = [c for c in server.stream("/v1/chat/completions", body, headers=AUTH) if isinstance(c, dict)]
    sources = set()
    for c in chunks:
        content = c["choices"][0]["delta"].get("content") if c["choices"] else None
        if c["choices"] and c["choices"][0]["delta"].get("role"):
            continue  # the opening chunk: nothing generated yet
        ext = c["specrun"]
        assert set(ext["stats"]) == {"generated", "tok_s", "drafted", "accepted", "by_source", "tree_rounds", "tree_nodes", "branch_wins"}
        assert ext["stats"]["tree_rounds"] == ext["stats"]["branch_wins"] == 0  # no --tree
        if content:
            assert "".join(t for t, _ in ext["spans"]) == content  # the spans are the content, cut by source
            sources |= {src for _, src in ext["spans"]}
            assert all(len(span) == 2 for span in ext["spans"])  # no branch without --tree
    assert sources <= {"model", "ngram", None} and "model" in sources
    last = chunks[-1]["specrun"]["stats"]
    assert last["generated"] == chunks[-1]["timings"]["predicted_n"] and last["accepted"] == chunks[-1]["timings"]["draft_n_accepted"]
    plain = [c for c in server.stream("/v1/chat/completions", {**body, "stream_options": None}, headers=AUTH) if isinstance(c, dict)]
    assert not any("specrun" in c for c in plain)  # only when asked for


def poll(condition, what: str, timeout: float = 120.0):
    """Poll ``condition`` until it returns something truthy (bounded in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def test_the_page_streams_a_reply_with_tinted_drafts_in_chromium(server, tmp_path):
    from playwright.sync_api import sync_playwright

    assert CHROMIUM.is_file(), f"{CHROMIUM} is missing: apt-get install chromium (scripts/test.sh does it)"
    origin = f"http://127.0.0.1:{server.port}"
    requests: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True,
                                                       args=ARGS, viewport={"width": 1000, "height": 700})  # fmt: skip
        try:
            page = browser.new_page()
            page.on("request", lambda r: requests.append(r.url))
            page.goto(origin + "/")
            model = page.locator("#model")
            poll(lambda: "error" in (model.get_attribute("class") or ""), "the page to see that a key is needed")
            assert "API key" in model.inner_text()

            page.fill("#key", KEY)
            page.dispatch_event("#key", "change")
            poll(lambda: "target.gguf" in model.inner_text(), "the model's name once the key is set")
            page.fill("#max-tokens", "48")
            page.fill("#prompt", ASK)
            page.click("#send")
            reply = page.locator(".msg.assistant").last
            poll(lambda: reply.get_attribute("data-done"), "the streamed reply to end")

            text = reply.inner_text()
            assert page.locator("#branch").is_hidden() and not page.locator(".msg span.d-branch").count()  # no --tree
            spans = page.locator(".msg.assistant span.d-model")
            tinted = [spans.nth(i).inner_text() for i in range(spans.count())]
            stats = {k: page.inner_text(f"#{k}") for k in ("tps", "accept", "mix")}
            page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        finally:
            browser.close()

    # what the page shows is what the API answers for the same conversation (greedy)
    status, _, r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": ASK}], "max_tokens": 48}, headers=AUTH)
    assert status == 200 and text == r["choices"][0]["message"]["content"], (text, r)
    assert tinted and all(t and t in text for t in tinted)  # accepted model drafts, tinted
    assert len("".join(tinted)) < len(text)  # and the target's own tokens, not
    assert float(stats["tps"].split()[0]) > 0 and re.fullmatch(r"accept \d+%", stats["accept"])
    assert int(stats["accept"].split()[1].rstrip("%")) > 0 and "model" in stats["mix"]
    assert requests and all(u.startswith(origin + "/") for u in requests), requests  # nothing to another origin
    assert (tmp_path / "page.png").stat().st_size > 10_000
    if os.environ.get("SPECRUN_SCREENSHOT"):  # a copy for a report
        shutil.copy(tmp_path / "page.png", os.environ["SPECRUN_SCREENSHOT"])


TREE_ASK = "The quick brown fox"


@pytest.fixture(scope="module")
def tree_server(tiny, tmp_path_factory):
    # token trees (--tree, on one slot: a target holding several sequences keeps chains) from a
    # draft whose runner-up is now and then the target's token: a branch other than the first wins
    args = ["-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024", "--temp", "0",
            "--draft", "model", "--fixed", "--draft-max", "4", "--draft-p-min", "0", "--tree", "--parallel", "1", "--quiet"]  # fmt: skip
    s = Server(args, tmp_path_factory.mktemp("page-tree"))
    yield s
    assert s.stop() == 143
    assert "Traceback" not in s.stderr, s.stderr


def test_the_stream_marks_text_from_a_trees_other_branch_and_counts_as_metrics_do(tree_server):
    before = tree_server.metrics()
    body = {"messages": [{"role": "user", "content": TREE_ASK}], "max_tokens": 48, "stream_options": {"include_drafts": True}}
    chunks = [c for c in tree_server.stream("/v1/chat/completions", body) if isinstance(c, dict) and "specrun" in c]
    after = tree_server.metrics()
    spans = [span for c in chunks for span in c["specrun"].get("spans", [])]
    assert all(len(span) == 2 or (len(span) == 3 and span[1] == "model" and span[2] == "branch") for span in spans)
    last = chunks[-1]["specrun"]["stats"]
    for key, metric in (("branch_wins", "specrun_branch_wins_total"), ("tree_rounds", "specrun_tree_rounds_total"),
                        ("tree_nodes", "specrun_tree_nodes_total")):  # fmt: skip
        assert last[key] == after[metric] - before.get(metric, 0.0), key
    assert last["branch_wins"] > 0 and any(len(span) == 3 for span in spans)


def test_the_page_tints_text_from_a_trees_other_branch_apart_and_counts_the_wins(tree_server, tmp_path):
    """The page's count of branch wins against /metrics' (counted when the request ends, apart
    from the stream the page reads); the tint: a colour of its own on text that is also the
    model's draft."""
    from playwright.sync_api import sync_playwright

    before = tree_server.metrics()
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True,
                                                       args=ARGS, viewport={"width": 1000, "height": 700})  # fmt: skip
        try:
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{tree_server.port}/")
            page.fill("#max-tokens", "48")
            page.fill("#prompt", TREE_ASK)
            page.click("#send")
            page.wait_for_selector(".msg.assistant[data-done]", state="attached", timeout=0)  # no clock: the reply's end
            text = page.locator(".msg.assistant").last.inner_text()
            branch = page.locator(".msg.assistant span.d-branch")
            tinted = [branch.nth(i).inner_text() for i in range(branch.count())]
            classes = {branch.nth(i).get_attribute("class") for i in range(branch.count())}
            background = "(e) => getComputedStyle(e).backgroundColor"
            colours = {
                "branch": {branch.nth(i).evaluate(background) for i in range(branch.count())},
                "model": page.eval_on_selector(".msg.assistant span.d-model:not(.d-branch)", background),
                "target": page.eval_on_selector(".msg.assistant", background),
            }
            shown = page.inner_text("#branch") if page.locator("#branch").is_visible() else None
            legend = page.locator(".legend .d-branch").is_visible()
            page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        finally:
            browser.close()
    after = tree_server.metrics()
    wins, trees = (after[k] - before.get(k, 0.0) for k in ("specrun_branch_wins_total", "specrun_tree_rounds_total"))
    assert wins > 0 and shown == f"branch won {wins:.0f}/{trees:.0f} trees" and legend
    assert tinted and all(t and t in text for t in tinted) and classes == {"d-model d-branch"}
    assert len(colours["branch"]) == 1 and colours["branch"].isdisjoint({colours["model"], colours["target"]})
    if os.environ.get("SPECRUN_SCREENSHOT_TREE"):  # a copy for a report
        shutil.copy(tmp_path / "page.png", os.environ["SPECRUN_SCREENSHOT_TREE"])
