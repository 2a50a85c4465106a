"""`specrun generate`: one prompt in, text streamed out, stats to stderr."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..control import CostStore
from ..display import summary_line
from ..engine import Engine, Settings
from ..errors import InputError, UsageError
from ..registry import Registry
from ..sampling import Sampler
from ..template import ChatTemplate, render_chat
from ..text import Utf8Stream

if TYPE_CHECKING:
    from ..session import OpenPair
from .common import (
    DRAFT_MAX_ADAPTIVE, DRAFT_MAX_FIXED,
    CtxOpt, DraftMaxOpt, DraftMinOpt, DraftModelOpt, DraftModeOpt, FixedOpt, GpuLayersDraftOpt,
    GpuLayersOpt, JsonOpt, MinPOpt, NgramMaxOpt, NgramMinOpt, TieMarginOpt, NPredictOpt, PSplitOpt, RegistryOpt,
    SeedOpt, SignalStop, TargetOpt, TempOpt, ThreadsOpt, TopKOpt, TopPOpt, VerboseOpt, cache_dir,
    check_range, default_threads, load_registry, print_json, require_file, stderr,
)


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """-p, else --prompt-file, else stdin. Non-UTF-8 bytes are an error naming the offset."""
    if prompt is not None and prompt_file is not None:
        raise UsageError("give the prompt with -p or --prompt-file, not both", "drop one of them")
    if prompt is not None:
        text = prompt
    else:
        if prompt_file is not None:
            try:
                data = prompt_file.read_bytes()
            except FileNotFoundError:
                raise InputError(f"prompt file not found: {prompt_file}", "check the path") from None
            except IsADirectoryError:
                raise InputError(f"{prompt_file} is a directory", "pass a text file") from None
            except OSError as e:
                raise InputError(f"cannot read {prompt_file}: {e.strerror}", "check the file") from None
            where = str(prompt_file)
        elif not sys.stdin.isatty():
            try:
                data = sys.stdin.buffer.read()
            except (OSError, ValueError):
                data = b""
            where = "stdin"
        else:
            raise UsageError("no prompt", "pass -p TEXT, --prompt-file FILE, or pipe text on stdin")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(
                f"{where} is not UTF-8: byte 0x{data[e.start]:02x} at offset {e.start}",
                "convert it, e.g. iconv -f latin1 -t utf-8",
            ) from None
        if text.startswith("\ufeff"):
            text = text[1:]
    if not text.strip():
        raise UsageError("the prompt is empty", "pass some text with -p, --prompt-file or stdin")
    return text


def resolve_models(reg: Registry, model: str, draft_model: str | None, mode: str):
    target = require_file(reg.resolve(model))
    draft = None
    if mode in ("model", "hybrid"):
        d = reg.resolve(draft_model) if draft_model else reg.default_draft(target)
        if d is None:
            if mode == "model":
                raise UsageError(
                    f"no draft model for {target.label}: pass -d DRAFT",
                    "or set `draft` in its registry entry, or use --draft ngram",
                )
        else:
            draft = require_file(d)
    return target, draft


def build_settings(draft, draft_max, draft_min, p_split, fixed, ngram_min, ngram_max, has_draft: bool, tie_margin: float = 0.5) -> Settings:
    if draft_max is None:
        draft_max = DRAFT_MAX_FIXED if fixed else DRAFT_MAX_ADAPTIVE
    mode = draft
    if mode == "hybrid" and not has_draft:
        mode = "ngram"  # no draft model to fall back on: hybrid is n-gram alone
    return Settings(mode, draft_max, draft_min, p_split, fixed, ngram_min, ngram_max, tie_margin)


def model_template(pair: OpenPair) -> ChatTemplate:
    """The target's chat template, with its BOS and EOS token texts."""
    info = pair.target_info
    tok = info.tokens

    def text(i):
        return tok[i] if i is not None and 0 <= i < len(tok) else ""

    return ChatTemplate(info.chat_template, text(info.bos_id), text(info.eos_id))


def chat_prompt(pair: OpenPair, messages: list[dict], warn) -> tuple[str, bool]:
    """Render messages with the model's template. Returns (text, add_special)."""
    tmpl = model_template(pair)
    text = render_chat(tmpl, messages, warn)
    # templates that write the BOS text themselves must not get a second one from the tokenizer
    bos = tmpl.bos_token
    return text, not (bos and text.startswith(bos))


def prepare_engine(pair: OpenPair, settings: Settings, sampler: Sampler, err) -> tuple[Engine, CostStore]:
    """An engine with this machine's stored cost model, calibrated once if there is none."""
    from ..session import load_costs
    store = CostStore(cache_dir() / "costs.json")
    engine = Engine(pair.target, pair.draft, settings, sampler, load_costs(store, pair.cost_key))
    if settings.sources and not settings.fixed and not engine.cost.verify:
        err.print("specrun: measuring this machine's verify costs once (cached for next time)...", style="dim")
        engine.calibrate()
    return engine, store


def register(app: typer.Typer) -> None:
    @app.command("generate")
    def generate(
        model: TargetOpt,
        draft_model: DraftModelOpt = None,
        prompt: Annotated[Optional[str], typer.Option("-p", "--prompt", help="The prompt text.", show_default=False)] = None,
        prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="Read the prompt from a UTF-8 file.", show_default=False)] = None,
        chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
        system: Annotated[Optional[str], typer.Option("--system", help="System prompt (with --chat).", show_default=False)] = None,
        n_predict: NPredictOpt = 256,
        temp: TempOpt = 0.0,
        seed: SeedOpt = None,
        top_k: TopKOpt = 40,
        top_p: TopPOpt = 0.95,
        min_p: MinPOpt = 0.05,
        ctx: CtxOpt = 4096,
        draft: DraftModeOpt = "hybrid",
        draft_max: DraftMaxOpt = None,
        draft_min: DraftMinOpt = 1,
        draft_p_split: PSplitOpt = 0.6,
        fixed: FixedOpt = False,
        ngram_min: NgramMinOpt = 2,
        ngram_max: NgramMaxOpt = 6,
        tie_margin: TieMarginOpt = 0.5,
        threads: ThreadsOpt = default_threads(),
        gpu_layers: GpuLayersOpt = -1,
        gpu_layers_draft: GpuLayersDraftOpt = None,
        registry: RegistryOpt = None,
        json_out: JsonOpt = False,
        verbose: VerboseOpt = False,
    ) -> int:
        """Generate text from one prompt with speculative decoding. Text streams to stdout,
        a stats line goes to stderr; --json prints one object (text, tokens, finish_reason,
        stats) instead. The output is exactly what the target alone would produce.

        Exit codes: 0 done (also when -n runs past the context: finish reason "context");
        1 incompatible pair or prompt longer than the context; 2 usage error; 3 unreadable
        input (a prompt file that is not UTF-8 is refused, naming the byte offset);
        130/143 interrupted by SIGINT/SIGTERM (the text so far and the stats are printed).
        """
        check_range("-n/--n-predict", n_predict, 1)
        check_range("-c/--ctx", ctx, 16, 1 << 24)
        check_range("-t/--threads", threads, 1, 1024)
        check_range("--gpu-layers", gpu_layers, -1)
        sampler = Sampler(temp, top_k, top_p, min_p, seed)
        build_settings(draft, draft_max, draft_min, draft_p_split, fixed, ngram_min, ngram_max, True, tie_margin)  # validate early
        text = read_prompt(prompt, prompt_file)
        err = stderr()
        reg = load_registry(registry)
        target, dm = resolve_models(reg, model, draft_model, draft)
        settings = build_settings(draft, draft_max, draft_min, draft_p_split, fixed, ngram_min, ngram_max, dm is not None, tie_margin)
        from ..session import PairConfig, open_pair  # loads llama_cpp: only when generating

        cfg = PairConfig(ctx, gpu_layers, gpu_layers_draft, threads, verbose)
        pair = open_pair(target.path, dm.path if dm else None, cfg)
        try:
            for n in pair.notices:
                err.print(f"specrun: {n}", style="dim")
            return _run(pair, settings, sampler, text, chat, system, n_predict, json_out, err)
        finally:
            pair.close()


def _run(pair: OpenPair, settings: Settings, sampler: Sampler, text: str, chat: bool, system, n_predict: int, json_out: bool, err) -> int:
    def warn(msg: str) -> None:
        err.print(f"specrun: warning: {msg}", style="yellow")

    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        text, add_special = chat_prompt(pair, messages, warn)
    else:
        add_special = True
    prompt_tokens = pair.target.tokenize(text, add_special=add_special, parse_special=True)
    engine, store = prepare_engine(pair, settings, sampler, err)
    out_tokens: list[int] = []
    stream = Utf8Stream()
    pieces: list[str] = []
    broken = False
    stats = None
    with SignalStop() as sig:
        gen = engine.generate(prompt_tokens, n_predict, sig.event)
        try:
            for step in gen:
                stats = step.stats
                out_tokens.extend(step.tokens)
                chunk = stream.feed(b"".join(pair.target.piece(t) for t in step.tokens if not pair.target.is_eog(t)))
                pieces.append(chunk)
                if not json_out and chunk and not broken:
                    try:
                        sys.stdout.write(chunk)
                        sys.stdout.flush()
                    except BrokenPipeError:
                        broken = True  # the reader is gone (`| head`): stop generating quietly
                        sig.event.set()
        finally:
            gen.close()
    tail = stream.flush()
    pieces.append(tail)
    if stats is None:  # interrupted before the first round
        from ..stats import RunStats

        stats = RunStats(finish_reason="interrupted")
    store.save(pair.cost_key, engine.cost)
    if json_out:
        print_json({"text": "".join(pieces), "tokens": out_tokens, "finish_reason": stats.finish_reason, "stats": stats.to_json()})
    elif not broken:
        try:
            sys.stdout.write(tail + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            broken = True
    err.print(summary_line(stats), style="dim", soft_wrap=True)
    if broken:
        from .main import _silence_stdout

        _silence_stdout()
        return 0
    if stats.finish_reason == "interrupted" and sig.signum is not None:
        return sig.exit_code()
    return 0
