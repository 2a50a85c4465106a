"""An Aider session through `specrun serve` against `llama-server`: the real agent, not a replay.

    python scripts/tools/aider_session.py --bin ~/.cache/specrun/llama.cpp-0.3.36/build/bin -t 2 [--runs 3]
    python scripts/tools/aider_session.py --aider /opt/aider/bin/aider --setups specrun,plain --turns 2
    python scripts/tools/aider_session.py --bin DIR --dry-run      # the server and Aider commands only

Aider (``pip install aider-chat``, in a virtual environment of its own: ``--aider`` names its
executable) edits one file of a fresh git repository, one ``aider --message`` a turn, as a user
scripts it: each turn is a new request that resends Aider's own system prompt and the file as the
last turn left it. The file and the turns are a session of ``replay_sessions.json`` (``--session``,
default ``whole-file``: a file and its edits in a row), each turn's instruction without the file
the replay inlines (Aider adds the file itself); ``--turns`` takes the first few. Aider runs with
its whole-file edit format (``--edit-format whole``, the format the issue's numbers came from),
no repository map, no commits, and nothing fetched from the network (``LITELLM_LOCAL_MODEL_COST_MAP``).

Setups (``--setups``): those of replay_sessions.py: ``specrun`` (`specrun serve -m T -d D` at its
defaults), ``specrun-none`` (``--draft none``), llama-server's ``plain``, ``ngram-mod`` and
``draft-simple``. One server holds the models at a time, started on a free 127.0.0.1 port for its
turn and stopped after; the order turns round run by run.

Per setup, medians over the runs: the session's wall time (every Aider process from start to
exit, its own start-up included, as a user waits for it), the tokens Aider counted as received,
and their rate over the wall time; each turn's wall time; then the best llama-server setup's wall
time over specrun's (above 1.00x, specrun's session was faster). Whether each setup left the file
as specrun's default did is printed too (greedy: the same text; near-ties may part them).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_serve import Running, at_least_one, free_port, pick_setups, server_args  # noqa: E402 (the helpers beside this script)
from replay_sessions import LLAMA_SERVER, SESSIONS_FILE, SETUPS, load_sessions, server_command  # noqa: E402

TOKENS = re.compile(r"Tokens:\s*([\d.]+)(k?)\s+sent,\s*([\d.]+)(k?)\s+received", re.I)
INLINED = re.compile(r"^\{path\}\s*```[^\n]*\n\{file\}```\s*", re.S)


@dataclass
class Turn:
    wall_s: float
    sent: int  # the tokens Aider counted as sent and received (its "Tokens:" lines)
    received: int
    exit_code: int


@dataclass
class Session:
    setup: str
    run: int
    turns: list[Turn] = field(default_factory=list)
    file_sha: str = ""  # the file as the session left it

    @property
    def wall_s(self) -> float:
        return sum(t.wall_s for t in self.turns)

    @property
    def received(self) -> int:
        return sum(t.received for t in self.turns)


def instructions(session: dict, turns: int | None) -> list[str]:
    """The session's turns as a user types them to Aider: without the inlined file."""
    out = [INLINED.sub("", t).strip() for t in session["turns"]]
    return out[:turns] if turns else out


def tokens_counted(output: str) -> tuple[int, int]:
    """The tokens a turn sent and received: the sum of Aider's "Tokens: N sent, M received." lines
    ("1.2k" is 1200), one a request (a turn whose edit Aider finds malformed asks again)."""
    sent = received = 0
    for n, ks, m, km in TOKENS.findall(output):
        sent += round(float(n) * (1000 if ks else 1))
        received += round(float(m) * (1000 if km else 1))
    return sent, received


def aider_command(aider: str, model: str, port: int, message: str, path: str) -> list[str]:
    """One turn: Aider at its whole-file format against the server on ``port``, nothing else."""
    return [
        aider, "--model", f"openai/{model}", "--openai-api-base", f"http://127.0.0.1:{port}/v1", "--openai-api-key", "unused",
        "--edit-format", "whole", "--map-tokens", "0", "--no-auto-commits", "--yes-always", "--no-show-model-warnings",
        "--no-check-update", "--analytics-disable", "--no-pretty", "--no-fancy-input", "--no-gitignore",
        "--message", message, path,
    ]  # fmt: skip


def aider_env() -> dict[str, str]:
    """Aider's environment: litellm's model table from its own copy, not the network."""
    return {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "AIDER_CHECK_UPDATE": "false"}


def play(aider: str, model: str, port: int, session: dict, turns: list[str], setup: str, run: int, log: Path) -> Session:
    """The session in a fresh git repository holding only its file."""
    played = Session(setup, run)
    path = session["file"]["path"]
    with tempfile.TemporaryDirectory(prefix="aider-session-") as tmp:
        repo = Path(tmp)
        (repo / path).write_text(session["file"]["text"])
        for git in (["init", "-q"], ["config", "user.email", "bench@127.0.0.1"], ["config", "user.name", "bench"], ["add", "."],
                    ["commit", "-qm", "the file before the session"]):  # fmt: skip
            subprocess.run(["git", *git], cwd=repo, check=True, capture_output=True)
        for i, message in enumerate(turns):
            t = time.monotonic()
            p = subprocess.run(aider_command(aider, model, port, message, path), cwd=repo, env=aider_env(),
                               capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=3600)  # fmt: skip
            wall = time.monotonic() - t
            with log.open("a") as f:
                f.write(f"\n===== {setup} run {run} turn {i + 1} (exit {p.returncode}, {wall:.1f} s)\n{p.stdout}{p.stderr}")
            played.turns.append(Turn(wall, *tokens_counted(p.stdout + p.stderr), p.returncode))
        played.file_sha = hashlib.sha256((repo / path).read_bytes()).hexdigest()[:12]
    return played


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(played: list[Session], setups: list[str]) -> str:
    lines = [f"{'setup':13} {'wall s':>8} {'received':>9} {'tok/s':>7}  wall s per turn; file as specrun's"]
    wall: dict[str, float] = {}
    for setup in setups:
        mine = [p for p in played if p.setup == setup]
        if not mine:
            continue
        wall[setup] = med([p.wall_s for p in mine])
        turns = max(len(p.turns) for p in mine)
        per_turn = [med([p.turns[i].wall_s for p in mine if i < len(p.turns)]) for i in range(turns)]
        same = [p.file_sha == q.file_sha for p in mine for q in played if q.setup == "specrun" and q.run == p.run and setup != "specrun"]
        failed = sum(t.exit_code != 0 for p in mine for t in p.turns)
        lines.append(
            f"{setup:13} {wall[setup]:>8.1f} {med([p.received for p in mine]):>9.0f} "
            f"{med([p.received / p.wall_s for p in mine if p.wall_s > 0]):>7.2f}  {' '.join(f'{w:.1f}' for w in per_turn)}"
            + (f"; {sum(same)}/{len(same)} runs" if same else "")
            + (f"; {failed} turn(s) exited non-zero" if failed else "")
        )
    llama = {s: w for s, w in wall.items() if s in LLAMA_SERVER}
    if "specrun" in wall and llama:
        best = min(llama, key=lambda s: llama[s])
        lines.append(f"llama-server's best ({best}) wall / specrun's: {llama[best] / wall['specrun']:.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server_args(ap, ctx=8192)
    ap.add_argument("--aider", default="aider", help="Aider's executable (default: aider on PATH)")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--session", default="whole-file", help="a session of --file with a file (default: whole-file)")
    ap.add_argument("--file", type=Path, default=SESSIONS_FILE, help="the sessions, as JSON")
    ap.add_argument("--turns", type=int, default=None, help="only the session's first N turns")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true", help="print the server and Aider commands, start nothing")
    args = ap.parse_args(argv)
    args.setups = pick_setups(ap, args.setups, SETUPS)
    at_least_one(ap, args, ("runs", "turns", "threads", "ctx", "parallel", "draft_max"))
    try:
        sessions = load_sessions(args.file)
    except (OSError, ValueError) as e:
        ap.error(f"cannot read the sessions in {args.file}: {e}")
    if args.session not in sessions or not sessions[args.session].get("file"):
        with_file = [n for n, s in sessions.items() if s.get("file")]
        ap.error(f"no session {args.session!r} with a file in {args.file}; those with one: {', '.join(with_file) or '(none)'}")
    args.chosen = sessions[args.session]
    if any(s in LLAMA_SERVER for s in args.setups) and not args.bin:
        ap.error("--bin (llama.cpp's build/bin with llama-server) is needed for the llama-server setups")
    if not args.dry_run and shutil.which(args.aider) is None:
        ap.error(f"Aider is not at {args.aider!r}; install it (pip install aider-chat, in a venv of its own) and give --aider")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    turns = instructions(args.chosen, args.turns)
    if args.dry_run:
        for s in args.setups:
            print(f"{s}: {shlex.join(server_command(s, args, free_port()))}")
        for m in turns:
            print(f"aider: {shlex.join(aider_command(args.aider, 'MODEL', 0, m, args.chosen['file']['path']))}")
        return 0
    for path in (args.target, args.draft):
        if not path.is_file():
            raise SystemExit(f"error: model file {path} does not exist")
    logs = Path(tempfile.mkdtemp(prefix="aider-sessions-"))
    played: list[Session] = []
    for run in range(1, args.runs + 1):
        first = (run - 1) % len(args.setups)
        for setup in args.setups[first:] + args.setups[:first]:
            port = free_port()
            cmd = server_command(setup, args, port)
            print(f"run {run}: starting {setup}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
            server = Running(setup, cmd, port, logs / f"{setup}.log")  # alone: the others are stopped
            try:
                p = play(args.aider, server.model, server.port, args.chosen, turns, setup, run, logs / "aider.log")
            finally:
                server.stop()
            played.append(p)
            print(f"run {run} {setup:13} {len(p.turns)} turns, {p.received} tokens received in {p.wall_s:.1f} s "
                  f"({' '.join(f'{t.wall_s:.1f}' for t in p.turns)})", file=sys.stderr, flush=True)  # fmt: skip
    print(table(played, args.setups))
    print(f"logs (Aider's output per turn, each server's): {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
