"""Pure functions from data to Rich renderables. No I/O, so they are tested without a terminal."""

from __future__ import annotations

import math
from collections.abc import Callable

from rich.console import Group
from rich.table import Table
from rich.text import Text

from specrun.decode.stats import RunStats
from specrun.fit.memory import Fit
from specrun.fit.placement import describe
from specrun.gguf.architecture import short_label
from specrun.gguf.facts import ModelInfo
from specrun.gguf.heads import HeadFile, Heads, head_file_of, heads_of
from specrun.models.catalog import Catalog
from specrun.models.discovery import DraftReport
from specrun.run.pair import PairReport
from specrun.run.stream import Event

DRAFT_STYLE = "color(109)"  # a muted teal: text that came from accepted drafts, when shown
BRANCH_STYLE = "color(175)"  # a muted pink: ... from a token tree's branch other than the first (--tree)


def human_bytes(n: float | int | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def human_count(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _mark(ok: bool) -> Text:
    return Text("ok", style="green") if ok else Text("FAIL", style="bold red")


def pair_table(r: PairReport, name_of: Callable[[str], str] = lambda s: s) -> Group:
    """The check-pair report; ``name_of`` writes a setting as its flag (in proposals)."""
    vocab = Table(title="Vocabulary", title_justify="left", expand=False)
    vocab.add_column("check")
    vocab.add_column("target")
    vocab.add_column("draft")
    vocab.add_column("")
    vocab.add_column("detail", overflow="fold")
    for c in r.compat.checks:
        mark = _mark(c.ok) if c.enforced else Text("info" if c.ok else "differs", style="yellow" if not c.ok else "dim")
        vocab.add_row(c.name, str(c.target), str(c.draft), mark, c.detail)

    mem = Table(title=f"Memory at -c {r.n_ctx}", title_justify="left")
    for col in ("model", "weights", "KV cache", "state", "compute", "total", "on devices", "in RAM"):
        mem.add_column(col, justify="right" if col != "model" else "left")
    for m in r.fit.models:
        mem.add_row(
            m.role,
            human_bytes(m.weights),
            human_bytes(m.kv_cache),
            human_bytes(m.state) if m.state else "-",
            human_bytes(m.compute),
            human_bytes(m.total),
            human_bytes(m.on_devices),
            human_bytes(m.on_host),
        )
    parts = [
        Text(f"target: {r.target.name} ({r.target.path.name})\ndraft:  {r.draft.name} ({r.draft.path.name})"),
        Text(f"target: {r.target.arch.sentence()}\ndraft:  {r.draft.arch.sentence()}"),
        vocab,
        mem,
    ]
    h = heads_of(r.target)
    if h.count or h.stripped_note():
        use = "counted in the target's memory; --draft mtp drafts with them alone, hybrid (the default) chooses" if h.usable else ""
        parts.insert(1, heads_text(h, r.n_ctx, use))
    if r.draft_head is not None:
        parts.insert(1, head_file_text(r.draft_head, r.head_mismatch))
    if r.placement is not None:
        parts.append(Text(f"Placement: {describe(r.placement)}"))
        parts += [Text(f"warning: {n}", style="yellow") for n in r.placement.notes]
    parts += [device_table(r.fit), Text(r.fit.note, style="dim")]

    verdict = Text()
    if r.ok:
        verdict.append("OK: ", style="bold green")
        verdict.append("the pair is compatible and fits.")
    else:
        verdict.append("NO: ", style="bold red")
        reasons = []
        if not r.compat.compatible:
            reasons.append(f"incompatible vocabularies ({r.compat.reason()})")
        if not r.fit.fits:
            reasons.append(f"does not fit ({r.fit.short()})")
        if r.head_mismatch:
            reasons.append(f"the draft head is for another target ({r.head_mismatch})")
        verdict.append("; ".join(reasons) + ".")
        if not r.fit.fits:
            if r.fit.proposals:
                for p in r.fit.proposals:
                    verdict.append("\nThis would fit: ", style="bold")
                    verdict.append(" ".join(f"{name_of(k)} {v}" for k, v in p.settings.items()), style="bold cyan")
                    verdict.append(f"  ({p.why})")
            else:
                verdict.append("\nNo setting of layers, split or context fits: pick a smaller quant or smaller models.")
    parts.append(verdict)
    if r.suggestions:
        parts.append(Text(f"known drafts that match the target: {', '.join(r.suggestions)} (`specrun drafts` lists them all)"))
    return Group(*parts)


def heads_text(h: Heads, n_ctx: int, use: str = "") -> Text:
    """'built-in MTP: 1 head (blk.2: 1.2 MiB weights + 0.5 MiB KV at -c 4096)', and what to do."""
    t = Text()
    t.append(h.describe(), style="bold green" if h.usable else "yellow")
    if h.count:
        t.append(f" (blk.{h.first_block}: {human_bytes(h.weights_bytes)} weights + {human_bytes(h.kv_bytes(n_ctx))} KV at -c {n_ctx})")
    if use:
        t.append(f"; {use}")
    note = h.stripped_note()
    if note:
        t.append(f"\nnote: {note}", style="yellow")
    return t


def head_file_text(h: HeadFile, mismatch: str | None) -> Text:
    """'draft: EAGLE-3 head for a 64-wide target (reads its layers 0, 1, 1): it fits this target; ...'"""
    t = Text(f"draft: {h.describe()}: ")
    if mismatch is None:
        t.append("it fits this target", style="bold green")
        t.append(f"; --draft {h.source} drafts with it alone, hybrid (the default) chooses")
    elif h.fault is not None:
        t.append(f"unusable: {mismatch}", style="bold red")
    else:
        t.append(f"not this target's: {mismatch}", style="bold red")
    return t


_KIND = {"gpu": "GPU", "rpc": "RPC", "cpu": "RAM"}


def device_table(fit: Fit) -> Table:
    """Each device's share of the pair against its free memory."""
    t = Table(title="Per device, against free memory", title_justify="left")
    for col in ("device", "kind", "where", "free", "target", "draft", "headroom", ""):
        t.add_column(col, justify="right" if col in ("free", "target", "draft", "headroom") else "left")
    for s in fit.shares:
        d = s.device
        t.add_row(
            d.name,
            _KIND.get(d.kind, d.kind),
            d.description,
            human_bytes(d.free),
            human_bytes(s.target) if s.target else "-",
            human_bytes(s.draft) if s.draft else "-",
            human_bytes(s.headroom),
            _mark(s.fits),
        )
    return t


def network_rows(net: dict) -> list[tuple[str, str, str, str, str]]:
    """A network report (``network.NetworkReport.to_json()``) as rows: batch, through the
    workers, on this machine alone, the network's share, bytes sent / received per verify."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} ms"

    return [
        (
            str(r["batch"]), ms(r["split_ms"]), ms(r["local_ms"]),
            "-" if r["network_share"] is None else f"{100 * r['network_share']:.0f}%",
            "-" if r["bytes_sent"] is None else f"{human_bytes(r['bytes_sent'])} / {human_bytes(r['bytes_received'])}",
        )
        for r in net["verify"]
    ]  # fmt: skip


NETWORK_COLUMNS = ("verify batch", "through the workers", "on this machine alone", "network share", "sent / received")


def network_title(net: dict) -> str:
    rtt = f", round trip {net['rtt_ms']:.2f} ms" if net.get("rtt_ms") is not None else ""
    return f"Network share of a verify (RPC workers {', '.join(net['workers'])}{rtt})"


def network_table(net: dict) -> Group:
    t = Table(title=network_title(net), title_justify="left")
    for col in NETWORK_COLUMNS:
        t.add_column(col, justify="right")
    for row in network_rows(net):
        t.add_row(*row)
    return Group(t, Text(net["note"], style="dim"))


def devices_table(rows: list[dict]) -> Table:
    """`specrun devices`: what llama.cpp sees (rows: name, backend, kind, description, free, total)."""
    t = Table(title="Devices llama.cpp sees", title_justify="left")
    for col in ("device", "backend", "kind", "description", "free", "total"):
        t.add_column(col, justify="right" if col in ("free", "total") else "left")
    for r in rows:
        t.add_row(r["name"], r["backend"], r["kind"], r["description"], human_bytes(r["free"]), human_bytes(r["total"]))
    return t


def inspect_table(m: ModelInfo) -> Table:
    t = Table(show_header=False, title=m.path.name, title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value", overflow="fold")
    head_kv = m.n_head_kv[0] if len(set(m.n_head_kv)) == 1 else m.n_head_kv
    rows = [
        ("name", m.name),
        ("architecture", m.architecture),
        ("parameters", human_count(m.n_params)),
        ("layers", str(m.n_layer)),
        ("context length", str(m.n_ctx_train)),
        ("embedding / heads / kv heads", f"{m.n_embd} / {m.n_head} / {head_kv}"),
        ("quantization", m.quant),
        ("weights", human_bytes(m.weights_bytes)),
        ("tokenizer", f"{m.tokenizer_model} (pre: {m.tokenizer_pre or '-'})"),
        ("vocabulary", str(m.n_vocab)),
        ("add_bos / add_eos", f"{m.add_bos} / {m.add_eos}"),
    ]
    for k, v in m.special_tokens().items():
        rows.append((f"{k} token", "-" if v is None else f"{v['id']} {v['text']!r}"))
    rows.append(("chat template", "present" if m.chat_template else "absent"))
    rows.append(("KV cache per 1k context (f16)", human_bytes(m.kv_bytes(1024))))
    rows.append(("memory and rollback", m.arch.sentence()))
    if m.arch.loadable is False:
        rows.append(("llama.cpp", f"the installed llama.cpp cannot load {m.arch.name!r} models"))
    if m.arch.kind != "attention":
        state = "unknown" if m.arch.state_bytes is None else human_bytes(m.arch.state_bytes)
        rows.append(("recurrent state (one sequence)", state))
    h = heads_of(m)
    if h.count:
        rows.append(
            (
                "draft heads",
                f"{h.describe()} (blk.{h.first_block}, {human_bytes(h.weights_bytes)} weights, {human_bytes(h.kv_bytes(1024))} KV per 1k context)",
            )
        )
    elif h.stripped_note():
        rows.append(("draft heads", f"none: {h.stripped_note()}"))
    d = head_file_of(m)
    if d is not None:
        if d.source in ("eagle3", "dflash"):
            borrows = [what for what, own in (("token embeddings", d.own_embeddings), ("output head", d.own_output)) if not own]
            uses = f"; borrows the target's {' and '.join(borrows)}" if borrows else ""
            if d.fault is not None:
                uses += f"; unusable: {d.fault}"
        else:
            uses = "; attends over the target's KV cache and borrows its token embeddings"
        rows.append(("draft head", d.describe() + uses))
    for k, v in rows:
        t.add_row(k, v)
    return t


def models_table(rows: list[dict]) -> Table:
    t = Table(title="Models", title_justify="left")
    for col in ("name", "aliases", "status", "size", "arch", "quant", "draft", "path"):
        t.add_column(col, overflow="fold")
    for r in rows:
        status = Text("present", style="green") if r["present"] else Text("missing", style="yellow")
        if r.get("error"):
            status = Text("unreadable", style="red")
        if r.get("verified") is not None:
            status.append(" sha256 ok" if r["verified"] else " SHA256 MISMATCH", style="green" if r["verified"] else "bold red")
        t.add_row(
            r["name"],
            ", ".join(r["aliases"]),
            status,
            human_bytes(r.get("size")) if r["present"] else "-",
            r.get("architecture") or "-",
            r.get("quant") or "-",
            r.get("draft") or "-",
            r["path"],
        )
    return t


def scan_table(c: Catalog) -> Table:
    """`specrun models --scan`: one row per GGUF file, with every name that reaches it
    (the paths are in --json)."""
    t = Table(title="GGUF files in the registry and the model stores", title_justify="left")
    for col in ("reference", "size", "arch", "quant", "vocab", "heads", "fingerprint"):
        t.add_column(col, overflow="fold", justify="right" if col in ("size", "vocab") else "left")
    for k in c.models:
        s = k.summary
        refs = "\n".join(k.refs)
        if s is None:
            t.add_row(refs, "-", Text("unreadable", style="red"), "-", "-", "-", k.error or "")
            continue
        parts = f" ({k.parts} parts)" if k.parts > 1 else ""
        # built-in MTP heads, or the target an EAGLE-3 head is for
        heads = f"MTP x{s.mtp_heads}" if s.mtp_heads else _head_file_short(s.draft_head) if s.draft_head else "-"
        t.add_row(
            refs, human_bytes(s.file_size) + parts, s.architecture, s.quant, f"{s.n_vocab} {s.tokenizer_model}", heads, s.fingerprint[:12]
        )
    return t


def _head_file_short(h: HeadFile) -> str:
    if h.source == "eagle3":
        d2t = f", {h.draft_vocab} tokens" if h.draft_vocab is not None else ""
        return f"EAGLE-3 for {h.target_hidden}-wide, layers {','.join(str(i) for i in h.target_layers)}{d2t}"
    if h.source == "dflash":
        return f"{h.kind.removeprefix('a ')} for {h.target_hidden}-wide, layers {','.join(str(i) for i in h.target_layers)}, block {h.block_size}"
    return f"MTP assistant for {h.target_hidden}-wide"


def drafts_table(r: DraftReport) -> Group:
    """`specrun drafts`: the compatible drafts, ranked, and why every other file cannot draft."""
    t = r.target
    head = Text(
        f"Drafts for {r.target_label}: {t.name} ({short_label(t.architecture)}, {human_count(t.n_params)} params, "
        f"{human_bytes(t.weights_bytes)} weights, {t.n_vocab} tokens)"
    )
    parts: list = [head]
    h = r.heads
    if h.usable:
        parts.append(heads_text(h, r.n_ctx, "its best free draft: --draft mtp (or the default, hybrid)"))
    elif h.count or h.stripped_note():
        parts.append(heads_text(h, r.n_ctx))
    if r.drafts:
        ok = Table(title=f"Can draft (most useful first; memory at -c {r.n_ctx})", title_justify="left")
        for col in ("#", "model", "arch", "quant", "weights", "vs target", "memory"):
            ok.add_column(col, overflow="fold", justify="right" if col in ("#", "weights", "vs target", "memory") else "left")
        for i, c in enumerate(r.drafts, 1):
            s = c.summary
            ok.add_row(
                str(i),
                "\n".join(c.known.refs),
                short_label(s.architecture),
                s.quant,
                human_bytes(s.weights_bytes),
                f"{c.size_ratio:.2f}x",
                human_bytes(c.memory.total),
            )
        parts.append(ok)
    else:
        parts.append(Text("No known GGUF file can draft for it" + (" (its own heads can)." if h.usable else "."), style="bold yellow"))
    if r.cannot:
        no = Table(title="Cannot draft", title_justify="left")
        no.add_column("model", overflow="fold")
        no.add_column("arch")
        no.add_column("why", overflow="fold")
        for c in r.cannot:
            no.add_row("\n".join(c.known.refs), short_label(c.summary.architecture), c.reason)
        parts.append(no)
    for k in r.unreadable:
        parts.append(Text(f"unreadable: {', '.join(k.refs)}: {k.error}", style="red"))
    if r.no_tokenizer:
        parts.append(Text(f"skipped (no tokenizer: projectors or the like): {', '.join(k.label for k in r.no_tokenizer)}", style="dim"))
    return Group(*parts)


def status_line(s: RunStats) -> Text:
    """The live line under a reply: speed, acceptance, draft length, time split."""
    busy = s.draft_s + s.verify_s
    split = f"{100 * s.draft_s / busy:.0f}/{100 * s.verify_s / busy:.0f}" if busy > 0 else "-/-"
    t = Text(style="dim")
    t.append(f"{s.generation_tps:6.1f} tok/s", style="bold cyan")
    t.append(f"  accept {100 * s.acceptance_rate:3.0f}%")
    t.append(f"  mean len {s.mean_accept_len:.2f}")
    t.append(f"  draft K={s.current_draft_len}")
    t.append(f"  draft/verify {split}%")
    t.append(f"  {s.n_generated} tok")
    if s.n_tree_rounds:
        t.append(f"\n  {tree_words(s)}, {s.tokens_per_decode:.2f} tok/verify")
    if s.idle_reason:
        t.append(f"\n  drafting little: {s.idle_reason}", style="italic dim")
    return t


def event_text(event: Event, show_drafts: bool) -> Text:
    """An event's new text; with ``show_drafts``, what came from accepted drafts is tinted."""
    if not show_drafts:
        return Text(event.text)
    t = Text()
    for text, source, branch in event.segments:
        t.append(text, style=BRANCH_STYLE if branch else DRAFT_STYLE if source else None)
    return t


def tree_words(s: RunStats) -> str:
    """'trees 12 (64 nodes), a branch won 3 (25%)': what token trees did (--tree)."""
    return f"trees {s.n_tree_rounds} ({s.n_tree_nodes} nodes), a branch won {s.n_branch_wins} ({100 * s.branch_win_rate:.0f}%)"


def summary_line(s: RunStats, label: str = "") -> str:
    """One plain line after a reply (also the stats line `generate` prints to stderr)."""
    src = ", ".join(f"{k} {v[0]}" for k, v in sorted(s.by_source.items()))
    return (
        f"{label}{s.n_generated} tokens in {s.wall_s:.2f} s, {s.generation_tps:.1f} tok/s | "
        f"prompt {s.n_prompt_tokens} tok at {s.prompt_tps:.1f} tok/s | "
        f"accepted {s.n_accepted}/{s.n_drafted} ({100 * s.acceptance_rate:.0f}%), "
        f"mean len {s.mean_accept_len:.2f}, {s.tokens_per_decode:.2f} tok/decode | "
        f"draft {s.draft_s:.2f} s, verify {s.verify_s:.2f} s | rounds: {src or '-'} | "
        f"finish: {s.finish_reason or '-'}"
        + (f" | {tree_words(s)}" if s.n_tree_rounds else "")
        + (f" | drafting little: {s.idle_reason}" if s.idle_reason else "")
    )


def stats_table(s: RunStats, title: str = "Session") -> Group:
    t = Table(title=title, title_justify="left", show_header=False)
    t.add_column("k", style="bold")
    t.add_column("v")
    for k, v in (
        ("generated", f"{s.n_generated} tokens at {s.generation_tps:.1f} tok/s"),
        ("prompt", f"{s.n_prompt_tokens} tokens at {s.prompt_tps:.1f} tok/s"),
        ("drafted / accepted", f"{s.n_drafted} / {s.n_accepted} ({100 * s.acceptance_rate:.1f}%)"),
        ("mean accepted length", f"{s.mean_accept_len:.2f}"),
        ("tokens per target decode", f"{s.tokens_per_decode:.2f}"),
        ("time: draft / verify / sample / other", f"{s.draft_s:.2f} / {s.verify_s:.2f} / {s.sample_s:.2f} / {s.other_s:.2f} s"),
        ("rounds by source", ", ".join(f"{k}: {v[0]}" for k, v in sorted(s.by_source.items())) or "-"),
        *(
            [
                ("token trees", f"{s.n_tree_rounds} rounds, {s.n_tree_nodes} nodes verified"),
                ("a branch other than the first won", f"{s.n_branch_wins} rounds ({100 * s.branch_win_rate:.1f}%)"),
            ]
            if s.n_tree_rounds
            else []
        ),
        ("why it drafts little", s.idle_reason or "-"),
    ):
        t.add_row(k, v)
    pos = Table(title="Acceptance per draft position", title_justify="left")
    pos.add_column("position", justify="right")
    pos.add_column("proposed", justify="right")
    pos.add_column("accepted", justify="right")
    pos.add_column("rate", justify="right")
    for i, (p, a) in enumerate(zip(s.proposed_at, s.accepted_at)):
        pos.add_row(str(i + 1), str(p), str(a), f"{100 * a / p:.0f}%" if p else "-")
    return Group(t, pos)


def costs_table(path, entries: dict[str, dict]) -> Group:
    """The stored costs and statistics, one table per entry."""
    from specrun.decode.costs import stored_noise
    from specrun.decode.sources.ngram import COPY_BINS, NgramSource, copy_bin

    if not entries:
        return Group(Text(f"nothing stored in {path} yet: the first generate, chat or bench on a pair measures it"))
    parts = [Text(f"stored in {path}", style="dim")]
    for key, e in sorted(entries.items()):
        t = Table(title=key, title_justify="left", show_header=False)
        t.add_column("k", style="bold")
        t.add_column("v", overflow="fold")
        cost = e.get("cost") or {}
        verify = {int(b): v for b, v in (cost.get("verify") or {}).items()}
        measured = cost.get("measured") or {}
        c1 = verify.get(1)
        if c1:
            t.add_row("one token", f"{1e3 * c1:.2f} ms ({1 / c1:.1f} tok/s)")
            t.add_row("verify b tokens (x one)", "  ".join(f"{b}: {v / c1:.2f}" for b, v in sorted(verify.items())))
            model = (e.get("sources") or {}).get("model") or {}
            dpt, first = model.get("per_token"), model.get("first_s")
            t.add_row("draft per token (x one)", f"{dpt / c1:.2f}" if isinstance(dpt, (int, float)) else "-")
            if isinstance(first, (int, float)):
                t.add_row("a round's first draft (x one)", f"{first / c1:.2f}")
        else:
            t.add_row("verify curve", "none stored")
        if measured:
            cond = f"others used {measured.get('others_cpu', '?')} cores, load {measured.get('load_avg', '?')}"
            t.add_row("measured", f"{measured.get('date', '?')} ({cond})")
        noise = stored_noise(cost.get("noise"))
        if noise is not None:
            t.add_row(
                "one round strays by", f"about {100 * math.expm1(math.sqrt(noise[0] / noise[1])):.0f}% (over {noise[1]:.0f} rounds' worth)"
            )
        t.add_row("updated", str(e.get("updated", "-")))
        stored = (e.get("sources") or {}).get("ngram")
        if stored:
            ngram = NgramSource()
            ngram.load(stored, keep=float("inf"))
            taught = [rates for taught, rates in zip(ngram.learned_kinds(), ngram.rates()) if taught]
            for i, rates in enumerate(taught, 1):  # the kinds of reply it keeps apart (an untaught one: not shown)
                t.add_row(
                    f"a copy goes on, kind {i} (by match length)", "  ".join(f"{n}: {rates[copy_bin(n)]:.0%}" for n in COPY_BINS[1::2])
                )
        if e.get("tie_rate") is not None:
            t.add_row("near-tie rate", f"{100 * e['tie_rate']:.1f}%")
        parts.append(t)
    return Group(*parts)


def source_mix(s: RunStats) -> str:
    """Rounds by draft source, as shares: "ngram 40% · model 35% · none 25%"."""
    total = sum(v[0] for v in s.by_source.values())
    if not total:
        return "-"
    parts = sorted(s.by_source.items(), key=lambda kv: -kv[1][0])
    return " · ".join(f"{k} {100 * v[0] / total:.0f}%" for k, v in parts)


def request_line(label: str, state: str, s: RunStats | None, waiting: int = 0) -> Text:
    """One request on `specrun serve`'s terminal: speed, acceptance and where drafts came from."""
    t = Text(style="dim" if state != "running" else "")
    t.append(f"{label}  ", style="bold")
    if s is None:
        t.append(state)
    else:
        t.append(f"{s.n_generated} tok  ")
        t.append(f"{s.generation_tps:.1f} tok/s", style="bold cyan")
        t.append(f"  accept {100 * s.acceptance_rate:.0f}% ({s.n_accepted}/{s.n_drafted})")
        t.append(f"  rounds {source_mix(s)}")
        t.append(f"  prompt {s.n_prompt_tokens + s.n_cached_tokens} tok, {s.n_cached_tokens} cached")
        if s.n_tree_rounds:
            t.append(f"  {tree_words(s)}")
        if state != "running":
            t.append(f"  [{s.finish_reason or state}]")
    if waiting:
        t.append(f"  ({waiting} waiting)", style="yellow")
    return t
