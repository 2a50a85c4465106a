"""Time to the first token on long prompts: `specrun serve` against `llama-server`, same client.

    python scripts/tools/ttft.py --bin ~/.cache/specrun/llama.cpp-0.3.36/build/bin -t 2 [--runs 3]

An agent's requests are long and share a prefix: a long system prompt, then a file and a
question. Each run starts every setup's server in turn (alternated run by run, one server in
memory at a time, as compare_serve.py does) and sends three streamed greedy requests of 8
tokens through the `openai` client:

* ``first``: the system prompt (about 1,300 tokens), a file and a question, to a fresh server;
* ``shared``: the same system prompt, another file and question (the prefix is cached);
* ``follow``: ``shared``'s conversation, its reply and one more question (all but the last
  turn cached).

The texts are Python's own standard library sources (`textwrap`, `shlex`, `fnmatch`), so the
prompts are the same at every commit. Each run puts its number in the system prompt's first
line, so no server answers from an earlier run's cache. Setups (``--setups``):

* ``specrun``: `specrun serve -m T -d D` at its defaults; ``specrun-none``: with `--draft none`;
  ``specrun-p1``: with `--parallel 1`; ``specrun-base``: at its defaults, from the checkout
  ``--base DIR`` (an A/B: `git worktree add --detach DIR BASE`);
* ``plain``: `llama-server -m T`; ``draft-simple``: `llama-server -m T -md D --spec-type draft-simple`.

Prints the median TTFT per setup and request over the runs, and specrun's ratio to
llama-server plain's (above 1: slower to the first token).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_serve  # noqa: E402

SPECRUN_FLAGS = {"specrun": [], "specrun-none": ["--draft", "none"], "specrun-p1": ["--parallel", "1"], "specrun-base": []}
SETUPS = ("specrun", "specrun-none", "specrun-p1", "specrun-base", "plain", "draft-simple")
REQUESTS = ("first", "shared", "follow")


def stdlib_source(name: str, chars: int) -> str:
    module = __import__(name)
    return inspect.getsource(module)[:chars]


def conversations(run: int) -> list[list[dict]]:
    """The three requests' messages (the third is completed with the second's reply when sent)."""
    system = (
        f"(run {run}) You are a careful senior engineer working inside a code editor. Answer with code "
        "only when asked for code; keep explanations short. Here is the project's text-wrapping module, "
        "which the user's questions may refer to:\n\n" + stdlib_source("textwrap", 5200)
    )
    file_a = stdlib_source("shlex", 1800)
    file_b = stdlib_source("fnmatch", 1800)
    first = [{"role": "system", "content": system}, {"role": "user", "content": f"{file_a}\n\nWhat does this module do?"}]
    shared = [{"role": "system", "content": system}, {"role": "user", "content": f"{file_b}\n\nName this module's public functions."}]
    return [first, shared, shared]


def ask(port: int, model: str, messages: list[dict], n: int) -> tuple[float, str]:
    """One streamed greedy request: (ms to the first content chunk, the reply's text)."""
    r = compare_serve.stream_chat(port, model, messages, n)
    return (r["first"] - r["sent"]) * 1e3 if r["text"] else float("nan"), r["text"]


def command(setup: str, args, port: int) -> list[str]:
    if setup == "specrun-base":
        return ["env", f"PYTHONPATH={args.base}", *compare_serve.command("specrun", args, port)]
    if setup in SPECRUN_FLAGS:
        return [*compare_serve.command("specrun", args, port), *SPECRUN_FLAGS[setup]]
    return compare_serve.command(setup, args, port)


def one_run(setup: str, args, run: int, logs: Path) -> dict[str, float]:
    port = compare_serve.free_port()
    server = compare_serve.Running(setup, command(setup, args, port), port, logs / f"{setup}.log")
    try:
        first, shared, follow = conversations(run)
        out = {}
        out["first"], _ = ask(port, server.model, first, args.max_tokens)
        out["shared"], reply = ask(port, server.model, shared, args.max_tokens)
        follow = [*follow, {"role": "assistant", "content": reply}, {"role": "user", "content": "And which of them is the slowest?"}]
        out["follow"], _ = ask(port, server.model, follow, args.max_tokens)
        return out
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    compare_serve.server_args(ap, parallel=1)
    ap.add_argument("--setups", default="specrun,specrun-none,plain", help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", "--max-tokens", type=int, default=8)
    ap.add_argument("--base", type=Path, help="setup specrun-base runs specrun from this checkout")
    ap.add_argument("--json", type=Path, help="also write every sample here")
    args = ap.parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    bad = [s for s in setups if s not in SETUPS]
    if bad:
        raise SystemExit(f"error: unknown setup {', '.join(bad)}; pick from {', '.join(SETUPS)}")
    if "specrun-base" in setups and not (args.base and (args.base / "specrun").is_dir()):
        raise SystemExit("error: setup specrun-base needs --base DIR, a checkout of specrun")
    if any(s not in SPECRUN_FLAGS for s in setups) and not args.bin:
        raise SystemExit("error: llama-server setups need --bin (llama.cpp's build/bin)")
    samples: dict[str, list[dict[str, float]]] = {s: [] for s in setups}
    with tempfile.TemporaryDirectory(prefix="specrun-ttft-") as tmp:
        for run in range(args.runs):
            order = setups[run % len(setups) :] + setups[: run % len(setups)]  # A B C, B C A, ...
            for setup in order:
                got = one_run(setup, args, run, Path(tmp))
                samples[setup].append(got)
                print(f"run {run} {setup:13} " + "  ".join(f"{r} {got[r]:7.0f} ms" for r in REQUESTS), flush=True)
    med = {s: {r: statistics.median(x[r] for x in samples[s]) for r in REQUESTS} for s in setups}
    print(f"\n{'setup':13} " + " ".join(f"{r + ' ms':>10}" for r in REQUESTS))
    for s in setups:
        print(f"{s:13} " + " ".join(f"{med[s][r]:>10.0f}" for r in REQUESTS))
    if "plain" in med:
        for s in setups:
            if s in SPECRUN_FLAGS:
                print(f"{s} / llama-server plain: " + "  ".join(f"{r} {med[s][r] / med['plain'][r]:.3f}x" for r in REQUESTS))
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
