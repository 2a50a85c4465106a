"""specrun's default mode against llama.cpp's own speculative decoding (its n-gram types, or its
draft model at several draft lengths), on the bench's prompts, alternated, as ratios to plain
decoding of the same prompt.

    python scripts/tools/compare_ngram.py --bin ~/.cache/specrun/llama.cpp-VERSION/build/bin \\
        [--classes code-edit,summarise] [--runs 3] [-t 2] [--types ngram-simple,...] [--json out.json]
    python scripts/tools/compare_ngram.py --bin ... --target F16.gguf --classes code-gen,explain \\
        --types draft-simple,draft-simple@4,draft-simple@8,draft-simple@16 --specrun-modes model

A type ``T@N`` is llama.cpp's type T with ``--spec-draft-n-max N``; ``--specrun-modes model``
adds ``specrun generate --draft model`` (as ``specrun:model``), and ``MODE@N`` adds
``--draft-max N`` to it. ``--base DIR`` adds ``specrun:base``, the default run from another
checkout of specrun (``git worktree add DIR COMMIT``) with a copy of the stored costs as they were
at the start, so a change is measured against the code before it, alternated, in the same run
(``--base-modes model`` adds ``specrun:base:model``, its ``--draft model``, and so on).
``--variant NAME=DIR`` (repeatable) adds ``specrun@NAME``, another checkout's default, each
printed over this checkout's: several one-rule changes judged in one alternated session.
Each checkout learns into its own store from run to run, so over a few runs the two can drift
apart on what they learned alone; ``--same-start`` starts every specrun run from the store as it
was at the start instead (as one process of a user's would, every time).
Run it through
`scripts/compare-llama-cpp.sh --ngram` or `--draft-model`, which build llama.cpp's tools from the
installed llama-cpp-python's sdist first. Each (run, prompt) runs every mode once, in a rotating
order, so a noisy machine affects them alike: plain decoding (`specrun generate --draft none`),
specrun's default (`specrun generate`, hybrid, adaptive), and `llama-speculative-simple
--spec-type T` for each n-gram type T with its defaults. Prompts go through the model's own
chat template (rendered once, fed to both tools as the same text). Speeds are each tool's own
generation tok/s; the table gives, per class and mode, the geometric mean over prompts of the
median over runs of tok/s divided by plain tok/s, with the range over prompts.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from specrun.bench.llamacpp import NGRAM_SETTINGS, LlamaCpp, write_prompt
from specrun.bench.runner import load_prompts
from specrun.gguf.facts import model_info
from specrun.run.session import cost_store
from specrun.run.template import ChatTemplate, render_chat

MODELS = Path(os.environ.get("SPECRUN_MODELS_DIR") or Path.home() / ".cache/specrun/models")
TYPES = NGRAM_SETTINGS
SPECRUN = Path(sys.executable).parent / "specrun"


def render(target: Path, prompt: str) -> str:
    info = model_info(target)
    tok = info.tokens

    def text(i: int | None) -> str:
        return tok[i] if i is not None and 0 <= i < len(tok) else ""

    return render_chat(ChatTemplate(info.chat_template, text(info.bos_id), text(info.eos_id)), [{"role": "user", "content": prompt}])


def specrun_cmd(args, prompt_file: Path, n: int, mode: str | None) -> list[str]:
    """`specrun generate` on a rendered prompt file, with JSON out (``mode`` None: the default)."""
    cmd = [str(SPECRUN), "generate", "-m", str(args.target), "-d", str(args.draft), "-t", str(args.threads)]
    cmd += ["--prompt-file", str(prompt_file), "-n", str(n), "--json"]
    if not mode:
        return cmd
    mode, _, n_max = mode.partition("@")
    return cmd + ["--draft", mode] + (["--draft-max", n_max] if n_max else [])


def run_specrun(args, prompt_file: Path, n: int, mode: str | None, env: dict[str, str] | None = None) -> dict:
    cmd = specrun_cmd(args, prompt_file, n, mode)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr[-500:]}")
    s = json.loads(p.stdout)["stats"]
    return {"tps": s["generation_tps"], "n": s["n_generated"], "drafted": s["n_drafted"], "accepted": s["n_accepted"]}


def run_llama(args, prompt_file: Path, n: int, spec_type: str) -> dict:
    """`llama-speculative-simple` (specrun's own runner of it, as `specrun bench --llama-cpp`
    uses) with one type, greedy: at its defaults, or with ``--spec-draft-n-max N`` for ``TYPE@N``."""
    s = LlamaCpp(Path(args.bin), args.target, args.draft, args.threads, 4096).run(spec_type, prompt_file, n)
    return {"tps": s.generation_tps, "n": s.n_generated, "drafted": s.n_drafted, "accepted": s.n_accepted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="llama.cpp's build/bin (with llama-speculative-simple)")
    ap.add_argument("--target", type=Path, default=MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    ap.add_argument("--draft", type=Path, default=MODELS / "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf")
    ap.add_argument("--classes", default="code-edit,summarise")
    ap.add_argument(
        "--prompts", type=Path, help="a JSONL file of prompts instead of the bench's (e.g. scripts/tools/heldout_prompts.jsonl)"
    )
    ap.add_argument("--types", default=",".join(TYPES), help="llama.cpp's types, TYPE or TYPE@N-MAX")
    ap.add_argument(
        "--specrun-modes",
        default="",
        help="more specrun --draft modes to run beside the default, e.g. model; MODE@N adds --draft-max N (hybrid@63)",
    )
    ap.add_argument("--base", type=Path, help="another checkout of specrun, run at its default as specrun:base")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another checkout run at its default as specrun@NAME (repeatable): several changes, each against this "
        "checkout, alternated in one session",
    )
    ap.add_argument("--base-modes", default="", help="more --draft modes to run from --base, as specrun:base:MODE (as --specrun-modes)")
    ap.add_argument(
        "--same-start",
        action="store_true",
        help="every specrun run starts from the stored costs as they were at the start (nothing one run learns reaches "
        "the next, in either checkout): a change measured on its choices alone, the user's store untouched",
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts of each class")
    ap.add_argument("--json", type=Path, help="also write every sample here")
    ap.add_argument("--lock", type=Path, help="hold this lock file (flock) while each prompt's modes run, so other jobs wait")
    ap.add_argument("--first-run", type=int, default=0, help="number the runs from here (to add runs to an earlier log)")
    ap.add_argument("--from-log", type=Path, nargs="+", help="print the table from the sample lines of earlier logs, run nothing")
    args = ap.parse_args()
    classes = args.classes.split(",")
    prompts = [p for p in load_prompts(args.prompts) if p.cls in classes]
    if args.limit:
        prompts = [p for c in classes for p in [q for q in prompts if q.cls == c][: args.limit]]
    modes = ["plain", "specrun"] + [f"specrun:{m}" for m in args.specrun_modes.split(",") if m] + [t for t in args.types.split(",") if t]
    modes += ["specrun:base"] + [f"specrun:base:{m}" for m in args.base_modes.split(",") if m] if args.base else []
    variants = dict(v.split("=", 1) for v in args.variant)
    modes += [f"specrun@{name}" for name in variants]
    samples: list[dict] = []
    if args.from_log:
        for log in args.from_log:
            for line in log.read_text().splitlines():
                m = SAMPLE.match(line)
                if m:
                    drafted, accepted = (None if x == "None" else int(x) for x in (m["drafted"], m["accepted"]))
                    samples.append(
                        {
                            "cls": m["cls"],
                            "prompt": int(m["prompt"]),
                            "run": int(m["run"]) - 1,
                            "mode": m["mode"],
                            "tps": float(m["tps"]),
                            "n": int(m["n"]),
                            "drafted": drafted,
                            "accepted": accepted,
                        }
                    )
        table(samples, classes, prompts, modes)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        snapshot = Path(tmp) / "snapshot"  # the stored costs as they were at the start
        snapshot.mkdir()
        store = cost_store().path
        if store is not None and store.exists():
            shutil.copy(store, snapshot / store.name)

        def env(mode: str) -> dict[str, str] | None:
            """A specrun run's environment: None (the user's own store) but for the base checkout,
            which runs first on the path with its own copy of the store, and with --same-start,
            where every run gets a fresh copy of the snapshot."""
            checkout = str(args.base.resolve()) if mode.startswith("specrun:base") else None
            if mode.startswith("specrun@"):  # (llama.cpp's TYPE@N and specrun's MODE@N are no variants)
                checkout = variants[mode.removeprefix("specrun@")]
            if checkout is None and not args.same_start:
                return None
            home = Path(tmp) / mode.replace(":", "-")
            if args.same_start or not home.exists():
                shutil.rmtree(home, ignore_errors=True)
                shutil.copytree(snapshot, home)
            e = {**os.environ, "SPECRUN_CACHE_DIR": str(home)}
            if checkout is not None:
                e["PYTHONPATH"] = os.pathsep.join(x for x in (checkout, os.environ.get("PYTHONPATH")) if x)
            return e

        files = []  # (specrun's prompt file, llama.cpp's: the same text, read alike)
        for i, p in enumerate(prompts):
            text = render(args.target, p.prompt) if p.chat else p.prompt
            f = Path(tmp) / f"prompt{i}.txt"
            f.write_text(text, encoding="utf-8")
            files.append((f, write_prompt(Path(tmp) / f"prompt{i}-llama.txt", text)))
        for run in range(args.first_run, args.first_run + args.runs):
            for i, (p, (f, f_llama)) in enumerate(zip(prompts, files)):
                order = modes[(run + i) % len(modes) :] + modes[: (run + i) % len(modes)]  # rotate: no mode always first
                lock = open(args.lock, "a") if args.lock else None  # noqa: SIM115 - held for the loop below
                if lock is not None:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                for mode in order:
                    n = p.n_predict or 128
                    if mode == "plain":
                        r = run_specrun(args, f, n, "none", env(mode))
                    elif mode in ("specrun", "specrun:base") or mode.startswith("specrun@"):
                        r = run_specrun(args, f, n, None, env(mode))
                    elif mode.startswith("specrun:"):
                        r = run_specrun(args, f, n, mode.removeprefix("specrun:").removeprefix("base:"), env(mode))
                    else:
                        r = run_llama(args, f_llama, n, mode)
                    samples.append({"cls": p.cls, "prompt": i, "run": run, "mode": mode, **r})
                    print(
                        f"run {run + 1} {p.cls:<10} #{i} {mode:<14} {r['tps']:6.2f} tok/s  n {r['n']}  drafted {r['drafted']} accepted {r['accepted']}",
                        flush=True,
                    )
                if lock is not None:
                    lock.close()  # releases the lock
    if args.json:
        args.json.write_text(json.dumps(samples, indent=1))
    table(samples, classes, prompts, modes)
    return 0


SAMPLE = re.compile(
    r"run (?P<run>\d+) (?P<cls>\S+)\s+#(?P<prompt>\d+) (?P<mode>\S+)\s+(?P<tps>[\d.]+) tok/s\s+n (?P<n>\d+)\s+drafted (?P<drafted>\w+) accepted (?P<accepted>\w+)"
)


def table(samples: list[dict], classes: list[str], prompts: list, modes: list[str]) -> None:
    runs = len({s["run"] for s in samples})
    print(f"\n{runs} run(s); per prompt the median over runs, per class the geometric mean over prompts\n")
    print("| class | mode | speedup vs plain (geomean of per-prompt medians) | range over prompts | acceptance |")
    print("|---|---|---|---|---|")
    best: dict[str, dict[str, float]] = {}
    for c in classes:
        for mode in modes[1:]:
            ratios, drafted, accepted = [], 0, 0
            for i, p in enumerate(prompts):
                mine = [s for s in samples if s["prompt"] == i and s["mode"] == mode]
                plain = [s["tps"] for s in samples if s["prompt"] == i and s["mode"] == "plain"]
                if p.cls != c or not mine or not plain:
                    continue
                ratios.append(statistics.median(s["tps"] for s in mine) / statistics.median(plain))
                drafted += sum(s["drafted"] or 0 for s in mine)
                accepted += sum(s["accepted"] or 0 for s in mine)
            acc = f"{100 * accepted / drafted:.0f}%" if drafted else "-"
            if ratios:
                g = statistics.geometric_mean(ratios)
                best.setdefault(c, {})[mode] = g
                print(f"| {c} | {mode} | {g:.2f}x | {min(ratios):.2f}-{max(ratios):.2f} | {acc} |")
    print("\n| class | specrun mode | / best llama.cpp setting | which |")
    print("|---|---|---|---|")
    for c, by_mode in best.items():
        theirs = {m: g for m, g in by_mode.items() if not m.startswith("specrun")}
        if not theirs:
            continue
        top = max(theirs, key=lambda m: theirs[m])
        for m, g in by_mode.items():
            if m.startswith("specrun"):
                print(f"| {c} | {m} | {g / theirs[top]:.2f}x | {top} |")
    ab_table(best)


def ab_table(best: dict[str, dict[str, float]]) -> None:
    """The A/B: per class, the default over the base checkout's default and over the best of
    specrun's modes run alone (plain included, as 1.00x), with the geometric mean over classes."""
    rows = []
    for c, by_mode in best.items():
        alone = {m: g for m, g in by_mode.items() if m.startswith("specrun:") and not m.startswith("specrun:base")}
        alone["none"] = 1.0
        top = max(alone, key=lambda m: alone[m])
        base = by_mode.get("specrun:base")
        rows.append((c, by_mode.get("specrun"), base, alone[top], top))
    if not rows or all(r[1] is None for r in rows):
        return
    print("\n| class | default x plain | / base | / best mode alone | which |")
    print("|---|---|---|---|---|")
    for c, mine, base, top, which in rows:
        if mine is None:
            continue
        vs_base = f"{mine / base:.2f}x" if base else "-"
        print(f"| {c} | {mine:.2f}x | {vs_base} | {mine / top:.2f}x | {which.removeprefix('specrun:')} |")
    vs_base = [r[1] / r[2] for r in rows if r[1] and r[2]]
    vs_top = [r[1] / r[3] for r in rows if r[1]]
    if vs_base:
        print(f"| geomean | | {statistics.geometric_mean(vs_base):.3f}x | {statistics.geometric_mean(vs_top):.3f}x | |")
    variants = sorted({m for by_mode in best.values() for m in by_mode if m.startswith("specrun@")})
    if not variants:
        return
    print("\n| class | " + " | ".join(f"{v.removeprefix('specrun@')} / default" for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for c, mine, *_ in rows:
        if mine:
            print(f"| {c} | " + " | ".join(f"{best[c][v] / mine:.2f}x" if v in best[c] else "-" for v in variants) + " |")
    means = [[best[c][v] / mine for c, mine, *_ in rows if mine and v in best[c]] for v in variants]
    print("| geomean | " + " | ".join(f"{statistics.geometric_mean(m):.3f}x" if m else "-" for m in means) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
