"""Soak: many chat turns in one process; RSS growth after warm-up and llama_batch leaks; and
many requests through a real `specrun serve`, whose suffix sources must stay under their cap.

    python scripts/tools/soak.py [--tiny-turns 300] [--demo-turns 30] [--serve-requests 1000] [--json]

Tiny models are generated into a temporary folder; the demo pair is read from
${SPECRUN_MODELS_DIR:-~/.cache/specrun/models} (skipped with a note if missing).
Pass: RSS growth after warm-up under 50 MB in each phase, and no llama_batch left
allocated after the models are closed.

The serve phase (``--serve-requests N``, 0 to leave it out) starts `specrun serve` on the tiny
target (127.0.0.1, a free port) with a small ``--suffix-mb``, a corpus of text files and a
suffix cache, and sends N completions through the `openai` client, as 8 tenants (API keys and
users) asking recurring questions; after every request it reads /metrics. Pass: the suffix
sources' held bytes never above the cap, RSS growth after warm-up under 50 MB, and after a
restart on the same cache, what is loaded under the cap too. It prints what each origin (the
tenant's replies, the corpus) drafted and had accepted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models, serve_helpers

from specrun import llama  # noqa: E402
from specrun.decode.costs import CostModel  # noqa: E402
from specrun.decode.engine import Engine, Settings  # noqa: E402
from specrun.decode.sampling import Sampler  # noqa: E402
from specrun.run.chat import ChatSession  # noqa: E402
from specrun.run.config import PairConfig  # noqa: E402
from specrun.run.session import open_pair  # noqa: E402
from specrun.run.stream import stream_generate  # noqa: E402
from specrun.run.template import ChatTemplate  # noqa: E402

MESSAGES = [
    "Write a function that adds two numbers.",
    "Now make it handle lists of numbers too.",
    "こんにちは！元気ですか？",
    "Summarise what we discussed so far.",
    "def hello():\n    return 'hi'\n\nRename hello to greet.",
]
LIMIT_MB = 50


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def phase(name: str, target: Path, draft: Path, turns: int, n_predict: int, ctx: int, warmup: int) -> dict:
    pair = open_pair(target, draft, PairConfig(n_ctx=ctx, threads=2))
    cost = CostModel({1: 0.01, 2: 0.011, 4: 0.012, 8: 0.014, 16: 0.02, 32: 0.03})
    modes = ["hybrid", "model", "ngram", "none"]
    info = pair.target_info
    tmpl = ChatTemplate(info.chat_template, "", info.tokens[info.eos_id] if info.eos_id is not None else "")
    engines = {
        m: Engine(pair.target, pair.draft if m in ("model", "hybrid") else None, Settings(m), Sampler(0.7, seed=1), cost) for m in modes
    }
    chat = ChatSession(engines["hybrid"], tmpl)
    base = None
    samples = []
    generated = 0
    for i in range(turns):
        if i == warmup:
            gc.collect()
            base = rss_mb()
        if i % 4 == 3:  # a stand-alone generation through another engine, as `generate` does
            e = engines[modes[i % len(modes)]]
            toks = pair.target.tokenize(MESSAGES[i % len(MESSAGES)])
            for event in stream_generate(e, toks, n_predict):
                generated += len(event.tokens)
            continue
        if len(chat.engine.target.tokens) > ctx - 4 * n_predict - 200:
            chat.reset()
        for event in chat.send(MESSAGES[i % len(MESSAGES)], n_predict):
            generated += len(event.tokens)
        if i % 25 == 0:
            samples.append(round(rss_mb(), 1))
    gc.collect()
    end = rss_mb()
    live_before_close = llama.live_batches()
    pair.close()
    for e in engines.values():
        e.sources.clear()
    del engines, chat
    gc.collect()
    return {
        "phase": name,
        "turns": turns,
        "tokens_generated": generated,
        "rss_after_warmup_mb": round(base, 1),
        "rss_end_mb": round(end, 1),
        "growth_mb": round(end - base, 1),
        "rss_samples_mb": samples,
        "batches_live_before_close": live_before_close,
        "batches_live_after_close": llama.live_batches(),
        "ok": end - base < LIMIT_MB and llama.live_batches() == 0,
    }


SERVE_MB = 0.25  # --suffix-mb: 1,024 tokens as counted, about 30 replies beside the corpus's half
SERVE_TOKENS = 16
SERVE_WARMUP = 100


def serve_phase(target: Path, requests: int, home: Path) -> dict:
    """``requests`` completions through a real `specrun serve` with a small suffix cap."""
    from openai import OpenAI
    from serve_helpers import Server
    from tiny_models import CORPUS

    cap = int(SERVE_MB * 2**20)
    corpus, cache = home / "corpus", home / "suffix-cache"
    corpus.mkdir(parents=True)
    paragraphs = [p for p in CORPUS.split("\n\n") if p.strip()]
    for i, text in enumerate(paragraphs):  # more than half the cap holds: reading stops, and says so
        (corpus / f"part{i:02}.txt").write_text(text, encoding="utf-8")
    args = ["-m", str(target), "-t", "1", "-c", "512", "--quiet", "--suffix-mb", str(SERVE_MB)]
    args += ["--suffix-corpus", str(corpus), "--suffix-cache", str(cache)]
    env = {"PYTHONPATH": str(ROOT)}  # the server runs this checkout's specrun
    server = Server(args, home, env=env)
    proc = psutil.Process(server.proc.pid)
    held, base, samples, errors = [], None, [], []
    try:
        clients = [OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=f"key-{k}", max_retries=0, timeout=120) for k in range(4)]
        for i in range(requests):
            if i == SERVE_WARMUP:
                base = proc.memory_info().rss / 2**20
            client, user = clients[i % 4], f"user-{i % 8 // 4}"  # 8 tenants
            prompt = f"{MESSAGES[i % len(MESSAGES)]} ({i % 40})"  # each tenant's questions come back
            try:
                r = client.completions.create(model=target.name, prompt=prompt, max_tokens=SERVE_TOKENS, temperature=0, user=user)
                assert r.choices[0].text is not None
            except Exception as e:  # counted, not fatal: the figures say how many
                errors.append(f"{i}: {type(e).__name__}: {e}")
            held.append(server.metrics()["specrun_suffix_bytes"])
            if i % 50 == 0:
                samples.append(round(proc.memory_info().rss / 2**20, 1))
        end = proc.memory_info().rss / 2**20
        m = server.metrics()
    finally:
        rc = server.stop()
    restarted = Server(args, home, env=env)
    try:
        loaded = restarted.metrics()
        loaded_line = next((ln.strip() for ln in restarted.lines if "suffix cache:" in ln), "")
    finally:
        rc_again = restarted.stop()

    def by(name: str, source: str) -> int:
        return int(m.get(f'specrun_{name}_tokens_total{{source="{source}"}}', 0))

    base = base if base is not None else end
    return {
        "phase": "serve",
        "requests": requests,
        "errors": errors[:5],
        "n_errors": len(errors),
        "cap_bytes": cap,
        "held_max_bytes": max(held, default=0),
        "held_end_bytes": held[-1] if held else 0,
        "corpus_bytes": int(m["specrun_suffix_corpus_bytes"]),
        "corpus_files": int(m["specrun_suffix_corpus_files"]),
        "replies_kept": int(m["specrun_suffix_replies"]),
        "evicted": int(m["specrun_suffix_evicted_total"]),
        "drafted": {s: by("draft", s) for s in ("suffix", "corpus", "ngram")},
        "accepted": {s: by("accepted", s) for s in ("suffix", "corpus", "ngram")},
        "tokens_generated": int(m["llamacpp:tokens_predicted_total"]),
        "rss_after_warmup_mb": round(base, 1),
        "rss_end_mb": round(end, 1),
        "growth_mb": round(end - base, 1),
        "rss_samples_mb": samples,
        "restart_loaded_bytes": loaded["specrun_suffix_bytes"],
        "restart_line": loaded_line,
        "exit_codes": [rc, rc_again],
        "ok": not errors and max(held, default=0) <= cap and end - base < LIMIT_MB and loaded["specrun_suffix_bytes"] <= cap
        and loaded["specrun_suffix_replies"] > 0 and rc == rc_again == 143,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny-turns", type=int, default=300)
    ap.add_argument("--demo-turns", type=int, default=30)
    ap.add_argument("--serve-requests", type=int, default=1000, help="requests through specrun serve (0: none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from tiny_models import build_all

    results = []
    with tempfile.TemporaryDirectory() as d:
        tiny = build_all(d)
        if args.tiny_turns:
            results.append(
                phase("tiny", tiny["target"], tiny["draft-perturbed"], args.tiny_turns, 24, 2048, warmup=min(30, args.tiny_turns - 1))
            )
        if args.serve_requests:
            results.append(serve_phase(tiny["target"], args.serve_requests, Path(d) / "serve"))
    models = Path(os.environ.get("SPECRUN_MODELS_DIR") or Path.home() / ".cache/specrun/models")
    t, dr = models / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", models / "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf"
    if args.demo_turns and t.is_file() and dr.is_file():
        results.append(phase("demo", t, dr, args.demo_turns, 24, 2048, warmup=5))
    elif args.demo_turns:
        print("demo models missing: run scripts/fetch-demo-models.sh (demo phase skipped)", file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            if r["phase"] == "serve":
                worth = ", ".join(f"{k} {r['accepted'][k]}/{r['drafted'][k]}" for k in r["drafted"])
                print(
                    f"serve: {r['requests']} requests ({r['n_errors']} failed), {r['tokens_generated']} tokens; suffix bytes at most "
                    f"{r['held_max_bytes']} of {r['cap_bytes']} (corpus {r['corpus_bytes']} in {r['corpus_files']} files; "
                    f"{r['replies_kept']} replies kept, {r['evicted']} evicted); accepted/drafted by source: {worth}; "
                    f"RSS {r['rss_after_warmup_mb']} -> {r['rss_end_mb']} MB (growth {r['growth_mb']:+.1f} MB, limit {LIMIT_MB}); "
                    f"after a restart {int(r['restart_loaded_bytes'])} bytes ({r['restart_line']}); {'OK' if r['ok'] else 'FAIL'}"
                )
                continue
            print(
                f"{r['phase']:>5}: {r['turns']} turns, {r['tokens_generated']} tokens; RSS {r['rss_after_warmup_mb']} -> {r['rss_end_mb']} MB "
                f"(growth {r['growth_mb']:+.1f} MB, limit {LIMIT_MB}); llama_batch live: {r['batches_live_before_close']} open, "
                f"{r['batches_live_after_close']} after close; {'OK' if r['ok'] else 'FAIL'}"
            )
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
