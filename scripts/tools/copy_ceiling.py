"""The most any drafting could make of a prompt whose reply is a copy, in wall-clock time: the
target's own greedy reply, drafted K tokens a round and every one accepted, beside specrun's
default and llama.cpp's n-gram types, alternated.

    python scripts/tools/copy_ceiling.py --bin ~/.cache/specrun/llama.cpp-VERSION/build/bin \\
        --prompts BUGFIX.jsonl [--index 0] [--ks 32,48,63] [--types ngram-map-k4v] [--runs 3] [-t 2]

The reply is decoded once, plainly. Then each K runs in a fresh process, as `specrun generate`
does (load, prompt, then the timed reply): every round verifies the reply's next K tokens and
checks that the target agrees with all of them. No drafter guesses better than the reply itself
and none pays less for a guess, so no method drafting at most K tokens a round is faster than
that row (on this target, threads and batch shape): a speed target above it is out of reach
there. Ratios are to the best llama.cpp type, medians over runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from compare_ngram import MODELS, render, run_llama, run_specrun  # noqa: E402


def copy_run(target: Path, prompt_file: Path, reply_file: Path, k: int, n: int, threads: int) -> dict:
    """In this process: the reply (k = 0, n tokens at most, decoded plainly and written to
    ``reply_file``), or the reply verified k tokens a round. Generation tok/s, timed from the prompt's end as specrun's."""
    from specrun.llama import LoadOptions, Model

    with Model(target, LoadOptions(n_ctx=4096, n_threads=threads, n_outputs_max=64)) as m:
        prompt = m.tokenize(prompt_file.read_text(), add_special=True, parse_special=True)
        logits = m.eval_last(prompt)
        t0 = time.perf_counter()
        if k == 0:
            reply: list[int] = []
            while len(reply) < n:
                reply.append(int(np.argmax(logits)))
                if m.is_eog(reply[-1]):
                    break
                logits = m.eval_last([reply[-1]])
            t = time.perf_counter() - t0
            reply_file.write_text(json.dumps(reply))
            return {"tps": len(reply) / t, "n": len(reply), "rounds": len(reply)}
        reply = json.loads(reply_file.read_text())
        if int(np.argmax(logits)) != reply[0]:
            raise RuntimeError("the target's first token differs from its reply's")
        i, rounds = 0, 0
        while i < len(reply) - 1:
            drafts = reply[i + 1 : i + 1 + k]
            rows = m.eval([reply[i], *drafts], logits="all")
            assert rows is not None
            if [int(x) for x in np.argmax(rows[: len(drafts)], axis=1)] != drafts:
                raise RuntimeError(f"the target did not agree with its own reply at {i}: not deterministic here")
            i, rounds = i + len(drafts) + 1, rounds + 1
        t = time.perf_counter() - t0
        return {"tps": len(reply) / t, "n": len(reply), "rounds": rounds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="llama.cpp's build/bin (with llama-speculative-simple)")
    ap.add_argument("--target", type=Path, default=MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    ap.add_argument("--draft", type=Path, default=MODELS / "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf")
    ap.add_argument("--prompts", type=Path, required=True, help="a JSONL file of prompts ({'prompt': ..., 'n': ...})")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--ks", default="32,48,63", help="draft lengths to verify the reply in")
    ap.add_argument("--types", default="ngram-map-k4v", help="llama.cpp's types beside it")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--one", nargs=4, metavar=("PROMPT_FILE", "REPLY_FILE", "K", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        prompt_file, reply_file, k, n = args.one
        print(json.dumps(copy_run(args.target, Path(prompt_file), Path(reply_file), int(k), int(n), args.threads)))
        return 0

    p = json.loads(args.prompts.read_text().splitlines()[args.index])
    n = int(p.get("n") or 128)
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file, reply_file = Path(tmp) / "prompt.txt", Path(tmp) / "reply.json"
        prompt_file.write_text(render(args.target, p["prompt"]))

        def one(k: int) -> dict:
            cmd = [sys.executable, __file__, "--bin", args.bin, "--target", str(args.target), "-t", str(args.threads)]
            cmd += ["--prompts", str(args.prompts), "--one", str(prompt_file), str(reply_file), str(k), str(n)]
            return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)

        first = one(0)
        print(f"the reply: {first['n']} tokens", flush=True)
        ks = [int(k) for k in args.ks.split(",")]
        modes = ["plain", "specrun", *(f"copy@{k}" for k in ks), *args.types.split(",")]
        tps: dict[str, list[float]] = {m: [] for m in modes}
        for run in range(args.runs):
            for mode in modes[run % len(modes) :] + modes[: run % len(modes)]:
                if mode == "plain":
                    r = run_specrun(args, prompt_file, n, "none")
                elif mode == "specrun":
                    r = run_specrun(args, prompt_file, n, None)
                elif mode.startswith("copy@"):
                    r = one(int(mode[5:]))
                else:
                    r = run_llama(args, prompt_file, n, mode)
                tps[mode].append(r["tps"])
                print(f"run {run + 1} {mode:<14} {r['tps']:6.2f} tok/s  n {r['n']}", flush=True)
    med = {m: statistics.median(v) for m, v in tps.items()}
    best = max(med[t] for t in args.types.split(","))
    print("\n| mode | tok/s (median) | x plain | x best llama.cpp type |\n|---|---|---|---|")
    for m in modes:
        print(f"| {m} | {med[m]:.2f} | {med[m] / med['plain']:.2f}x | {med[m] / best:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
