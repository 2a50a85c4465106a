"""Local against a loopback RPC worker, in one run: tok/s plain and speculative, and the network's
share of each verify.

    python scripts/tools/rpc_bench.py [--target qwen-1.5b] [--draft qwen-0.5b] [-t 2] [--runs 2] [-n 128] [--json]

Starts `specrun worker` on 127.0.0.1 (a free port, the same thread count), opens the pair twice
in this process (wholly on this CPU, and with the target on the worker and the draft here), and
runs each prompt in each mode on both, interleaved (local, worker, local, worker...), so that the
ratios come from the same minutes of the same machine. Then measures the verify curve through the
worker and here alone (specrun.network). The worker computes while this process waits, so the
two never compete for the cores.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from specrun.bench.network import measure
from specrun.bench.runner import load_prompts
from specrun.decode.costs import CostStore
from specrun.decode.engine import Settings
from specrun.decode.sampling import Sampler
from specrun.fit import rpc
from specrun.models.registry import Registry
from specrun.run.config import PairConfig
from specrun.run.prompt import chat_prompt
from specrun.run.session import open_engine, open_pair
from specrun.run.stream import stream_generate

SPECRUN = Path(sys.executable).parent / "specrun"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen-1.5b")
    ap.add_argument("--draft", default="qwen-0.5b")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    reg = Registry.load(None)
    target, draft = reg.resolve(a.target).path, reg.resolve(a.draft).path
    picked: dict[str, object] = {}
    for p in load_prompts():
        picked.setdefault(p.cls, p)
    prompts = list(picked.values())[:3]

    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    worker = subprocess.Popen(
        [str(SPECRUN), "worker", "--port", str(port), "-t", str(a.threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        rpc.wait_for(endpoint, timeout=60)
        cfgs = {
            "local": PairConfig(a.ctx, threads=a.threads, devices=(), devices_draft=()),
            "rpc": PairConfig(a.ctx, threads=a.threads, rpc=(endpoint,)),
        }
        pairs = {k: open_pair(target, draft, cfg) for k, cfg in cfgs.items()}
        for k, pair in pairs.items():
            print(f"{k}: {'; '.join(pair.notices)}", file=sys.stderr)
        store = CostStore(Path(tempfile.mkdtemp()) / "costs.json")
        sampler = Sampler(0.0)
        modes = {"plain": Settings("none"), "speculative": Settings("hybrid")}
        engines = {(k, m): open_engine(pairs[k], s, sampler, store) for k in pairs for m, s in modes.items()}
        tokens = [chat_prompt(pairs["local"], [{"role": "user", "content": p.prompt}]) for p in prompts]  # type: ignore[attr-defined]
        tps: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
        outputs: dict[tuple[str, str, int], list[int]] = {}
        for run in range(-1, a.runs):  # run -1 warms up and is not counted
            for i, toks in enumerate(tokens):
                for m in modes:
                    for k in pairs:
                        e = engines[(k, m)]
                        e.reset()
                        out: list[int] = []
                        stats = None
                        for ev in stream_generate(e, toks, a.n if run >= 0 else 16):
                            out.extend(ev.tokens)
                            stats = ev.stats
                        if run >= 0 and stats is not None:
                            tps[(k, m)].append(stats.generation_tps)
                            outputs[(k, m, i)] = out
                            print(f"run {run} prompt {i} {m:<11} {k:<5} {stats.generation_tps:6.1f} tok/s", file=sys.stderr)
        same = all(outputs[("local", m, i)] == outputs[("rpc", m, i)] for m in modes for i in range(len(tokens)))
        net = measure(pairs["rpc"], cfgs["rpc"]).to_json()
        for pair in pairs.values():
            pair.close()
    finally:
        worker.terminate()
        worker.wait(10)

    rows = []
    for m in modes:
        loc, rem = geomean(tps[("local", m)]), geomean(tps[("rpc", m)])
        ratios = [rem_tps / loc_tps for loc_tps, rem_tps in zip(tps[("local", m)], tps[("rpc", m)])]
        rows.append(
            {"mode": m, "local_tps": loc, "rpc_tps": rem, "ratio": geomean(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        )
    result = {
        "target": a.target,
        "draft": a.draft,
        "threads": a.threads,
        "runs": a.runs,
        "n": a.n,
        "same_tokens": same,
        "modes": rows,
        "network": net,
    }
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"Target {a.target}, draft {a.draft}, -t {a.threads}, -n {a.n}, {a.runs} runs x {len(tokens)} prompts, interleaved; same tokens: {same}\n"
    )
    print("| mode | local tok/s | through the worker tok/s | worker / local (min..max) |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['local_tps']:.1f} | {r['rpc_tps']:.1f} | {r['ratio']:.2f}x ({r['ratio_min']:.2f}..{r['ratio_max']:.2f}) |"
        )
    rtt = f", round trip {net['rtt_ms']:.3f} ms" if net["rtt_ms"] is not None else ""
    print(f"\nVerify through the worker{rtt} ({net['note']}):\n")
    print("| verify batch | through the worker | here alone | network share | sent / received per verify |")
    print("|---|---|---|---|---|")
    for v in net["verify"]:
        share = "-" if v["network_share"] is None else f"{100 * v['network_share']:.0f}%"
        local = "-" if v["local_ms"] is None else f"{v['local_ms']:.1f} ms"
        moved = "-" if v["bytes_sent"] is None else f"{v['bytes_sent'] / 1024:.0f} KiB / {v['bytes_received'] / 1024:.0f} KiB"
        print(f"| {v['batch']} | {v['split_ms']:.1f} ms | {local} | {share} | {moved} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
