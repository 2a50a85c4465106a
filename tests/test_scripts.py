"""The shell scripts in scripts/: shellcheck-clean, --help works, bad arguments fail early.

shellcheck is required: the test fails when it is missing (apt-get install shellcheck, or
brew install shellcheck). Set SPECRUN_NO_SHELLCHECK=1 to skip that one test deliberately.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS_DIR = REPO / "scripts"
SCRIPTS = sorted(SCRIPTS_DIR.glob("*.sh"))


def run_script(name: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "SPECRUN_EXTRAS")}
    return subprocess.run(
        ["bash", str(SCRIPTS_DIR / name), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
    )


def test_scripts_exist() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"install.sh", "fetch-demo-models.sh", "chat.sh", "bench.sh", "serve.sh", "compare-llama-cpp.sh"} <= names


def test_scripts_are_shellcheck_clean() -> None:
    if os.environ.get("SPECRUN_NO_SHELLCHECK") == "1":
        pytest.skip("SPECRUN_NO_SHELLCHECK=1")
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail(
            "shellcheck is not on PATH: install it (apt-get install shellcheck, or brew install "
            "shellcheck), or set SPECRUN_NO_SHELLCHECK=1 to skip this test"
        )
    result = subprocess.run([shellcheck, *map(str, SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "name",
    [
        "install.sh",
        "fetch-demo-models.sh",
        "chat.sh",
        "bench.sh",
        "serve.sh",
        "bench-serve.sh",
        "compare-llama-cpp.sh",
        "worker.sh",
        "ab.sh",
    ],
)
def test_help_prints_usage(name: str, tmp_path: Path) -> None:
    result = run_script(name, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"scripts/{name}" in result.stdout  # the usage lines name the script
    assert list(tmp_path.iterdir()) == []


def test_ab_refuses_a_base_that_is_no_commit_in_one_line(tmp_path: Path) -> None:
    result = run_script("ab.sh", "no-such-ref-anywhere", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "'no-such-ref-anywhere' is not a commit here" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_install_rejects_unknown_backend_without_side_effects(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    result = run_script("install.sh", "--force-backend", "bogus", str(venv), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "bogus" in lines[0] and "cpu" in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["--force-backend"], ["--no-such-flag"], ["--extras", "a b"]])
def test_install_rejects_bad_arguments(args: list[str], tmp_path: Path) -> None:
    result = run_script("install.sh", *args, str(tmp_path / "venv"), cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


# --- scripts/tools/compare_serve.py: the llama-server comparison's commands and arguments ---------


def compare_serve(*args: str) -> subprocess.CompletedProcess[str]:
    import sys

    return subprocess.run(
        [sys.executable, str(SCRIPTS_DIR / "tools" / "compare_serve.py"), *args], capture_output=True, text=True, timeout=60
    )


def test_compare_serve_starts_each_setup_as_documented(tmp_path: Path) -> None:
    result = compare_serve("--bin", str(tmp_path / "bin"), "--target", "T.gguf", "--draft", "D.gguf", "-t", "2", "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.strip().splitlines())
    assert list(lines) == ["draft-simple", "ngram-mod", "plain", "specrun"]
    cmds = {k: v.split() for k, v in lines.items()}
    for name in ("draft-simple", "ngram-mod", "plain"):
        assert cmds[name][0] == str(tmp_path / "bin" / "llama-server") and cmds[name][cmds[name].index("-m") + 1] == "T.gguf"
    assert cmds["draft-simple"][cmds["draft-simple"].index("-md") + 1] == "D.gguf" and "--spec-type draft-simple" in lines["draft-simple"]
    assert "--spec-type ngram-mod" in lines["ngram-mod"] and "-md" not in cmds["ngram-mod"]
    assert "--spec-type" not in cmds["plain"] and "-md" not in cmds["plain"]
    assert cmds["specrun"][1:2] == ["serve"] and cmds["specrun"][cmds["specrun"].index("-d") + 1] == "D.gguf"
    assert "--spec" not in lines["specrun"] and "--draft" not in cmds["specrun"]  # specrun at its defaults
    ports = [c[c.index("--port") + 1] for c in cmds.values()]
    assert len(set(ports)) == 4 and all(c[c.index("--host") + 1] == "127.0.0.1" for c in cmds.values())


@pytest.mark.parametrize(
    "args, words",
    [
        (["--setups", "draft-simple,bogus"], "unknown setup bogus"),
        (["--clients", "0"], "--clients"),
        (["--clients", "one"], "--clients"),
        (["--runs", "0"], "--runs"),
        (["--setups", "plain"], "--bin"),  # llama-server setups need the build
    ],
)
def test_compare_serve_refuses_bad_arguments(args: list[str], words: str) -> None:
    result = compare_serve(*args, "--dry-run")
    assert result.returncode == 2 and words in result.stderr.strip().splitlines()[-1], result.stderr
    assert result.stdout == ""


def test_compare_llama_cpp_documents_serve() -> None:
    result = run_script("compare-llama-cpp.sh", "--help")
    assert result.returncode == 0 and "--serve" in result.stdout and "compare_serve.py" in result.stdout


def test_compare_serve_measures_a_real_server(tiny, tmp_path: Path) -> None:
    """The client side of the comparison, against a real `specrun serve` on tiny models (a
    check of the script, not a benchmark: two short requests, one and two clients)."""
    import sys

    sys.path.insert(0, str(SCRIPTS_DIR / "tools"))
    import compare_serve as cs

    args = cs.parse_args(
        ["--setups", "specrun", "--target", str(tiny["target"]), "--draft", str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024"]
    )
    port = cs.free_port()
    server = cs.Running("specrun", cs.command("specrun", args, port), port, tmp_path / "specrun.log", timeout=120)
    try:
        assert server.model == "target.gguf"
        one = cs.measure(server, "chat", ["Tell me about foxes.", "And dogs?"], 1, run=1, n=8)
        two = cs.measure(server, "chat", ["Tell me about foxes.", "And dogs?"], 2, run=1, n=8)
    finally:
        server.stop()
    for s in (one, two):
        assert s.tokens == 16 and len(s.per_client_tps) == 2 and all(t > 0 for t in s.per_client_tps)
        assert len(s.ttft_ms) == 2 and all(t > 0 for t in s.ttft_ms) and s.total_tps > 0
    text = cs.table([one, two], ["specrun"], ["chat"], [1, 2])
    assert text.splitlines()[1].split()[:3] == ["specrun", "chat", "1"] and len(text.splitlines()) == 3


def test_compare_serve_starts_a_server_per_turn_and_stops_it(tiny, tmp_path: Path, capsys) -> None:
    """The whole loop, on tiny models: each run starts the setup's server for its turn and
    stops it after (only one holds the models at a time), and the table comes out."""
    import sys

    sys.path.insert(0, str(SCRIPTS_DIR / "tools"))
    import compare_serve as cs

    argv = ["--setups", "specrun", "--target", str(tiny["target"]), "--draft", str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024"]
    assert cs.main([*argv, "--runs", "2", "-n", "4", "--limit", "1", "--clients", "1", "--classes", "chat"]) == 0
    out = capsys.readouterr().out
    assert out.count("starting specrun") == 2 and out.count("run 1 specrun") == 1 and out.count("run 2 specrun") == 1
    assert any(line.split()[:3] == ["specrun", "chat", "1"] for line in out.splitlines())


# --- scripts/tools/replay_sessions.py: agent sessions replayed through the openai client ----------


def replay_module():
    import sys

    sys.path.insert(0, str(SCRIPTS_DIR / "tools"))
    import replay_sessions

    return replay_sessions


def test_replay_sessions_starts_each_setup_as_documented(tmp_path: Path) -> None:
    rs = replay_module()
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert rs.main(["--bin", str(tmp_path / "bin"), "--target", "T.gguf", "--draft", "D.gguf", "-t", "2", "--dry-run"]) == 0
    cmds = {k: v.split() for k, v in (line.split(": ", 1) for line in out.getvalue().strip().splitlines())}
    assert list(cmds) == ["specrun", "specrun-none", "plain", "ngram-mod", "draft-simple"]
    assert cmds["specrun"][1:2] == ["serve"] and "--draft" not in cmds["specrun"]  # specrun at its defaults
    none = cmds["specrun-none"]
    assert none[none.index("--draft") + 1] == "none" and none[none.index("-d") + 1] == "D.gguf"
    assert "--spec-type" not in cmds["plain"] and "-md" not in cmds["plain"]
    assert "--spec-type ngram-mod" in " ".join(cmds["ngram-mod"]) and "-md" not in cmds["ngram-mod"]
    ds = cmds["draft-simple"]
    assert ds[ds.index("-md") + 1] == "D.gguf" and ds[ds.index("--spec-type") + 1] == "draft-simple"


@pytest.mark.parametrize(
    "args, words",
    [
        (["--setups", "specrun,bogus"], "unknown setup bogus"),
        (["--sessions", "ask-twice,nope"], "unknown session nope"),
        (["--runs", "0"], "--runs"),
        (["--setups", "specrun,plain"], "--bin"),
    ],
)
def test_replay_sessions_refuses_bad_arguments(args: list[str], words: str) -> None:
    import sys

    result = subprocess.run(
        [sys.executable, str(SCRIPTS_DIR / "tools" / "replay_sessions.py"), *args, "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and words in result.stderr.strip().splitlines()[-1], result.stderr
    assert result.stdout == ""


def test_replay_sessions_are_written_as_the_issue_asks() -> None:
    """Three kinds of session: whole-file edits resending the file, a tool loop, a repeated ask."""
    sessions = replay_module().load_sessions()
    edit = sessions["whole-file"]
    assert len(edit["system"]) > 4000 and len(edit["turns"]) >= 3 and all("{file}" in t for t in edit["turns"])
    tools = sessions["tool-loop"]
    assert {t["function"]["name"] for t in tools["tools"]} == {"read_file", "write_file", "run_tests"}
    assert len(sessions["ask-twice"]["turns"]) >= 2


class ScriptedClient:
    """Stands in for ``openai.OpenAI``: streams the given replies in turn (text, or tool calls
    as (name, arguments) pairs, each cut into two chunks) and keeps the messages it was sent."""

    def __init__(self, replies: list):
        from types import SimpleNamespace

        self.replies = list(replies)
        self.sent: list[list[dict]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, model, messages, max_tokens, stream_options, tools=None, **_):
        import copy

        from openai.types.chat import ChatCompletionChunk

        self.sent.append(copy.deepcopy(messages))
        reply = self.replies.pop(0)
        base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": model}
        chunks = []
        if isinstance(reply, str):
            for piece in (reply[: len(reply) // 2], reply[len(reply) // 2 :]):
                chunks.append({"choices": [{"index": 0, "delta": {"content": piece}}]})
            finish, tokens = "stop", len(reply)
        else:
            for i, (name, arguments) in enumerate(reply):
                first = {"index": i, "id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments[:5]}}
                chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [first]}}]})
                chunks.append(
                    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, "function": {"arguments": arguments[5:]}}]}}]}
                )
            finish, tokens = "tool_calls", 7 * len(reply)
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        chunks.append({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": tokens, "total_tokens": 10 + tokens}})
        return iter(ChatCompletionChunk.model_validate({**base, **c}) for c in chunks)


def test_replay_answers_tool_calls_and_resends_the_edited_file() -> None:
    rs = replay_module()
    sessions = rs.load_sessions()
    loop = sessions["tool-loop"]
    fixed = loop["file"]["text"].replace("sum(price for", "sum(price * qty for")
    client = ScriptedClient([
        [("read_file", json.dumps({"path": "cart.py"}))],
        [("write_file", json.dumps({"path": "cart.py", "content": fixed})), ("run_tests", "{}")],
        [("run_tests", "{}")],
        "Fixed total_price.",
    ])  # fmt: skip
    played = rs.play(client, "m", "tool-loop", loop, 64)
    assert [r.tokens for r in played.requests] == [7, 14, 7, len("Fixed total_price.")] and played.tokens == 46
    last = client.sent[-1]
    tool_messages = [m["content"] for m in last if m["role"] == "tool"]
    assert tool_messages[0] == loop["file"]["text"]  # read_file gave the file
    assert tool_messages[1].startswith("wrote ") and tool_messages[2:] == loop["tool_results"]["run_tests"]  # scripted in turn
    calls = [c for m in last if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["read_file", "write_file", "run_tests", "run_tests"]
    assert json.loads(calls[1]["function"]["arguments"])["content"] == fixed  # the arguments joined from their pieces
    assert all(m["tool_call_id"] == c["id"] for m, c in zip([m for m in last if m["role"] == "tool"], calls))

    edit = sessions["whole-file"]
    new = "x = 1\n"
    client = ScriptedClient([f"Done.\n\ninventory.py\n```python\n{new}```\n", "inventory.py\n```python\ncut off", "No change."])
    rs.play(client, "m", "whole-file", {**edit, "turns": edit["turns"][:3]}, 64)
    users = [m["content"] for m in client.sent[-1] if m["role"] == "user"]
    assert edit["file"]["text"] in users[0] and f"```python\n{new}```" in users[1]  # the reply's file is resent
    assert f"```python\n{new}```" in users[2]  # an unclosed fence leaves the file as it was
    assert [m["role"] for m in client.sent[-1]] == ["system", "user", "assistant", "user", "assistant", "user"]


def test_replay_counts_what_the_server_counted(tiny, tmp_path: Path) -> None:
    """A session against a real `specrun serve` on tiny models: its tokens are the server's
    own count (/metrics), each request carries the replies before it, and a JSON run of the
    script reports the same numbers and equal texts with and without drafting."""
    import contextlib
    import io

    from serve_helpers import Server

    rs = replay_module()
    session = rs.load_sessions()["ask-twice"]
    server = Server(["-m", str(tiny["target"]), "-d", str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024", "--quiet"], tmp_path)
    try:
        before = server.metrics()
        played = rs.play(rs.client_for(server.port), "target.gguf", "ask-twice", session, 6)
        after = server.metrics()
    finally:
        server.stop()
    assert len(played.requests) == len(session["turns"])
    assert played.tokens == after["llamacpp:tokens_predicted_total"] - before.get("llamacpp:tokens_predicted_total", 0) > 0
    done = sum(v for k, v in after.items() if k.startswith("specrun_requests_total"))
    assert done - sum(v for k, v in before.items() if k.startswith("specrun_requests_total")) == len(played.requests)
    for a, b in zip(played.requests, played.requests[1:]):
        assert b.prompt_tokens > a.prompt_tokens + a.tokens  # the reply and the next turn came back
        assert b.cached_tokens >= a.prompt_tokens + a.tokens - 1  # the reply as written: the cache held all but its last token
    assert all(r.tokens == 6 for r in played.requests if r.finish_reason == "length")

    out = io.StringIO()
    argv = ["--setups", "specrun,specrun-none", "--sessions", "ask-twice", "--target", str(tiny["target"]), "--draft",
            str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024", "--runs", "1", "-n", "6", "--json"]  # fmt: skip
    with contextlib.redirect_stdout(out):
        assert rs.main(argv) == 0
    report = json.loads(out.getvalue())
    assert [p["setup"] for p in report["played"]] == ["specrun", "specrun-none"] and report["mismatches"] == []
    for p in report["played"]:
        assert [r["tokens"] for r in p["requests"]] == [r.tokens for r in played.requests]
        assert [r["text"] for r in p["requests"]] == [r.text for r in played.requests]
        assert p["tokens"] == played.tokens and p["throughput"] == pytest.approx(p["tokens"] / p["wall_s"])


def test_batch_divergence_finds_the_first_differing_character() -> None:
    import sys

    sys.path.insert(0, str(SCRIPTS_DIR / "tools"))
    import batch_divergence as bd

    assert bd.first_difference("def f(x):", "def f(x):") is None
    assert bd.first_difference("def f(x):", "def f(y):") == 6
    assert bd.first_difference("def f", "def f(x)") == 5  # one a prefix of the other: where the shorter ends


def test_batch_divergence_runs_its_three_passes_on_a_real_server(tiny, capsys) -> None:
    """On the tiny models (no near-ties to speak of), 4 clients together give the texts one at
    a time gives, prompt by prompt: the passes keep the prompts in their order."""
    import sys

    sys.path.insert(0, str(SCRIPTS_DIR / "tools"))
    import batch_divergence as bd

    argv = ["--target", str(tiny["target"]), "--draft", str(tiny["draft-perturbed"]), "-t", "1", "-c", "1024", "-n", "12"]
    assert bd.main([*argv, "--prompts", "6", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert report["parallel"] == 4 and report["clients"] == 4  # --parallel 0 on tiny models: 4 sequences
    assert [r["class"] for r in rows] == ["chat", "code-gen", "code-edit", "explain", "chat", "code-gen"]
    assert len({r["prompt"] for r in rows}) == 6
    for r in rows:
        assert r["batched_differs_at_token"] is None and r["again_differs_at_token"] is None, r
        assert r["alone"] == r["batched"] == r["again"] and r["tokens"][0] == r["tokens"][1] == r["tokens"][2] <= 12


# --- scripts/tools/aider_session.py: a real Aider session against each server ----------------------


def aider_module():
    import sys

    sys.path.insert(0, str(SCRIPTS_DIR / "tools"))
    import aider_session

    return aider_session


def test_aider_session_reads_aiders_token_line() -> None:
    a = aider_module()
    assert a.tokens_counted("Applied edit to x.py\nTokens: 937 sent, 386 received.\n") == (937, 386)
    assert a.tokens_counted("Tokens: 2.4k sent, 1.1k received. Cost: $0.00\n") == (2400, 1100)
    # a turn whose edit Aider found malformed asks again: both requests count
    assert a.tokens_counted("Tokens: 1.0k sent, 477 received.\n...\nTokens: 1.6k sent, 66 received.") == (2600, 543)
    assert a.tokens_counted("litellm.APIConnectionError: refused") == (0, 0)


def test_aider_session_types_the_replays_turns_without_the_file() -> None:
    """Aider adds the file itself: a turn is the replay's instruction, the inlined file left out."""
    a = aider_module()
    session = replay_module().load_sessions()["whole-file"]
    typed = a.instructions(session, None)
    assert len(typed) == len(session["turns"]) and a.instructions(session, 2) == typed[:2]
    for turn, message in zip(session["turns"], typed):
        assert "{file}" not in message and "{path}" not in message and "```" not in message
        assert message and turn.rstrip().endswith(message)


def test_aider_session_plays_each_turn_in_a_fresh_repository(tmp_path: Path) -> None:
    """``play`` runs one Aider process a turn in a git repository holding the session's file, and
    counts what each turn's "Tokens:" line says. (Aider itself is not installed here: a stand-in
    that edits the file as Aider would and prints Aider's line.)"""
    import stat
    import sys

    a = aider_module()
    stand_in = tmp_path / "aider"
    stand_in.write_text(
        f"#!{sys.executable}\n"
        "import pathlib, subprocess, sys\n"
        "args = sys.argv[1:]\n"
        "message, path = args[args.index('--message') + 1], args[-1]\n"
        "assert subprocess.run(['git', 'log', '--oneline'], capture_output=True).returncode == 0\n"
        "f = pathlib.Path(path)\n"
        "f.write_text(f.read_text() + '# ' + message[:20] + '\\n')\n"
        "print(f'Tokens: {len(f.read_text())} sent, {len(message)} received.')\n"
    )
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    session = {"file": {"path": "m.py", "text": "x = 1\n"}, "turns": ["{path}\n```python\n{file}```\n\nRename x to y.", "Add z."]}
    log = tmp_path / "aider.log"
    played = a.play(str(stand_in), "M", 9, session, a.instructions(session, None), "plain", 1, log)
    assert [t.exit_code for t in played.turns] == [0, 0]
    assert [t.received for t in played.turns] == [len("Rename x to y."), len("Add z.")]
    assert played.turns[1].sent > played.turns[0].sent  # the file as the first turn left it
    assert played.received == sum(t.received for t in played.turns) and played.wall_s > 0
    assert played.file_sha and played.file_sha != a.play(str(stand_in), "M", 9, session, ["Other."], "plain", 1, log).file_sha
    assert log.read_text().count("===== plain run 1 turn") == 3


@pytest.mark.parametrize(
    "args, words",
    [
        (["--setups", "specrun,bogus"], "unknown setup bogus"),
        (["--session", "ask-twice"], "no session 'ask-twice' with a file"),
        (["--turns", "0"], "--turns"),
        (["--setups", "specrun,plain"], "--bin"),
    ],
)
def test_aider_session_refuses_bad_arguments(args: list[str], words: str) -> None:
    import sys

    result = subprocess.run(
        [sys.executable, str(SCRIPTS_DIR / "tools" / "aider_session.py"), *args, "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and words in result.stderr.strip().splitlines()[-1], result.stderr
    assert result.stdout == ""


def test_aider_session_without_aider_says_where_to_get_it(tmp_path: Path) -> None:
    import sys

    result = subprocess.run(
        [sys.executable, str(SCRIPTS_DIR / "tools" / "aider_session.py"), "--setups", "specrun", "--aider", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "pip install aider-chat" in result.stderr.strip().splitlines()[-1], result.stderr


def test_aider_session_dry_run_shows_a_server_per_setup_and_an_aider_per_turn(tmp_path: Path) -> None:
    import sys

    result = subprocess.run(
        [sys.executable, str(SCRIPTS_DIR / "tools" / "aider_session.py"), "--bin", str(tmp_path), "--setups", "specrun,ngram-mod",
         "--turns", "2", "--dry-run"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = result.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["specrun", "ngram-mod", "aider", "aider"]
    for line in lines[2:]:
        assert "--edit-format whole" in line and "--map-tokens 0" in line and "--no-auto-commits" in line and "127.0.0.1" in line
