"""`specrun bench`: plain decoding against each mode, on the same prompts, in one process."""

from __future__ import annotations

import dataclasses
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from specrun.bench.llamacpp import PREFIX, LlamaCpp, find_bin, parse_settings, write_prompt
from specrun.bench.runner import BASELINE, BenchResult, load_prompts, parse_mode, run_bench
from specrun.cli.common import load_pair, load_registry, print_json, stderr, stdout
from specrun.cli.display import NETWORK_COLUMNS, network_rows, network_table, network_title
from specrun.cli.options import LOADING, Options, shared
from specrun.decode.costs import CostModel
from specrun.decode.learned import Learned
from specrun.decode.sampling import Sampler
from specrun.errors import UsageError
from specrun.run.prompt import chat_prompt, chat_text
from specrun.run.session import cost_store, load_costs, resolve_pair


def register(app: typer.Typer) -> None:
    @app.command("bench")
    @shared(LOADING, exclude=("mode",))
    def bench(
        opts: Options,
        prompts: Annotated[
            Optional[Path],
            typer.Option(
                "--prompts", help='A JSONL file of {"class", "prompt", "chat"?, "n"?} (default: the built-in set).', show_default=False
            ),
        ] = None,
        runs: Annotated[int, typer.Option("--runs", help="Measured runs of every prompt and mode (interleaved).", min=1, max=100)] = 2,
        modes: Annotated[
            str,
            typer.Option(
                "--draft",
                help="Comma-separated modes to compare with plain decoding: none, model, ngram, mtp, eagle3, dflash, hybrid; MODE:K runs MODE with exactly K drafts every round (fixed, p-min 0; e.g. model:4).",
            ),
        ] = "model,ngram,hybrid",
        classes: Annotated[
            Optional[str], typer.Option("--classes", help="Only these prompt classes (comma-separated).", show_default=False)
        ] = None,
        n_predict: Annotated[
            int, typer.Option("-n", "--n-predict", help='Most tokens per prompt (a prompt\'s own "n" wins).', min=1)
        ] = 128,
        json_out: Annotated[bool, typer.Option("--json", help="Print the results as one JSON object.")] = False,
        markdown: Annotated[bool, typer.Option("--markdown", help="Print the results as Markdown tables.")] = False,
        recalibrate: Annotated[
            bool, typer.Option("--recalibrate", help="Measure the verify curve afresh instead of starting from the stored one.")
        ] = False,
        limit: Annotated[
            Optional[int], typer.Option("--limit", help="Only the first N prompts of each class.", min=1, show_default=False)
        ] = None,
        llama_cpp: Annotated[
            bool,
            typer.Option(
                "--llama-cpp",
                help="Also run llama.cpp's own speculative decoding (llama-speculative-simple) on the same files and prompts, "
                "taking its turn among the modes, and rate each mode against its best setting per class.",
            ),
        ] = False,
        llama_cpp_settings: Annotated[
            Optional[str],
            typer.Option(
                "--llama-cpp-settings",
                help="llama.cpp's settings for --llama-cpp, comma-separated: TYPE (its defaults), TYPE@N (n-max N) or TYPE@N/P (and p-min P). "
                "Default: draft-simple at its defaults and @4, @8, @16 with a draft model; every n-gram type without.",
                show_default=False,
            ),
        ] = None,
        llama_cpp_bin: Annotated[
            Optional[Path],
            typer.Option(
                "--llama-cpp-bin",
                help="llama.cpp's build/bin for --llama-cpp (default: $SPECRUN_LLAMA_CPP_BIN, else the build "
                "scripts/compare-llama-cpp.sh --build-only makes, else PATH).",
                show_default=False,
            ),
        ] = None,
    ) -> int:
        """Is speculation worth it for this pair on this machine? Runs plain decoding and each
        mode on the same prompts (greedy), interleaved after a warm-up, and prints tokens/s
        with spread, speedup over plain, acceptance, the measured cost model, the speedup it
        predicts next to the one measured, and a verdict."""
        if json_out and markdown:
            raise UsageError("--json and --markdown exclude each other", "pick one")
        wanted = list(dict.fromkeys(m.strip() for m in modes.split(",") if m.strip()))
        if not wanted:
            raise UsageError("{mode} takes a list of modes, got nothing", "e.g. model,ngram", "mode")
        draft_of = {m: parse_mode(m)[0] for m in wanted}  # also checks every spec
        plist = load_prompts(prompts)
        if classes:
            keep = {c.strip() for c in classes.split(",")}
            plist = [p for p in plist if p.cls in keep]
            if not plist:
                raise UsageError(f"no prompts of class {classes!r}", "see the class names in the prompts file")
        if limit:
            plist = [p for c in dict.fromkeys(p.cls for p in plist) for p in [q for q in plist if q.cls == c][:limit]]
        if not llama_cpp and (llama_cpp_settings or llama_cpp_bin):
            raise UsageError("--llama-cpp-settings and --llama-cpp-bin go with --llama-cpp", "add --llama-cpp")
        from specrun import llama

        network: dict = {}
        # one load serves every mode: that mode's, or hybrid's (all at hand) for several; the
        # other modes' own checks (a draft of their kind, the heads mtp drafts with) run first,
        # from the headers, as the load runs the one it is for
        kinds = set(draft_of.values()) - {"none", "ngram"}
        need = next(iter(kinds)) if len(kinds) == 1 else "hybrid" if kinds else "none"
        others = sorted(kinds - {need})
        if others:
            registry = load_registry(opts.registry)
            for kind in others:
                resolve_pair(registry, opts.model, opts.draft_model, dataclasses.replace(opts.settings, mode=kind))
        err = stderr()
        tool = None
        if llama_cpp:  # before the load: a missing tool or a bad setting is said at once
            tool = find_bin(llama_cpp_bin)
            parse_settings(llama_cpp_settings, has_draft=True, pair_known=False)
        pair = load_pair(opts, err, dataclasses.replace(opts.settings, mode=need))
        target_label, draft_label = pair.labels
        if pair.settings_for(dataclasses.replace(opts.settings, mode="hybrid")).mode != "hybrid":  # hybrid would be ngram here
            wanted = [m for m in wanted if draft_of[m] != "hybrid"] or ["ngram"]
        outside = {}
        prompt_dir = None  # llama.cpp's prompt files, only where it runs
        try:
            if tool is not None:
                prompt_dir = tempfile.TemporaryDirectory(prefix="specrun-bench-")
                block = pair.dflash.kind if pair.dflash is not None else None  # its file is the draft llama.cpp loads
                drafter = pair.dflash.path if pair.dflash is not None else pair.draft_info.path if pair.draft_info else None
                runner = LlamaCpp(tool, pair.target_info.path, drafter, opts.pair.threads, opts.pair.n_ctx, opts.pair.gpu_layers)
                files = [
                    write_prompt(
                        Path(prompt_dir.name) / f"prompt{i}.txt",
                        chat_text(pair, [{"role": "user", "content": p.prompt}]) if p.chat else p.prompt,
                    )
                    for i, p in enumerate(plist)
                ]
                for setting in parse_settings(llama_cpp_settings, drafter is not None, block):
                    outside[PREFIX + setting] = lambda i, n, setting=setting: runner.run(setting, files[i], n)

            def tokenize(p):
                if p.chat:
                    return chat_prompt(pair, [{"role": "user", "content": p.prompt}], lambda m: err.print(f"specrun: warning: {m}"))
                return pair.target.tokenize(p.prompt, add_special=True, parse_special=True)

            store = cost_store()
            cost = CostModel() if recalibrate else load_costs(store, pair.cost_key)

            def progress(s):
                err.print(
                    f"  {s.cls:<12} #{s.prompt_index} run {s.run + 1} {s.mode:<7} {s.stats.generation_tps:6.1f} tok/s  accept {100 * s.stats.acceptance_rate:3.0f}%",
                    style="dim",
                )

            result = run_bench(
                pair.target, pair.draft, plist, wanted, Sampler(0.0), opts.settings, tokenize, n_predict, runs, cost, progress,
                heads=pair.heads, eagle3=pair.eagle3, dflash=pair.dflash, outside=outside,
            )  # fmt: skip
            if cost.measured.get("disturbed"):
                err.print(
                    f"specrun: the machine was busy while measuring ({cost.measured['disturbed']}): the curve is not stored", style="yellow"
                )
            store.save(pair.cost_key, Learned(cost))
            if pair.workers:
                from specrun.bench.network import measure

                err.print(
                    "specrun: measuring the network's share of a verify (the same batches through the workers and here alone)...",
                    style="dim",
                )
                network = measure(pair, opts.pair).to_json()
        finally:
            pair.close()
            if prompt_dir is not None:
                prompt_dir.cleanup()
        result.meta = {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "target": target_label,
            "draft": draft_label,
            "threads": opts.pair.threads,
            "n_predict": n_predict,
            "runs": runs,
            "llama_cpp": llama.version(),
            "machine": f"{platform.system()} {platform.machine()}, {platform.processor() or ''}".strip(", "),
            "gpu_offload": llama.supports_gpu_offload(),
            "placement": pair.placement.to_json() if pair.placement else None,
        }
        if pair.workers:
            result.meta["network"] = network
        if json_out:
            print_json(result.to_json())
        elif markdown:
            print(to_markdown(result))
        else:
            out = stdout()
            for t in tables(result, out.width):
                out.print(t)
        return 0


def _by_source(s: dict) -> str:
    """Each source's accepted / drafted tokens, e.g. ``mtp 34/89, ngram 12/15``."""
    return ", ".join(f"{k} {v['accepted']}/{v['drafted']}" for k, v in s["by_source"].items() if v["drafted"]) or "-"


def _summary_rows(result: BenchResult, data: dict):
    """(class, mode, summary, acceptance-by-position text) in display order, overall last."""
    classes = sorted(c for c in data["classes"] if c != "overall") + ["overall"]
    for cls in classes:
        for mode in result.modes:
            s = data["classes"][cls].get(mode)
            if s is not None:
                yield cls, mode, s, " ".join(f"{100 * x:.0f}" for x in s["accept_per_position"][:8]) or "-"


def _per_verify(s: dict) -> str:
    return f"{s['tokens_per_decode']:.2f}" if s["tokens_per_decode"] else "-"  # 0: another tool's run, not counted


def _branch_wins(s: dict) -> str:
    """Tree rounds a branch other than the first won, of all tree rounds: ``3/12 (25%)``; ``-``: no tree ran."""
    return f"{s['branch_wins']}/{s['tree_rounds']} ({100 * s['branch_win_rate']:.0f}%)" if s["tree_rounds"] else "-"


def _trees_ran(data: dict) -> bool:
    return any(s["tree_rounds"] for modes in data["classes"].values() for s in modes.values())


def _same_text(identical: bool | None) -> str:
    return "-" if identical is None else "yes" if identical else "NO"  # None: another tool's, not compared


def _against_rows(data: dict):
    """(class, llama.cpp's best setting with its speedup, each mode's ratio to it), overall last."""
    vs = data["against_llama_cpp"]
    for cls in sorted(c for c in vs if c != "overall") + (["overall"] if "overall" in vs else []):
        v = vs[cls]
        best = f"{v['best'].removeprefix(PREFIX)} ({v['best_speedup']:.2f}x plain)"
        yield cls, best, ", ".join(f"{m} {r:.2f}x" for m, r in v["ratio"].items())


AGAINST_TITLE = "against llama.cpp's best setting per class (median over runs, geometric mean over prompts)"


def to_markdown(result: BenchResult) -> str:
    data = result.to_json()
    trees = _trees_ran(data)  # a column for the branches' wins where token trees ran (--tree)
    out = [
        f"Target {data['meta'].get('target')}, draft {data['meta'].get('draft')}, {data['meta'].get('threads')} threads, "
        f"-n {data['meta'].get('n_predict')}, {data['meta'].get('runs')} runs, llama_cpp {data['meta'].get('llama_cpp')}, {data['meta'].get('date')}",
        "",
        "| class | mode | tok/s (mean ± sd) | speedup vs plain (min) | 95% interval | acceptance | mean accepted len | tokens per verify "
        "| accept by position | accepted / drafted by source | " + ("a branch won / trees | " if trees else "") + "same text as plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if trees else ""),
    ]
    for cls, mode, s, pos in _summary_rows(result, data):
        out.append(
            f"| {cls} | {mode} | {s['tps_mean']:.1f} ± {s['tps_stdev']:.1f} | {s['speedup']:.2f}x ({s['speedup_min']:.2f}) | "
            f"{s['speedup_ci95'][0]:.2f}-{s['speedup_ci95'][1]:.2f} | "
            f"{100 * s['acceptance_rate']:.0f}% | {s['mean_accept_len']:.2f} | {_per_verify(s)} | {pos} | {_by_source(s)} | "
            + (f"{_branch_wins(s)} | " if trees else "")
            + f"{_same_text(s['identical_to_plain'])} |"
        )
    cm = data["cost_model"]
    out += ["", "Cost model (relative to one target token):", ""]
    out.append("| verify batch | " + " | ".join(cm["verify_relative"]) + " |")
    out.append("|---|" + "---|" * len(cm["verify_relative"]))
    out.append("| cost | " + " | ".join(f"{v:.2f}" for v in cm["verify_relative"].values()) + " |")
    out.append("")
    if cm["perfect_drafter_speedup"]:
        out.append(
            f"Ceiling: a perfect drafter, verifying the curve's best batch every round, would run {cm['perfect_drafter_speedup']:.2f}x plain."
        )
        out.append("")
    out.append(
        f"Draft model cost per token: {cm['draft_relative']} of a target token."
        if cm["draft_relative"]
        else "Draft model cost per token: not measured."
    )
    out.append("")
    out.append("| mode | predicted speedup | measured speedup |")
    out.append("|---|---|---|")
    for m, v in data["predicted_vs_measured"].items():
        out.append(
            f"| {m} | {v['predicted']:.2f}x | {v['measured']:.2f}x |"
            if v["measured"] is not None
            else f"| {m} | {v['predicted']:.2f}x | - |"
        )
    out.append("")
    if data["against_llama_cpp"]:
        out += [
            AGAINST_TITLE[0].upper() + AGAINST_TITLE[1:] + ":",
            "",
            "| class | llama.cpp's best | each mode against it |",
            "|---|---|---|",
        ]
        out += [f"| {c} | {b} | {r} |" for c, b, r in _against_rows(data)]
        out.append("")
    out.append(f"**Verdict:** {data['verdict']}")
    net = data["meta"].get("network")
    if net:
        out += ["", network_title(net) + ":", "", "| " + " | ".join(NETWORK_COLUMNS) + " |", "|---|---|---|---|---|"]
        out += ["| " + " | ".join(row) + " |" for row in network_rows(net)]
        out += ["", net["note"]]
    return "\n".join(out)


SPEED_COLUMNS = ("tok/s", "± sd", "speedup", "95% interval")
ACCEPT_COLUMNS = ("accept", "mean len", "tok/verify", "by position", "by source")
BRANCH_COLUMN = "branch won"  # where token trees ran (--tree): the tree rounds a branch other than the first won


def tables(result: BenchResult, width: int | None = None):
    """The bench's tables, for a console ``width`` columns wide (None: as wide as they need). Where
    the summary does not fit in one table it comes as two (speed, then acceptance), and the cost
    model as a line that wraps, so that no number or name is cut."""
    from rich.console import Console
    from rich.measure import Measurement
    from rich.text import Text

    data = result.to_json()
    accept_columns = (*ACCEPT_COLUMNS, BRANCH_COLUMN) if _trees_ran(data) else ACCEPT_COLUMNS
    rows = []
    for cls, mode, s, pos in _summary_rows(result, data):
        lo, hi = s["speedup_ci95"]
        cells = {
            "tok/s": f"{s['tps_mean']:.1f}",
            "± sd": f"{s['tps_stdev']:.1f}",
            "speedup": f"{s['speedup']:.2f}x",
            "95% interval": f"{lo:.2f}-{hi:.2f}",
            "accept": f"{100 * s['acceptance_rate']:.0f}%",
            "mean len": f"{s['mean_accept_len']:.2f}",
            "tok/verify": _per_verify(s),
            "by position": pos,
            "by source": _by_source(s),
            BRANCH_COLUMN: _branch_wins(s),
        }
        rows.append((cls, mode.replace(PREFIX, PREFIX + " "), cells))  # "llama.cpp: draft-simple@16" may wrap after the colon

    def summary(title: str, columns: tuple[str, ...]) -> Table:
        t = Table(title=title, title_justify="left")
        for col in ("class", "mode", *columns):
            left = col in ("class", "mode", "by position", "by source")
            t.add_column(col, justify="left" if left else "right", no_wrap=col not in ("mode", "by position", "by source"))
        for cls, mode, cells in rows:
            t.add_row(cls, mode, *(cells[c] for c in columns))
        return t

    wide = Console(width=10_000)  # measures what a table needs, wrapping what may wrap

    def fits(renderable) -> bool:
        return width is None or Measurement.get(wide, wide.options, renderable).minimum <= width

    whole = summary("specrun bench", SPEED_COLUMNS + accept_columns)
    main = (
        [whole] if fits(whole) else [summary("specrun bench: speed", SPEED_COLUMNS), summary("specrun bench: acceptance", accept_columns)]
    )
    cost = Table(title="measured cost model (x one target token)", title_justify="left")
    cost.add_column("verify batch")
    for b in data["cost_model"]["verify_relative"]:
        cost.add_column(b, justify="right")
    cost.add_row("cost", *[f"{v:.2f}" for v in data["cost_model"]["verify_relative"].values()])
    if not fits(cost):
        pairs = "  ".join(f"{b}: {v:.2f}" for b, v in data["cost_model"]["verify_relative"].items())
        cost = Text(f"measured cost model (x one target token), verify batch: {pairs}")
    pv = Table(title="predicted vs measured speedup", title_justify="left")
    pv.add_column("mode")
    pv.add_column("predicted", justify="right")
    pv.add_column("measured", justify="right")
    for m, v in data["predicted_vs_measured"].items():
        pv.add_row(m, f"{v['predicted']:.2f}x", f"{v['measured']:.2f}x" if v["measured"] is not None else "-")

    ceiling = data["cost_model"]["perfect_drafter_speedup"]
    notes = [Text(f"ceiling (a perfect drafter): {ceiling:.2f}x plain")] if ceiling else []
    net = [network_table(data["meta"]["network"])] if data["meta"].get("network") else []
    against = []
    if data["against_llama_cpp"]:
        vs = Table(title=AGAINST_TITLE, title_justify="left")
        for col in ("class", "llama.cpp's best", "each mode against it"):
            vs.add_column(col)
        for row in _against_rows(data):
            vs.add_row(*row)
        against = [vs]
    return [
        *main,
        cost,
        *notes,
        Text(
            f"draft model cost per token: {data['cost_model']['draft_relative']} x target"
            if data["cost_model"]["draft_relative"]
            else "draft model cost per token: not measured (no draft model drafted)"
        ),
        pv,
        *against,
        Text(f"verdict: {data['verdict']}", style="bold"),
        *net,
    ]


__all__ = ["register", "to_markdown", "BASELINE"]
