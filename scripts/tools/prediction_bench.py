"""Predicted Outputs through `specrun serve`, against the same requests without, and llama-server.

    python scripts/tools/prediction_bench.py --bin ~/.cache/specrun/llama.cpp-0.3.36/build/bin -t 2 [--runs 3]

Two requests of the kinds OpenAI's `prediction` is for, each greedy, streamed through the `openai`
client, one server in memory at a time, the setups' order rotated run by run:

* ``edit``: OpenAI's own example, a whole-file edit: the file in the prompt ("rename a field,
  answer with the whole file") and, with a prediction, the file again as the prediction;
* ``regenerate``: a chat front end's "regenerate": a question, then the same question again with
  the first answer as the prediction. The prompt does not hold that text, so only the prediction
  can draft it.

Setups (``--setups``): ``specrun`` (`specrun serve` at its defaults: each request sent without a
prediction and with one), ``plain`` (`llama-server -m T`), ``ngram-mod`` (`--spec-type
ngram-mod`), ``draft-simple`` (`-md D --spec-type draft-simple`), llama-server sent without (it
has no `prediction`). Per setup and request: the median over runs of the completion's tok/s
(the tokens after the first over the time from the first content chunk to the last, as
compare_serve.py counts them: a prompt cached by an earlier request gets no head start), the
usage's accepted and rejected prediction tokens, and whether
the text with a prediction equals the text without. The ratios printed are specrun with a
prediction over: the same request without, llama-server's best setting, and llama-server plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_serve  # noqa: E402

SETUPS = ("specrun", "plain", "ngram-mod", "draft-simple")
LLAMA = ("plain", "ngram-mod", "draft-simple")

FILE = '''"""Accounts of the shop's customers."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass
class User:
    first_name: str
    last_name: str
    username: str
    created: datetime = field(default_factory=datetime.now)
    orders: list[int] = field(default_factory=list)

    def display_name(self) -> str:
        return f"{self.first_name} {self.last_name} ({self.username})"

    def add_order(self, order_id: int) -> None:
        if order_id in self.orders:
            raise ValueError(f"order {order_id} is already on {self.username}'s account")
        self.orders.append(order_id)


class Directory:
    def __init__(self) -> None:
        self.users: dict[str, User] = {}

    def add(self, user: User) -> None:
        if user.username in self.users:
            raise KeyError(f"{user.username} is taken")
        self.users[user.username] = user

    def find(self, username: str) -> User | None:
        return self.users.get(username)

    def remove(self, username: str) -> User:
        return self.users.pop(username)

    def newest(self, n: int = 5) -> list[User]:
        return sorted(self.users.values(), key=lambda u: u.created, reverse=True)[:n]
'''
EDIT = (
    "Replace the username property with an email property, everywhere it is used. Respond only "
    "with the whole file, with no markdown formatting and nothing else.\n\n" + FILE
)
QUESTION = "Explain, in a few short paragraphs, how a hash table handles collisions, and when it resizes."


def stream(port: int, model: str, messages: list[dict], n: int, prediction: str | None) -> dict:
    r = compare_serve.stream_chat(port, model, messages, n, prediction)
    tokens, gen = r["tokens"], r["last"] - r["first"] if r["text"] else 0.0
    return {
        # the first token comes with the first chunk: the rest over the time after it
        "tok_s": (tokens - 1) / gen if tokens > 1 and gen > 0 else 0.0, "ttft_s": r["first"] - r["sent"], "tokens": tokens,
        "text": r["text"], "accepted": r["accepted"], "rejected": r["rejected"],
    }  # fmt: skip


def one_run(setup: str, args, run: int, logs: Path) -> dict[str, dict]:
    port = compare_serve.free_port()
    server = compare_serve.Running(setup, compare_serve.command(setup, args, port), port, logs / f"{setup}.log")
    system = {"role": "system", "content": f"You are a precise coding assistant. (run {run})"}
    edit = [system, {"role": "user", "content": EDIT}]
    ask = [system, {"role": "user", "content": QUESTION}]
    n = args.max_tokens
    try:
        stream(port, server.model, [system, {"role": "user", "content": "Hi."}], 4, None)  # a server's first decodes are slow
        out = {"edit": stream(port, server.model, edit, n, None)}
        first = stream(port, server.model, ask, n, None)  # the answer a user asks to regenerate
        out["regenerate"] = stream(port, server.model, ask, n, None)
        if setup == "specrun":
            out["edit+prediction"] = stream(port, server.model, edit, n, FILE)
            out["regenerate+prediction"] = stream(port, server.model, ask, n, first["text"])
        return out
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    compare_serve.server_args(ap, parallel=1)
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", "--max-tokens", type=int, default=512)
    ap.add_argument("--json", type=Path, help="also write every sample here")
    args = ap.parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    if any(s not in SETUPS for s in setups):
        raise SystemExit(f"error: --setups takes {', '.join(SETUPS)}")
    if any(s in LLAMA for s in setups) and not args.bin:
        raise SystemExit("error: llama-server setups need --bin (llama.cpp's build/bin)")
    samples: dict[str, list[dict[str, dict]]] = {s: [] for s in setups}
    with tempfile.TemporaryDirectory(prefix="specrun-prediction-") as tmp:
        for run in range(args.runs):
            for setup in setups[run % len(setups) :] + setups[: run % len(setups)]:
                got = one_run(setup, args, run, Path(tmp))
                samples[setup].append(got)
                print(f"run {run} {setup:12} " + "  ".join(f"{k} {v['tok_s']:.2f} tok/s" for k, v in got.items()), flush=True)
    med = {s: {k: statistics.median(r[k]["tok_s"] for r in samples[s]) for k in samples[s][0]} for s in setups}
    print(f"\n{'setup':12} {'request':22} {'tok/s':>7}  prediction accepted/rejected, text as without")
    for s in setups:
        for k, v in med[s].items():
            last = samples[s][-1]
            extra = ""
            if k.endswith("+prediction"):
                base = k.split("+")[0]
                same = all(r[k]["text"] == r[base]["text"] for r in samples[s])
                extra = f"  {last[k]['accepted']}/{last[k]['rejected']}, {'same' if same else 'DIFFERENT'}"
            print(f"{s:12} {k:22} {v:>7.2f}{extra}")
    if "specrun" in med:
        for req in ("edit", "regenerate"):
            mine = med["specrun"][f"{req}+prediction"]
            line = [f"{req}: specrun with the prediction / without {mine / med['specrun'][req]:.2f}x"]
            llama = {s: med[s][req] for s in setups if s in LLAMA}
            if llama:
                best = max(llama, key=lambda s: llama[s])
                line.append(f"/ llama-server's best ({best}) {mine / llama[best]:.2f}x")
            if "plain" in llama:
                line.append(f"/ llama-server plain {mine / llama['plain']:.2f}x")
            print("; ".join(line))
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
