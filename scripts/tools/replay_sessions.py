"""Coding-agent sessions replayed through the `openai` client: `specrun serve` against `llama-server`.

    python scripts/tools/replay_sessions.py --bin ~/.cache/specrun/llama.cpp-0.3.36/build/bin -t 2 [--runs 3]
    python scripts/tools/replay_sessions.py --setups specrun,specrun-none --sessions ask-twice -n 16 --json
    python scripts/tools/replay_sessions.py --bin DIR --dry-run      # the server commands only

A session (``scripts/tools/replay_sessions.json``, ``--sessions`` picks some) is a list of user
turns under one system prompt, sent one request after another as an agent does: every request
carries the conversation so far, each reply as the server wrote it. Where a session has a
``file``, ``{path}`` and ``{file}`` in a turn stand for the file as the last reply left it: a
reply's first closed fenced block replaces it (whole-file edits, as Aider's "whole" format),
and so does a ``write_file`` tool call. Where it has ``tools``, a reply's tool calls are
answered with tool messages (``read_file`` gives the file, ``write_file`` replaces it,
``run_tests`` gives the session's scripted outputs in turn) and the loop goes on until a reply
calls no tool or the session has sent ``max_requests``. Since each server's own replies are fed
back, two servers whose greedy texts differ replay different conversations from there on.

Sessions as written: ``whole-file`` (four whole-file edits of one file under a ~1,100-token
Aider-like system prompt), ``tool-loop`` (read, fix, run the tests through tools), ``ask-twice``
(the same function asked for twice in other words).

Setups (``--setups``, any of them): ``specrun`` (``specrun serve -m T -d D`` at its defaults),
``specrun-none`` (the same with ``--draft none``), and llama-server's ``plain``, ``ngram-mod``
(``--spec-type ngram-mod``) and ``draft-simple`` (``-md D --spec-type draft-simple``): the
commands of compare_serve.py, whose server helpers this script uses. One server holds the
models at a time: each is started for its turn on a free 127.0.0.1 port and stopped after it,
and the order turns round run by run (A B C, B C A, ...). Every request streams, greedy
(temperature 0), ``-n`` tokens at most.

Per session and setup, medians over the runs: wall time (first request sent to last chunk of
the last reply), completion tokens (the server's ``usage``), session throughput (tokens / wall)
and, per request, the time to its first token and its tokens a second after that (its decoding
alone); then specrun's throughput over the best llama-server setup's. Where ``specrun`` and
``specrun-none`` both ran, their texts are compared request by request (greedy: they should be
equal); a difference is reported, not fatal. ``--json`` prints every record and the comparison
as one JSON document on stdout (progress goes to stderr).
Only 127.0.0.1 is ever contacted.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_serve import Running, at_least_one, command, free_port, pick_setups, server_args  # noqa: E402 (the helpers beside this script)

SESSIONS_FILE = Path(__file__).resolve().parent / "replay_sessions.json"
SETUPS = ("specrun", "specrun-none", "plain", "ngram-mod", "draft-simple")
LLAMA_SERVER = ("plain", "ngram-mod", "draft-simple")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


@dataclass
class Request:
    """One request of a session as the server answered it."""

    ttft_ms: float
    wall_ms: float  # sent to the last chunk
    tokens: int  # usage.completion_tokens
    prompt_tokens: int
    cached_tokens: int | None
    finish_reason: str | None
    text: str  # the reply's content, then its tool calls as JSON lines
    drafted: int | None = None  # the server's timings.draft_n and draft_n_accepted (None: not sent)
    accepted: int | None = None

    @property
    def decode_rate(self) -> float:
        """Tokens a second after the first: the reply's decoding alone, without its prompt's."""
        after = (self.wall_ms - self.ttft_ms) / 1e3
        return (self.tokens - 1) / after if after > 0 and self.tokens > 1 else 0.0


@dataclass
class Played:
    setup: str
    run: int
    session: str
    wall_s: float = 0.0
    tokens: int = 0
    requests: list[Request] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def load_sessions(path: Path = SESSIONS_FILE) -> dict[str, dict]:
    return json.loads(path.read_text(encoding="utf-8"))


def ask(client, model: str, messages: list[dict], tools: list[dict] | None, n: int) -> tuple[Request, dict]:
    """One streamed greedy request: what it measured, and the assistant message to append."""
    extra = {"tools": tools} if tools else {}
    sent = time.monotonic()
    first = 0.0
    content: list[str] = []
    calls: dict[int, dict] = {}
    usage = None
    finish = None
    spec: dict = {}
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, **extra)  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        spec = (chunk.model_extra or {}).get("timings") or spec  # both servers send llama-server's timings
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if (delta.content or delta.tool_calls) and not first:
            first = time.monotonic()
        if delta.content:
            content.append(delta.content)
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    if usage is None:
        raise SystemExit("error: the server sent no usage chunk (stream_options.include_usage)")
    text = "".join(content)
    ordered = [calls[i] for i in sorted(calls)]
    message: dict = {"role": "assistant", "content": text or None}
    if ordered:
        message["tool_calls"] = [
            {"id": c["id"] or f"call_{k}", "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for k, c in enumerate(ordered)
        ]
    details = usage.prompt_tokens_details
    shown = text + "".join("\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]}) for c in ordered)
    request = Request(
        ttft_ms=((first or time.monotonic()) - sent) * 1e3,
        wall_ms=(time.monotonic() - sent) * 1e3,
        tokens=usage.completion_tokens,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=details.cached_tokens if details is not None else None,
        finish_reason=finish,
        text=shown,
        drafted=spec.get("draft_n"),
        accepted=spec.get("draft_n_accepted"),
    )
    return request, message


class Workspace:
    """The session's one file and scripted tool outputs, as the replies change them."""

    def __init__(self, session: dict):
        f = session.get("file") or {}
        self.path: str = f.get("path", "")
        self.text: str = f.get("text", "")
        self.outputs = {name: list(out) for name, out in session.get("tool_results", {}).items()}
        self.calls = {name: 0 for name in self.outputs}

    def fill(self, turn: str) -> str:
        return turn.replace("{path}", self.path).replace("{file}", self.text)

    def take_reply(self, content: str | None) -> None:
        """A whole-file edit: the reply's first closed fenced block is the file from now on."""
        m = FENCE.search(content or "")
        if self.path and m:
            self.text = m.group(1)

    def call(self, name: str, arguments: str) -> str:
        """A tool's result, as the tool message's content."""
        try:
            args = json.loads(arguments or "{}")
        except ValueError:
            return "error: the arguments are not JSON"
        if not isinstance(args, dict):
            return "error: the arguments are not a JSON object"
        path = str(args.get("path", ""))
        known = bool(self.path) and Path(path).name == Path(self.path).name
        if name == "read_file":
            return self.text if known else f"error: no such file: {path}"
        if name == "write_file":
            if not known:
                return f"error: {path} is not in this repository"
            self.text = str(args.get("content", ""))
            return f"wrote {len(self.text.splitlines())} lines to {self.path}"
        if name in self.outputs:
            outs = self.outputs[name]
            out = outs[min(self.calls[name], len(outs) - 1)]
            self.calls[name] += 1
            return out
        return f"error: unknown tool {name}"


def client_for(port: int):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=1800)


def play(client, model: str, name: str, session: dict, n: int, setup: str = "", run: int = 0) -> Played:
    """One session through ``client``: every turn, and the tool loop after it."""
    work = Workspace(session)
    tools = session.get("tools")
    limit = session.get("max_requests", 1_000_000)
    messages: list[dict] = [{"role": "system", "content": session["system"]}]
    played = Played(setup, run, name)
    start = time.monotonic()
    for turn in session["turns"]:
        messages.append({"role": "user", "content": work.fill(turn)})
        while len(played.requests) < limit:
            request, reply = ask(client, model, messages, tools, n)
            played.requests.append(request)
            messages.append(reply)
            if not reply.get("tool_calls"):
                work.take_reply(reply["content"])
                break
            for call in reply["tool_calls"]:
                result = work.call(call["function"]["name"], call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        if len(played.requests) >= limit:
            break
    played.wall_s = time.monotonic() - start
    played.tokens = sum(r.tokens for r in played.requests)
    return played


def play_or_exit(port: int, model: str, name: str, session: dict, n: int, setup: str, run: int) -> Played:
    """``play``, with a refused request ending the script in one line (it names the session)."""
    from openai import APIError

    try:
        return play(client_for(port), model, name, session, n, setup, run)
    except APIError as e:
        raise SystemExit(f"error: {setup} refused a request of session {name}: {e}") from None


def mismatches(played: list[Played]) -> list[dict]:
    """Where specrun's greedy texts differ from ``--draft none``'s, run by run (empty: none)."""
    out = []
    none = {(p.run, p.session): p for p in played if p.setup == "specrun-none"}
    for p in played:
        ref = none.get((p.run, p.session)) if p.setup == "specrun" else None
        if ref is None:
            continue
        for i, (a, b) in enumerate(zip(p.requests, ref.requests)):
            if a.text != b.text:
                at = next((k for k, (x, y) in enumerate(zip(a.text, b.text)) if x != y), min(len(a.text), len(b.text)))
                out.append({"run": p.run, "session": p.session, "request": i, "char": at,
                            "specrun": a.text[at:at + 40], "specrun-none": b.text[at:at + 40]})  # fmt: skip
                break  # the conversations differ from here on
        else:
            if len(p.requests) != len(ref.requests):
                out.append({"run": p.run, "session": p.session, "request": min(len(p.requests), len(ref.requests)),
                            "requests": {"specrun": len(p.requests), "specrun-none": len(ref.requests)}})  # fmt: skip
    return out


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(played: list[Played], setups: list[str], sessions: list[str]) -> str:
    lines = [f"{'session':11} {'setup':13} {'wall s':>8} {'tokens':>7} {'tok/s':>7}  TTFT ms | tok/s after it, per request"]
    for name in sessions:
        speed: dict[str, float] = {}
        for setup in setups:
            mine = [p for p in played if p.setup == setup and p.session == name]
            if not mine:
                continue
            speed[setup] = med([p.throughput for p in mine])
            longest = max(len(p.requests) for p in mine)
            ttfts = [med([p.requests[i].ttft_ms for p in mine if i < len(p.requests)]) for i in range(longest)]
            rates = [med([p.requests[i].decode_rate for p in mine if i < len(p.requests)]) for i in range(longest)]
            lines.append(f"{name:11} {setup:13} {med([p.wall_s for p in mine]):>8.1f} {med([p.tokens for p in mine]):>7.0f} "
                         f"{speed[setup]:>7.2f}  {' '.join(f'{t:.0f}' for t in ttfts)} | {' '.join(f'{r:.1f}' for r in rates)}")  # fmt: skip
        best = max(LLAMA_SERVER, key=lambda s: speed.get(s, -1.0))
        if "specrun" in speed and best in speed and speed[best] > 0:
            lines.append(f"{name}: specrun / llama-server's best ({best}): {speed['specrun'] / speed[best]:.2f}x")
    return "\n".join(lines)


def server_command(setup: str, args: argparse.Namespace, port: int) -> list[str]:
    if setup == "specrun-none":
        return [*command("specrun", args, port), "--draft", "none"]
    return command(setup, args, port)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server_args(ap, ctx=8192)
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--sessions", default=None, help="comma-separated session names (default: all in --file)")
    ap.add_argument("--file", type=Path, default=SESSIONS_FILE, help="the sessions, as JSON")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", "--max-tokens", type=int, default=512, help="max_tokens of every request")
    ap.add_argument("--json", action="store_true", help="print every session played and the comparison as JSON on stdout")
    ap.add_argument("--dry-run", action="store_true", help="print the server commands, start nothing")
    args = ap.parse_args(argv)
    args.setups = pick_setups(ap, args.setups, SETUPS)
    at_least_one(ap, args, ("runs", "max_tokens", "threads", "ctx", "parallel", "draft_max"))
    try:
        args.all_sessions = load_sessions(args.file)
    except (OSError, ValueError) as e:
        ap.error(f"cannot read the sessions in {args.file}: {e}")
    args.sessions = [s for s in args.sessions.split(",") if s] if args.sessions else list(args.all_sessions)
    unknown = [s for s in args.sessions if s not in args.all_sessions]
    if unknown or not args.sessions:
        ap.error(f"unknown session {', '.join(unknown) or '(none)'}; known: {', '.join(args.all_sessions)}")
    if any(s in LLAMA_SERVER for s in args.setups) and not args.bin:
        ap.error("--bin (llama.cpp's build/bin with llama-server) is needed for the llama-server setups")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        for s in args.setups:
            print(f"{s}: {shlex.join(server_command(s, args, free_port()))}")
        return 0
    for path in (args.target, args.draft):
        if not path.is_file():
            raise SystemExit(f"error: model file {path} does not exist")
    logs = Path(tempfile.mkdtemp(prefix="replay-sessions-"))
    played: list[Played] = []
    for run in range(1, args.runs + 1):
        turn = (run - 1) % len(args.setups)  # which setup goes first turns round, run by run
        for setup in args.setups[turn:] + args.setups[:turn]:
            port = free_port()
            cmd = server_command(setup, args, port)
            print(f"run {run}: starting {setup}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
            server = Running(setup, cmd, port, logs / f"{setup}.log")  # alone: the others are stopped
            try:
                for name in args.sessions:
                    p = play_or_exit(server.port, server.model, name, args.all_sessions[name], args.max_tokens, setup, run)
                    played.append(p)
                    print(f"run {run} {setup:13} {name:11} {len(p.requests)} requests, {p.tokens} tokens in {p.wall_s:.1f} s: "
                          f"{p.throughput:.2f} tok/s", file=sys.stderr, flush=True)  # fmt: skip
            finally:
                server.stop()
    diffs = mismatches(played)
    if args.json:
        records = [{**asdict(p), "throughput": p.throughput} for p in played]
        print(json.dumps({"played": records, "mismatches": diffs, "logs": str(logs)}, indent=1))
        return 0
    print(table(played, args.setups, args.sessions))
    if "specrun" in args.setups and "specrun-none" in args.setups:
        print(f"specrun's texts against --draft none's: {len(diffs)} session(s) differ" if diffs else
              "specrun's texts equal --draft none's in every session and run")  # fmt: skip
        for d in diffs:
            print(f"  {json.dumps(d)}")
    print(f"server logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
