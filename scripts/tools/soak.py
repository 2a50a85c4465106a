"""Soak: many chat turns in one process; RSS growth after warm-up and llama_batch leaks.

    python scripts/tools/soak.py [--tiny-turns 300] [--demo-turns 30] [--json]

Tiny models are generated into a temporary folder; the demo pair is read from
${SPECRUN_MODELS_DIR:-~/.cache/specrun/models} (skipped with a note if missing).
Pass: RSS growth after warm-up under 50 MB in each phase, and no llama_batch left
allocated after the models are closed.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # tiny_models

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny-turns", type=int, default=300)
    ap.add_argument("--demo-turns", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from tiny_models import build_all

    results = []
    with tempfile.TemporaryDirectory() as d:
        tiny = build_all(d)
        results.append(phase("tiny", tiny["target"], tiny["draft-perturbed"], args.tiny_turns, 24, 2048, warmup=30))
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
            print(
                f"{r['phase']:>5}: {r['turns']} turns, {r['tokens_generated']} tokens; RSS {r['rss_after_warmup_mb']} -> {r['rss_end_mb']} MB "
                f"(growth {r['growth_mb']:+.1f} MB, limit {LIMIT_MB}); llama_batch live: {r['batches_live_before_close']} open, "
                f"{r['batches_live_after_close']} after close; {'OK' if r['ok'] else 'FAIL'}"
            )
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
