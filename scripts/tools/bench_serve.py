"""Benchmark `specrun serve` against `specrun generate`, all in one run, on one machine.

    python scripts/tools/bench_serve.py -m qwen-1.5b -d qwen-0.5b -t 2 [--runs 3] [-n 64] [--sections speed,cache,load] [--json]

1. Speed: for each prompt (chat, code-gen, code-edit from the packaged bench set) and each
   drafting mode (hybrid, none), interleaved run by run, generate first in even runs and the
   server first in odd ones, each run with a server started for it and stopped before
   generate runs (only one of them holds the models at a time; see speed()): `specrun generate --json` (its own
   generation tok/s, prompt processing excluded) and the same prompt streamed through the
   server, timed at the client from sending the request to `[DONE]`, less the prompt
   processing time the server reports (`timings.prompt_ms`). A short unrelated request goes
   first, so that the server prefills the whole prompt as generate does. Both figures leave
   prompt processing out; the server's includes HTTP, JSON, SSE, the chat template and
   tokenizing. Ratios are medians of the run-by-run ratios; "client / engine" sets the client's figure against the server's
   own `timings.predicted_per_second` for the same request, which isolates the HTTP layer.
2. Prompt cache: time to first token of a chat's second turn against its first, with a long
   shared prefix (a ~1,500-token system prompt).
3. Load: requests/s and p50/p95 latency (request sent to response read) with 1, 4 and 8
   concurrent clients, each sending short chat requests (32 tokens).

Only 127.0.0.1 is ever contacted; the server picks a free port.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # serve_helpers

from serve_helpers import SPECRUN, Server  # noqa: E402

CLASSES = ("chat", "code-gen", "code-edit")


def bench_prompts() -> list[dict]:
    text = resources.files("specrun").joinpath("data/bench_prompts.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [next(r for r in rows if r["class"] == c) for c in CLASSES]


SUMMARY = re.compile(r"(\d+) tokens in ([\d.]+) s, ([\d.]+) tok/s")


def generate_tps(args, prompt: str, mode: str, n: int, piped: bool) -> float:
    """generate's own generation tok/s (prompt processing left out). ``piped``: its text streams
    to a pipe this process reads as it comes, as a terminal would; else ``--json`` (no reader)."""
    cmd = [str(SPECRUN), "generate", "-m", args.model, "-t", str(args.threads), "-c", str(args.ctx), "--chat", "-p", prompt]
    cmd += ["-n", str(n), "--draft", mode] + (["-d", args.draft_model] if args.draft_model else [])
    p = subprocess.run(cmd if piped else [*cmd, "--json"], capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"specrun generate failed: {p.stderr}")
    if not piped:
        return json.loads(p.stdout)["stats"]["generation_tps"]
    m = SUMMARY.search(p.stderr)
    assert m, p.stderr
    return float(m.group(3))


def stream_timed(server: Server, body: dict) -> dict:
    """Send, then time the stream: first content, [DONE], and the usage at the end."""
    t0 = time.perf_counter()
    first = None
    usage = timings = None
    text = []
    for chunk in server.stream("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}, timeout=900):
        if chunk == "[DONE]":
            break
        assert isinstance(chunk, dict)
        content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
        if content:
            first = first or time.perf_counter()
            text.append(content)
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
    t1 = time.perf_counter()
    assert usage is not None and timings is not None
    return {
        "total_s": t1 - t0, "ttft_s": (first or t1) - t0, "tokens": usage["completion_tokens"], "usage": usage, "timings": timings,
        "text": "".join(text),
    }  # fmt: skip


def bust(server: Server, mode: str) -> None:
    """Another short conversation first, so that the measured request prefills its whole
    prompt, as generate does, and does not pay for the first decode after a load or a pause,
    which is slow (as the calibration leaves it out too)."""
    status, _, r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1, "draft": mode})
    assert status == 200, r


def speed(start: Callable[[], Server], args, prompts: list[dict]) -> list[dict]:
    """Each run starts a server of its own and stops it before generate runs, so that only one
    of the two holds the models at a time: on this kind of VM a process that loads a model
    while another holds one gets faster memory (measured: a second copy of the demo target
    loaded in the same process decoded at 17.4 tok/s, the first at 15.2), which a server left
    running would hand to every generate beside it."""
    rows = []
    for p in prompts:
        n = min(args.n_predict, p.get("n", args.n_predict))
        messages = [{"role": "user", "content": p["prompt"]}]
        for mode in ("hybrid", "none"):
            body = {"messages": messages, "max_tokens": n, "temperature": 0, "draft": mode}
            gen, srv, inner = [], [], []
            for run in range(args.runs):  # interleaved, and which goes first turns round run by run
                if run % 2 == 0:
                    gen.append(generate_tps(args, p["prompt"], mode, n, piped=args.piped))
                server = start()
                try:
                    bust(server, mode)
                    r = stream_timed(server, body)
                finally:
                    server.stop()
                srv.append(r["tokens"] / (r["total_s"] - r["timings"]["prompt_ms"] / 1e3))
                inner.append(r["timings"]["predicted_per_second"])  # the server's engine, same request
                if run % 2 == 1:
                    gen.append(generate_tps(args, p["prompt"], mode, n, piped=args.piped))
            row = {"class": p["class"], "mode": mode, "n": n, "generate_tps": statistics.median(gen), "serve_tps": statistics.median(srv)}
            row["serve_engine_tps"] = statistics.median(inner)
            row["ratio"] = statistics.median(
                s / g for s, g in zip(srv, gen)
            )  # pair by pair: each serve run against the generate run beside it
            row["ratio_http"] = statistics.median(a / b for a, b in zip(srv, inner))  # what HTTP, JSON and SSE cost, request by request
            rows.append(row)
            print(f"  {p['class']:<9} {mode:<6} generate {row['generate_tps']:6.2f} tok/s  serve {row['serve_tps']:6.2f} tok/s "
                  f"(its engine {row['serve_engine_tps']:6.2f})  x{row['ratio']:.3f}, client/engine x{row['ratio_http']:.3f}", file=sys.stderr)  # fmt: skip
    return rows


def cache(server: Server, args) -> list[dict]:
    source = resources.files("specrun").joinpath("stream.py").read_text(encoding="utf-8")  # ~1,500 tokens of code
    rows = []
    for i, question in enumerate(("What does stop_scan return?", "Which finish reasons can an Event carry?")):
        system = f"(session {i}) You answer questions about this module.\n\n{source}"
        first = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        r1 = stream_timed(server, {"messages": first, "max_tokens": 24, "temperature": 0})
        second = first + [{"role": "assistant", "content": r1["text"]}, {"role": "user", "content": "Answer again in one sentence."}]
        r2 = stream_timed(server, {"messages": second, "max_tokens": 24, "temperature": 0})
        rows.append({
            "prefix_tokens": r1["usage"]["prompt_tokens"], "ttft_first_s": r1["ttft_s"], "ttft_second_s": r2["ttft_s"],
            "second_cached": r2["usage"]["prompt_tokens_details"]["cached_tokens"], "second_prompt_n": r2["timings"]["prompt_n"],
        })  # fmt: skip
        print(f"  prefix {r1['usage']['prompt_tokens']} tok: TTFT first {r1['ttft_s']:.2f} s, second {r2['ttft_s']:.3f} s "
              f"({rows[-1]['second_cached']} cached, {rows[-1]['second_prompt_n']} evaluated)", file=sys.stderr)  # fmt: skip
    return rows


def load(server: Server, args) -> list[dict]:
    rows = []
    counter = iter(range(10**6))
    lock = threading.Lock()
    for clients in (int(c) for c in args.clients.split(",")):
        total = max(args.load_requests, clients * 2)
        tokens = [0]

        def one(_: int, tokens: list[int] = tokens) -> float:
            with lock:
                k = next(counter)
            body = {
                "messages": [{"role": "user", "content": f"Give me fact number {k} about the number {k * 7}."}],
                "max_tokens": 32,
                "temperature": 0,
            }
            t0 = time.perf_counter()
            status, _, r = server.post("/v1/chat/completions", body, timeout=900)
            assert status == 200, r
            with lock:
                tokens[0] += r["usage"]["completion_tokens"]
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            lat = sorted(pool.map(one, range(total)))
        wall = time.perf_counter() - t0
        q = statistics.quantiles(lat, n=20)
        rows.append(
            {
                "clients": clients,
                "requests": total,
                "rps": total / wall,
                "tps": tokens[0] / wall,
                "p50_s": statistics.median(lat),
                "p95_s": q[18],
            }
        )
        print(
            f"  {clients} clients: {total / wall:.2f} req/s, {tokens[0] / wall:.1f} tok/s in all, "
            f"p50 {rows[-1]['p50_s']:.2f} s, p95 {rows[-1]['p95_s']:.2f} s",
            file=sys.stderr,
        )
    return rows


def markdown(data: dict) -> str:
    """The sections that ran, as Markdown tables."""
    out: list[str] = []
    if data["speed"]:
        out += [
            "| class | mode | tokens | generate tok/s | serve tok/s, SSE at the client | serve's engine (timings) | serve / generate | client / serve's engine |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in data["speed"]:
            out.append(f"| {r['class']} | {r['mode']} | {r['n']} | {r['generate_tps']:.2f} | {r['serve_tps']:.2f} | {r['serve_engine_tps']:.2f} | "
                       f"{r['ratio']:.3f}x | {r['ratio_http']:.3f}x |")  # fmt: skip
        for key, what in (("ratio", "generate"), ("ratio_http", "serve's own engine")):
            ratios = [r[key] for r in data["speed"]]
            out.append(f"\nserve / {what}: geometric mean {statistics.geometric_mean(ratios):.3f}x, lowest {min(ratios):.3f}x.")
        out.append("")
    if data["cache"]:
        out += ["| shared prefix | TTFT turn 1 | TTFT turn 2 | turn 2 cached / evaluated | ratio |", "|---|---|---|---|---|"]
        for r in data["cache"]:
            out.append(f"| {r['prefix_tokens']} tok | {r['ttft_first_s']:.2f} s | {r['ttft_second_s']:.3f} s | "
                       f"{r['second_cached']} / {r['second_prompt_n']} | {r['ttft_first_s'] / r['ttft_second_s']:.1f}x faster |")  # fmt: skip
        out.append("")
    if data["load"]:
        out += ["| clients | requests | requests/s | tok/s, all clients | p50 latency | p95 latency |", "|---|---|---|---|---|---|"]
        for r in data["load"]:
            out.append(f"| {r['clients']} | {r['requests']} | {r['rps']:.2f} | {r['tps']:.1f} | {r['p50_s']:.2f} s | {r['p95_s']:.2f} s |")
    return "\n".join(out).strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen-1.5b")
    ap.add_argument("-d", "--draft-model", default="qwen-0.5b")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--piped", action="store_true", help="run generate with its text piped to this process (as a terminal reads it) instead of --json"
    )
    ap.add_argument("--load-requests", type=int, default=16)
    ap.add_argument("--clients", default="1,4,8", help="the load section's concurrent clients, comma-separated")
    ap.add_argument("--parallel", type=int, default=None, help="the server's --parallel (default: its own)")
    ap.add_argument("--sections", default="speed,cache,load", help="which parts to run (each computes its ratios within itself)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server on the way out
    with tempfile.TemporaryDirectory() as home:
        srv_args = ["-m", args.model, "-t", str(args.threads), "-c", str(args.ctx), "--quiet"]
        if args.draft_model:
            srv_args += ["-d", args.draft_model]
        if args.parallel is not None:
            srv_args += ["--parallel", str(args.parallel)]

        # the user's own registry and cost cache: the server and generate share one calibration
        def start() -> Server:
            return Server(srv_args, Path(home), isolate=False)

        wanted = set(args.sections.split(","))
        data: dict = {"speed": [], "cache": [], "load": []}
        if "speed" in wanted:
            print("speed: serve (streamed, timed at the client) vs generate, a fresh server each run", file=sys.stderr)
            data["speed"] = speed(start, args, bench_prompts())
        if wanted & {"cache", "load"}:
            server = start()
            try:
                if "cache" in wanted:
                    print("prompt cache: second-turn TTFT", file=sys.stderr)
                    data["cache"] = cache(server, args)
                if "load" in wanted:
                    print(f"load: {args.clients} concurrent clients", file=sys.stderr)
                    data["load"] = load(server, args)
            finally:
                server.stop()
    print(json.dumps(data, indent=2) if args.json else markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
