"""`specrun generate`: one prompt in, text streamed out, stats to stderr."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from specrun.cli.common import SignalStop, load_pair, print_json, silence_stdout, stderr
from specrun.cli.display import summary_line
from specrun.cli.options import ALL, Options, shared
from specrun.decode.stats import RunStats
from specrun.errors import InputError, UsageError
from specrun.run.prompt import chat_prompt
from specrun.run.session import OpenPair, cost_store, open_engine
from specrun.run.stream import stream_generate


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """-p, else --prompt-file, else stdin. Non-UTF-8 bytes are an error naming the offset."""
    if prompt is not None and prompt_file is not None:
        raise UsageError("give the prompt with {prompt} or --prompt-file, not both", "drop one of them", "prompt")
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
            raise UsageError("no prompt", "pass {prompt} TEXT, --prompt-file FILE, or pipe text on stdin", "prompt")
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
        raise UsageError("the prompt is empty", "pass some text with {prompt}, --prompt-file or stdin", "prompt")
    return text


def register(app: typer.Typer) -> None:
    @app.command("generate")
    @shared(ALL)
    def generate(
        opts: Options,
        prompt: Annotated[Optional[str], typer.Option("-p", "--prompt", help="The prompt text.", show_default=False)] = None,
        prompt_file: Annotated[
            Optional[Path], typer.Option("--prompt-file", help="Read the prompt from a UTF-8 file.", show_default=False)
        ] = None,
        chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
        system: Annotated[Optional[str], typer.Option("--system", help="System prompt (with --chat).", show_default=False)] = None,
        stop: Annotated[
            Optional[list[str]],
            typer.Option("--stop", help="Stop when this text appears (not printed); repeat for several.", show_default=False),
        ] = None,
        n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="Most tokens to generate.", min=1)] = 256,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    ) -> int:
        """Generate text from one prompt with speculative decoding. Text streams to stdout,
        a stats line goes to stderr; --json prints one object (text, tokens, finish_reason,
        stats) instead. The output is exactly what the target alone would produce.

        Exit codes: 0 done (also when -n runs past the context: finish reason "context");
        1 incompatible pair or prompt longer than the context; 2 usage error; 3 unreadable
        input (a prompt file that is not UTF-8 is refused, naming the byte offset);
        130/143 interrupted by SIGINT/SIGTERM (the text so far and the stats are printed).
        """
        text = read_prompt(prompt, prompt_file)
        err = stderr()
        pair = load_pair(opts, err)
        try:
            return _run(pair, opts, text, chat, system, stop or [], n_predict, json_out, err)
        finally:
            pair.close()


def _run(
    pair: OpenPair, opts: Options, text: str, chat: bool, system: str | None, stops: list[str], n_predict: int, json_out: bool, err
) -> int:
    def warn(msg: str) -> None:
        err.print(f"specrun: warning: {msg}", style="yellow")

    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        prompt_tokens = chat_prompt(pair, messages, warn)
    else:
        prompt_tokens = pair.target.tokenize(text, add_special=True, parse_special=True)
    settings = pair.settings_for(opts.settings)
    store = cost_store()
    engine = open_engine(pair, settings, opts.sampler, store, lambda m: err.print(f"specrun: {m}", style="dim"))
    out_tokens: list[int] = []
    pieces: list[str] = []
    broken = False
    stats = RunStats(finish_reason="interrupted")
    with SignalStop() as sig:
        for event in stream_generate(engine, prompt_tokens, n_predict, stop=stops, cancel=sig.event):
            stats = event.stats
            out_tokens.extend(event.tokens)
            pieces.append(event.text)
            if not json_out and event.text and not broken:
                try:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                except BrokenPipeError:
                    broken = True  # the reader is gone (`| head`): stop generating quietly
                    sig.event.set()
    store.save(pair.cost_key, engine.learned())
    if json_out:
        print_json({"text": "".join(pieces), "tokens": out_tokens, "finish_reason": stats.finish_reason, "stats": stats.to_json()})
    elif not broken:
        try:
            sys.stdout.write("\n")
            sys.stdout.flush()
        except BrokenPipeError:
            broken = True
    err.print(summary_line(stats), style="dim", soft_wrap=True)
    if broken:
        silence_stdout()
        return 0
    if stats.finish_reason == "interrupted" and sig.signum is not None:
        return sig.exit_code()
    return 0
