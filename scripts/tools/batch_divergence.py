"""How far into a greedy reply batching first changes the text, on a real `specrun serve`.

    nice -n 10 python scripts/tools/batch_divergence.py -t 2 [--clients 4] [-n 128] [--json]

Starts ``specrun serve -m T -d D`` at its defaults (``--parallel 0``: as many sequences as
memory allows, up to 4) on a free 127.0.0.1 port with compare_serve.py's helpers, and sends
``--prompts`` of specrun's packaged bench prompts (two each of chat, code-gen, code-edit and
explain), streaming, greedy, ``-n`` tokens, through the `openai` client in three passes:

1. ``alone``: one request at a time;
2. ``batched``: ``--clients`` threads take the prompts in turn, so that many decode together;
3. ``again``: one at a time once more, the control: a difference here is not batching's.

Each pass sends its own ``user``, so no pass drafts from another's replies (the server's
earlier-replies source keeps them per tenant); the prompt cache is shared, as with any client.
Per prompt it prints the token at which the batched reply first differs from the alone one
(and the control's), counted as the tokens of the text they share, tokenized with the
target's vocabulary; ``same`` where the texts are equal. Not a timing measurement.

``--serve-args '--parallel 1'`` (or ``'--parallel 1 --draft none'``) measures the same passes
against a server that never batches requests together: what a difference is left there is not
batching's. ``--classes`` and ``--prompts`` pick the prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import statistics
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_serve import MODELS, Running, at_least_one, bench_prompts, command, free_port  # noqa: E402 (the helpers beside this script)

CLASSES = ("chat", "code-gen", "code-edit", "explain")
SYSTEM = "You are a helpful assistant."


def reply(port: int, model: str, prompt: str, n: int, user: str) -> tuple[str, int]:
    """One streamed greedy request: its text and completion tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=1800)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    text: list[str] = []
    tokens = 0
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0, stream=True, user=user,
                                            stream_options={"include_usage": True})  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(text), tokens


def one_at_a_time(port: int, model: str, prompts: list[str], n: int, user: str) -> list[tuple[str, int]]:
    return [reply(port, model, p, n, user) for p in prompts]


def together(port: int, model: str, prompts: list[str], n: int, user: str, clients: int) -> list[tuple[str, int]]:
    """``clients`` threads take the prompts in turn: that many requests are in flight at once."""
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(prompts)):
        todo.put(i)
    out: list[tuple[str, int] | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                out[i] = reply(port, model, prompts[i], n, user)
            except Exception as e:  # noqa: BLE001 (raised again below, in the main thread)
                errors.append(e)
                return

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in out if r is not None]


def sequences(port: int) -> int:
    """How many requests the server decodes together (/health's ``parallel``)."""
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/health")
    parallel = json.loads(c.getresponse().read())["parallel"]
    c.close()
    return parallel


def first_difference(a: str, b: str) -> int | None:
    """The first character at which ``a`` and ``b`` differ (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    ap.add_argument("--draft", type=Path, default=MODELS / "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf")
    ap.add_argument("--specrun", default=None, help="the specrun executable (default: beside this Python)")
    ap.add_argument("--prompts", type=int, default=8, help="bench prompts, taken by class in turn")
    ap.add_argument("--classes", default=",".join(CLASSES), help="bench prompt classes, comma-separated")
    ap.add_argument("--serve-args", default="", help="more flags for specrun serve, e.g. '--parallel 1 --draft none'")
    ap.add_argument("--clients", type=int, default=4, help="requests in flight in the batched pass")
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 4)
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--json", action="store_true", help="print every reply and position as JSON on stdout")
    args = ap.parse_args(argv)
    args.classes = [c for c in args.classes.split(",") if c]
    at_least_one(ap, args, ("prompts", "clients", "max_tokens", "threads", "ctx"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for path in (args.target, args.draft):
        if not path.is_file():
            raise SystemExit(f"error: model file {path} does not exist")
    per_class = bench_prompts(args.classes, -(-args.prompts // len(args.classes)))
    picked = [
        (c, p) for k in range(max(map(len, per_class.values()))) for c in args.classes if k < len(per_class[c]) for p in [per_class[c][k]]
    ]
    picked = picked[: args.prompts]
    prompts = [p for _, p in picked]

    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(args.target), vocab_only=True, verbose=False)

    def tokens_of(text: str) -> int:
        return len(vocab.tokenize(text.encode(), add_bos=False, special=False)) if text else 0

    port = free_port()
    cmd = command("specrun", args, port) + shlex.split(args.serve_args)
    log = Path(tempfile.mkdtemp(prefix="batch-divergence-")) / "specrun.log"
    print(f"starting {shlex.join(cmd)}", file=sys.stderr, flush=True)
    server = Running("specrun", cmd, port, log)
    try:
        parallel = sequences(port)
        print("pass 1: alone", file=sys.stderr, flush=True)
        alone = one_at_a_time(port, server.model, prompts, args.max_tokens, "alone")
        print(f"pass 2: {args.clients} clients together", file=sys.stderr, flush=True)
        batched = together(port, server.model, prompts, args.max_tokens, "batched", args.clients)
        print("pass 3: alone again (control)", file=sys.stderr, flush=True)
        again = one_at_a_time(port, server.model, prompts, args.max_tokens, "again")
    finally:
        server.stop()

    rows = []
    for (cls, prompt), a, b, c in zip(picked, alone, batched, again):
        at, ctl = first_difference(a[0], b[0]), first_difference(a[0], c[0])
        rows.append({"class": cls, "prompt": prompt, "tokens": [a[1], b[1], c[1]],
                     "batched_differs_at_token": None if at is None else tokens_of(a[0][:at]),
                     "again_differs_at_token": None if ctl is None else tokens_of(a[0][:ctl]),
                     "alone": a[0], "batched": b[0], "again": c[0]})  # fmt: skip
    if args.json:
        report = {"command": shlex.join(cmd), "parallel": parallel, "clients": args.clients, "max_tokens": args.max_tokens, "rows": rows}
        print(json.dumps(report, indent=1))
        return 0
    print(f"{args.clients} clients against a server decoding {parallel} requests together; {args.max_tokens} tokens each")
    print(f"{'#':>2} {'class':10} {'tokens (alone, batched, again)':>31} {'batched differs at':>19} {'again differs at':>17}")
    for i, r in enumerate(rows):
        b, c = r["batched_differs_at_token"], r["again_differs_at_token"]
        print(f"{i:>2} {r['class']:10} {', '.join(map(str, r['tokens'])):>31} {'same' if b is None else f'token {b}':>19} "
              f"{'same' if c is None else f'token {c}':>17}")  # fmt: skip
    at = [r["batched_differs_at_token"] for r in rows if r["batched_differs_at_token"] is not None]
    ctl = sum(r["again_differs_at_token"] is not None for r in rows)
    summary = f"batched replies that differ from alone: {len(at)} of {len(rows)}"
    if at:
        summary += f"; first difference at token {min(at)} (earliest), {statistics.median(at):.0f} (median)"
    print(f"{summary}; alone-again replies that differ: {ctl} of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
