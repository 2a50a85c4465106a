"""Issue 58's healing check, through the real CLI: a verify curve stored 8x too dear heals.

    python scripts/tools/healing_cli.py [-t 2] [--reps 3] [--prompt 1]

With the demo pair (Q4_K_M target) and private stores, on a 400-token whole-file edit of the
held-out set (scripts/tools/heldout_prompts.jsonl; --prompt picks which, 1 = the type hints):

1. a clean store: one `specrun generate` calibrates it and stores what it learned;
2. a poisoned store: a copy with every stored verify size >= 6 at 8x its value (as a
   calibration taken on a busy machine would leave it);
3. one run on the poisoned store: the longest draft it made (healed within the run if >= 6);
4. then, alternated (--reps), the next runs on the poisoned store and on the clean one: the
   ratio of their median tok/s (the issue asks >= 0.95).

Each step is a `specrun generate --json` process, as a user runs it. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = Path(os.environ.get("SPECRUN_MODELS_DIR") or Path.home() / ".cache/specrun/models")


def generate(home: Path, prompt: Path, threads: int, n: int) -> dict:
    """One `specrun generate --json` with ``home`` as its store; its stats."""
    cmd = [
        str(Path(sys.executable).parent / "specrun"), "generate", "-m", str(MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        "-d", str(MODELS / "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf"), "--prompt-file", str(prompt), "--chat",
        "-n", str(n), "-t", str(threads), "--json",
    ]  # fmt: skip
    out = subprocess.run(cmd, env={**os.environ, "SPECRUN_CACHE_DIR": str(home)}, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"specrun generate failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)["stats"]


def poison(home: Path) -> None:
    """Every stored verify size >= 6 at 8x its value, in every entry of ``home``'s store."""
    path = home / "costs.json"
    data = json.loads(path.read_text())
    entries = data.get("entries", data)
    for entry in entries.values():
        verify = entry["cost"]["verify"]
        entry["cost"]["verify"] = {b: v * 8 if int(b) >= 6 else v for b, v in verify.items()}
    path.write_text(json.dumps(data))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=1, help="which code-edit prompt of the held-out set (0-3)")
    args = ap.parse_args()
    edits = [json.loads(line) for line in (REPO / "scripts/tools/heldout_prompts.jsonl").read_text().splitlines() if line.strip()]
    p = [e for e in edits if e["class"] == "code-edit"][args.prompt]
    with tempfile.TemporaryDirectory() as tmp:
        prompt, clean, sick = Path(tmp) / "prompt.txt", Path(tmp) / "clean", Path(tmp) / "sick"
        prompt.write_text(p["prompt"])
        clean.mkdir()
        first = generate(clean, prompt, args.threads, p["n"])  # calibrates, stores
        shutil.copytree(clean, sick)
        poison(sick)
        healing = generate(sick, prompt, args.threads, p["n"])
        print(f"clean store's first run: {first['generation_tps']:.1f} tok/s, longest draft {max(first['draft_lengths'], default=0)}")
        print(
            f"poisoned store's run: {healing['generation_tps']:.1f} tok/s, longest draft {max(healing['draft_lengths'], default=0)} "
            f"({sum(1 for k in healing['draft_lengths'] if k >= 6)} rounds drafted >= 6)"
        )
        after, fresh = [], []
        for _ in range(args.reps):
            after.append(generate(sick, prompt, args.threads, p["n"])["generation_tps"])
            fresh.append(generate(clean, prompt, args.threads, p["n"])["generation_tps"])
        a, f = statistics.median(after), statistics.median(fresh)
        print(f"next runs, poisoned store: {a:.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in after)})")
        print(f"next runs, clean store:    {f:.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in fresh)})")
        print(f"poisoned / clean: {a / f:.3f}x")
        c, k = (json.loads((h / "costs.json").read_text()) for h in (clean, sick))
        for key, entry in k.get("entries", k).items():
            mine, theirs = entry["cost"]["verify"], c.get("entries", c)[key]["cost"]["verify"]
            print("stored c(b), poisoned store / clean store: " + ", ".join(f"{b}: {mine[b] / theirs[b]:.2f}" for b in mine if b in theirs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
