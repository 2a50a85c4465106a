"""`specrun serve` against `llama-server`, through the same `openai` client, on the same pair.

    python scripts/tools/compare_serve.py --bin ~/.cache/specrun/llama.cpp-0.3.36/build/bin -t 2 [--runs 3]
    scripts/compare-llama-cpp.sh --serve        # builds llama-server first, then runs this

Setups (``--setups``, any of them, in this order):

* ``draft-simple``: ``llama-server -m T -md D --spec-type draft-simple`` (the draft model);
* ``ngram-mod``: ``llama-server -m T --spec-type ngram-mod`` (n-gram lookup, no draft model);
* ``plain``: ``llama-server -m T`` (no speculation);
* ``specrun``: ``specrun serve -m T -d D`` at its defaults.

Run by run, each setup is measured in turn (A B C D, B C D A, ...), so drift in the machine's
speed falls on all of them alike. Each server is started for its turn on a free 127.0.0.1 port
and stopped after it, so only one holds the models at a time: on a VM a process that loads a
model while another holds one can get faster memory (see BENCHMARKS.md), which would favour
whichever server started last. A measurement streams the prompts of each class (``--classes``, from
specrun's packaged bench prompts) through ``openai.OpenAI(...).chat.completions.create(...,
stream=True)``, greedy, ``-n`` tokens at most, with 1 client (the prompts one after another)
and with 4 concurrent clients (``--clients``: one prompt each, started together). Each run
puts its number in the system prompt, so no server answers from its prompt cache of the run
before.

Per setup, class and client count, the medians over the runs of:

* tok/s per client: completion tokens / (last chunk - first content chunk), per request;
* total tok/s: all completion tokens / (last chunk of any request - first request sent);
* time to first token: first content chunk - request sent, per request (median, ms).

The table ends with specrun's single-client tok/s against llama-server's best speculative
setup and against its plain decoding, per class. ``--json`` writes every sample.
``--dry-run`` prints the commands and starts nothing. Only 127.0.0.1 is ever contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

MODELS = Path(os.environ.get("SPECRUN_MODELS_DIR") or Path.home() / ".cache/specrun/models")
SETUPS = ("draft-simple", "ngram-mod", "plain", "specrun")
SPECULATIVE = ("draft-simple", "ngram-mod")


@dataclass
class Sample:
    setup: str
    cls: str
    clients: int
    run: int
    per_client_tps: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    total_tps: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(setup: str, args, port: int) -> list[str]:
    """The server command line for ``setup`` (llama-server's flags as this llama.cpp names them)."""
    if setup == "specrun":
        specrun = args.specrun or str(Path(sys.executable).parent / "specrun")
        return [specrun, "serve", "-m", str(args.target), "-d", str(args.draft), "-t", str(args.threads), "-c", str(args.ctx),
                "--host", "127.0.0.1", "--port", str(port), "--quiet"]  # fmt: skip
    cmd = [str(Path(args.bin) / "llama-server"), "-m", str(args.target), "-t", str(args.threads), "-c", str(args.ctx * args.parallel),
           "-np", str(args.parallel), "-ngl", str(args.ngl), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    if setup == "draft-simple":
        cmd += ["-md", str(args.draft), "-ngld", str(args.ngl), "-td", str(args.threads), "--spec-type", "draft-simple"]
        if args.draft_max is not None:  # else llama-server's own default
            old = "--draft-max" in _help(args.bin) and "--spec-draft-n-max" not in _help(args.bin)
            cmd += ["--draft-max" if old else "--spec-draft-n-max", str(args.draft_max)]
    elif setup == "ngram-mod":
        cmd += ["--spec-type", "ngram-mod"]
    return cmd


_HELP: dict[str, str] = {}


def _help(bin_dir: str) -> str:
    """llama-server's --help (flags were renamed across versions); empty when it cannot run."""
    if bin_dir not in _HELP:
        try:
            p = subprocess.run([str(Path(bin_dir) / "llama-server"), "--help"], capture_output=True, text=True, timeout=60)
            _HELP[bin_dir] = p.stdout + p.stderr
        except OSError:
            _HELP[bin_dir] = ""
    return _HELP[bin_dir]


class Running:
    """A server process, up once its /health answers 200."""

    def __init__(self, setup: str, cmd: list[str], port: int, log: Path, timeout: float = 600.0):
        self.setup, self.port, self.log = setup, port, log
        self.out = open(log, "a")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{setup} exited with status {self.proc.returncode}; see {log}")
            if self._healthy():
                self.model = self._model()
                return
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{setup} did not answer /health within {timeout:.0f} s; see {log}")

    def _healthy(self) -> bool:
        import http.client

        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
            return ok
        except OSError:
            return False

    def _model(self) -> str:
        """The served model's id, as requests must name it (specrun serve refuses other names)."""
        import http.client

        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        c.request("GET", "/v1/models")
        data = json.loads(c.getresponse().read())
        c.close()
        return data["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.out.close()


def stream_chat(port: int, model: str, messages: list[dict], n: int, prediction: str | None = None) -> dict:
    """One streamed greedy chat request (with OpenAI's ``prediction`` where given): when it was
    sent, its first content chunk came (its last chunk, if none had content) and its last chunk
    came, as monotonic seconds; its completion tokens and text; and the prediction tokens the
    usage says were accepted and rejected (None where it says nothing)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=1800)
    extra = {"prediction": {"type": "content", "content": prediction}} if prediction is not None else {}
    sent = time.monotonic()
    first = last = 0.0
    text, usage = [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, **extra)  # fmt: skip
    for chunk in stream:
        last = time.monotonic()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or last
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    details = getattr(usage, "completion_tokens_details", None) if usage is not None else None
    return {
        "sent": sent, "first": first or last, "last": last, "tokens": usage.completion_tokens if usage is not None else 0,
        "text": "".join(text),
        "accepted": getattr(details, "accepted_prediction_tokens", None) if details else None,
        "rejected": getattr(details, "rejected_prediction_tokens", None) if details else None,
    }  # fmt: skip


def ask(port: int, model: str, system: str, prompt: str, n: int) -> tuple[float, float, float, int]:
    """One streamed request: (sent, first content chunk, last chunk) as monotonic seconds, and completion tokens."""
    r = stream_chat(port, model, [{"role": "system", "content": system}, {"role": "user", "content": prompt}], n)
    return r["sent"], r["first"], r["last"], r["tokens"]


def measure(server: Running, cls: str, prompts: list[str], clients: int, run: int, n: int) -> Sample:
    sample = Sample(server.setup, cls, clients, run)
    system = f"You are a helpful assistant. (run {run})"
    results: list[tuple[float, float, float, int]] = []
    if clients == 1:
        results = [ask(server.port, server.model, system, p, n) for p in prompts]
        span = sum(end - sent for sent, _, end, _ in results)
    else:
        lock = threading.Lock()

        def one(p: str) -> None:
            r = ask(server.port, server.model, system, p, n)
            with lock:
                results.append(r)

        threads = [threading.Thread(target=one, args=(prompts[i % len(prompts)],)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        span = max(end for _, _, end, _ in results) - min(sent for sent, _, _, _ in results)
    for sent, first, end, tokens in results:
        if tokens > 1 and end > first:
            sample.per_client_tps.append((tokens - 1) / (end - first))  # the first token came with the first chunk
        sample.ttft_ms.append((first - sent) * 1e3)
        sample.tokens += tokens
    sample.total_tps = sample.tokens / span if span > 0 else 0.0
    return sample


def bench_prompts(classes: list[str], limit: int) -> dict[str, list[str]]:
    text = resources.files("specrun").joinpath("data/bench_prompts.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = {c: [r["prompt"] for r in rows if r["class"] == c][:limit] for c in classes}
    missing = [c for c, ps in out.items() if not ps]
    if missing:
        raise SystemExit(f"error: no bench prompts of class {', '.join(missing)}; known: {', '.join(sorted({r['class'] for r in rows}))}")
    return out


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(samples: list[Sample], setups: list[str], classes: list[str], clients: list[int]) -> str:
    lines = [f"{'setup':14} {'class':10} {'clients':>7} {'tok/s per client':>17} {'total tok/s':>12} {'TTFT ms':>9}"]
    single: dict[tuple[str, str], float] = {}
    for cls in classes:
        for k in clients:
            for setup in setups:
                mine = [s for s in samples if s.setup == setup and s.cls == cls and s.clients == k]
                if not mine:
                    continue
                per = med([med(s.per_client_tps) for s in mine])
                total = med([s.total_tps for s in mine])
                ttft = med([med(s.ttft_ms) for s in mine])
                if k == 1:
                    single[(setup, cls)] = per
                lines.append(f"{setup:14} {cls:10} {k:>7} {per:>17.2f} {total:>12.2f} {ttft:>9.0f}")
    for cls in classes:
        spec = single.get(("specrun", cls))
        best = max((single[(s, cls)] for s in SPECULATIVE if (s, cls) in single), default=None)
        plain = single.get(("plain", cls))
        if spec is not None and best:
            lines.append(f"{cls}: specrun / llama-server's best speculative, 1 client: {spec / best:.2f}x")
        if spec is not None and plain:
            lines.append(f"{cls}: specrun / llama-server plain, 1 client: {spec / plain:.2f}x")
    return "\n".join(lines)


def server_args(ap: argparse.ArgumentParser, ctx: int = 4096, parallel: int = 4) -> None:
    """The arguments ``command`` reads, for every script that starts these servers."""
    ap.add_argument("--bin", default=None, help="llama.cpp's build/bin, with llama-server (not needed for the specrun setups)")
    ap.add_argument("--target", type=Path, default=MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    ap.add_argument("--draft", type=Path, default=MODELS / "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf")
    ap.add_argument("--specrun", default=None, help="the specrun executable (default: beside this Python)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 4)
    ap.add_argument("-c", "--ctx", type=int, default=ctx, help="context per client (llama-server gets ctx x --parallel)")
    ap.add_argument("--parallel", type=int, default=parallel, help="llama-server's slots (-np)")
    ap.add_argument("--draft-max", type=int, default=None, help="llama-server's --spec-draft-n-max (default: its own)")
    ap.add_argument("--ngl", type=int, default=99)


def pick_setups(ap: argparse.ArgumentParser, given: str, known: tuple[str, ...]) -> list[str]:
    """The comma-separated setups of ``given``, each one of ``known`` (else the parser's one-line error)."""
    setups = [s for s in given.split(",") if s]
    bad = [s for s in setups if s not in known]
    if bad or not setups:
        ap.error(f"unknown setup {', '.join(bad) or '(none)'}; known: {', '.join(known)}")
    return setups


def at_least_one(ap: argparse.ArgumentParser, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Each of ``names`` that was given (not None) is 1 or more (else the parser's one-line error)."""
    for name in names:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server_args(ap)
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--classes", default="code-edit,chat", help="bench prompt classes (code-edit copies, chat has little to copy)")
    ap.add_argument("--clients", default="1,4", help="concurrent clients to measure, comma-separated")
    ap.add_argument("--limit", type=int, default=4, help="prompts per class (4 clients: one prompt each)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, help="also write every sample here")
    ap.add_argument("--dry-run", action="store_true", help="print the server commands, start nothing")
    args = ap.parse_args(argv)
    args.setups = pick_setups(ap, args.setups, SETUPS)
    try:
        args.clients = sorted({int(c) for c in args.clients.split(",") if c})
    except ValueError:
        ap.error(f"--clients takes comma-separated numbers, got {args.clients!r}")
    if not args.clients or min(args.clients) < 1:
        ap.error("--clients must name at least one count of 1 or more")
    at_least_one(ap, args, ("runs", "max_tokens", "threads", "ctx", "parallel", "limit", "draft_max"))
    args.classes = [c for c in args.classes.split(",") if c]
    if any(s != "specrun" for s in args.setups) and not args.bin:
        ap.error("--bin (llama.cpp's build/bin with llama-server) is needed for the llama-server setups")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        for s in args.setups:
            print(f"{s}: {shlex.join(command(s, args, free_port()))}")
        return 0
    prompts = bench_prompts(args.classes, args.limit)
    for path in (args.target, args.draft):
        if not path.is_file():
            raise SystemExit(f"error: model file {path} does not exist")
    logs = Path(tempfile.mkdtemp(prefix="compare-serve-"))
    samples: list[Sample] = []
    for run in range(1, args.runs + 1):
        turn = (run - 1) % len(args.setups)  # which setup goes first turns round, run by run
        for s in args.setups[turn:] + args.setups[:turn]:
            port = free_port()  # picked at each start: a port freed a run ago may have been taken since
            cmd = command(s, args, port)
            print(f"run {run}: starting {s}: {shlex.join(cmd)}", flush=True)
            server = Running(s, cmd, port, logs / f"{s}.log")  # alone: the others are stopped
            try:
                for cls in args.classes:
                    for k in args.clients:
                        sample = measure(server, cls, prompts[cls], k, run, args.max_tokens)
                        samples.append(sample)
                        print(f"run {run} {server.setup:12} {cls:10} {k} client(s): {med(sample.per_client_tps):7.2f} tok/s per client, "
                              f"{sample.total_tps:7.2f} total, TTFT {med(sample.ttft_ms):6.0f} ms", flush=True)  # fmt: skip
            finally:
                server.stop()
    print()
    print(table(samples, args.setups, args.classes, args.clients))
    print(f"server logs: {logs}")
    if args.json:
        args.json.write_text(json.dumps([s.__dict__ for s in samples], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
