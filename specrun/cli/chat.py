"""`specrun chat`: a multi-turn chat with a live speculation status line."""

from __future__ import annotations

import signal
import sys
from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.live import Live
from rich.text import Text

from ..chat import ChatSession
from ..display import stats_table, status_line, summary_line
from ..errors import SpecrunError
from ..sampling import Sampler
from ..text import Utf8Stream
from .common import (
    CtxOpt, DraftMaxOpt, DraftMinOpt, DraftModelOpt, DraftModeOpt, FixedOpt, GpuLayersDraftOpt,
    GpuLayersOpt, MinPOpt, NgramMaxOpt, NgramMinOpt, TieMarginOpt, NPredictOpt, PSplitOpt, RegistryOpt, SeedOpt,
    SignalStop, TargetOpt, TempOpt, ThreadsOpt, TopKOpt, TopPOpt, VerboseOpt, check_range,
    default_threads, load_registry, stderr, stdout,
)
from .generate import build_settings, model_template, prepare_engine, resolve_models

HELP_TEXT = """commands:
  /stats          this session's numbers, with acceptance per draft position
  /reset          forget the conversation and clear the KV cache
  /system TEXT    set the system prompt (starts a new conversation)
  /save FILE      write the transcript and stats as JSON
  /help           this help
  /quit           leave (Ctrl-D too); Ctrl-C stops a reply and keeps the session"""


class _Terminated(Exception):
    """SIGTERM while waiting for input."""


def register(app: typer.Typer) -> None:
    @app.command("chat")
    def chat(
        model: TargetOpt,
        draft_model: DraftModelOpt = None,
        system: Annotated[Optional[str], typer.Option("--system", help="System prompt.", show_default=False)] = None,
        n_predict: NPredictOpt = 1024,
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
        verbose: VerboseOpt = False,
    ) -> int:
        """Chat with a model, speculatively. Replies stream with a live line showing tokens/s,
        acceptance, mean accepted length, draft length and the draft/verify split. The KV
        cache is kept between turns. Type /help for commands; Ctrl-C stops a reply, Ctrl-D or
        /quit leaves (exit 0). SIGTERM exits 143."""
        check_range("-n/--n-predict", n_predict, 1)
        check_range("-c/--ctx", ctx, 16, 1 << 24)
        check_range("-t/--threads", threads, 1, 1024)
        sampler = Sampler(temp, top_k, top_p, min_p, seed)
        reg = load_registry(registry)
        target, dm = resolve_models(reg, model, draft_model, draft)
        settings = build_settings(draft, draft_max, draft_min, draft_p_split, fixed, ngram_min, ngram_max, dm is not None, tie_margin)
        err = stderr()
        from ..session import PairConfig, open_pair  # loads llama_cpp: only when chatting

        pair = open_pair(target.path, dm.path if dm else None, PairConfig(ctx, gpu_layers, gpu_layers_draft, threads, verbose))
        try:
            for n in pair.notices:
                err.print(f"specrun: {n}", style="dim")
            engine, store = prepare_engine(pair, settings, sampler, err)
            try:
                return Repl(pair, engine, system, n_predict, err).run()
            finally:
                store.save(pair.cost_key, engine.cost)
        finally:
            pair.close()


class Repl:
    def __init__(self, pair, engine, system, n_predict: int, err):
        self.pair = pair
        self.err = err
        self.out = stdout()
        self.tty = sys.stdout.isatty()
        self.interactive = sys.stdin.isatty()
        self.n_predict = n_predict
        self.warned: set[str] = set()
        self.session = ChatSession(engine, model_template(pair), system, self.warn)
        self.exit_code = 0

    def warn(self, msg: str) -> None:
        if msg not in self.warned:  # a broken template would warn on every turn
            self.warned.add(msg)
            self.err.print(f"specrun: warning: {msg}", style="yellow")

    def read(self) -> str | None:
        # a blocked read is retried after a signal handler returns (PEP 475), so SIGTERM at the
        # prompt must raise to end the session now rather than after the next line
        def on_term(signum, frame):
            self.sig.signum = signum
            raise _Terminated()

        old = signal.signal(signal.SIGTERM, on_term)
        try:
            if self.interactive:
                try:
                    import readline  # noqa: F401  line editing and history for input()
                except ImportError:
                    pass
                self.at_prompt = True
                try:
                    return input("> ")
                finally:
                    self.at_prompt = False
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line.rstrip("\n")
        finally:
            signal.signal(signal.SIGTERM, old)

    def _watch_sigterm(self) -> None:
        """A SIGTERM that lands between readline's signal check and its select() is only seen
        after the next keystroke (a race in readline's input loop). Signals also write their
        number to a wakeup pipe; this thread reads it and, while the prompt is waiting, prints
        the session summary and exits 143 itself. During a reply the engine's flag handles it."""
        import os
        import threading

        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            signal.set_wakeup_fd(w)
        except ValueError:  # not the main thread: rely on the handlers alone
            return

        def watch():
            while True:
                data = os.read(r, 64)
                if not data:
                    return
                if signal.SIGTERM in data and self.at_prompt:
                    try:
                        self.err.print()
                        self.err.print(summary_line(self.session.totals, label="session: "), style="dim", soft_wrap=True)
                        sys.stderr.flush()
                    finally:
                        os._exit(143)

        threading.Thread(target=watch, name="sigterm-watch", daemon=True).start()

    def run(self) -> int:
        self.at_prompt = False
        if self.interactive:
            self._watch_sigterm()
        if self.interactive:
            self.err.print(f"specrun chat: {self.pair.target_info.name}" + (f" + {self.pair.draft_info.name}" if self.pair.draft_info else "") + ". /help for commands, Ctrl-D to leave.", style="dim")
        with SignalStop() as sig:
            self.sig = sig
            # Ctrl-C outside a reply is a KeyboardInterrupt (cancel the line), not a stop flag
            signal.signal(signal.SIGINT, signal.default_int_handler)
            while sig.signum is None:  # until SIGTERM (a reply clears its own Ctrl-C)
                try:
                    line = self.read()
                    if line is None:
                        break
                    if not line.strip():
                        continue
                    if line.startswith("/"):
                        if self.command(line.strip()) == "quit":
                            break
                        continue
                    self.reply(line)
                except (EOFError, _Terminated):
                    if self.interactive:
                        self.out.print()  # end the prompt's line
                    break
                except KeyboardInterrupt:  # at the prompt, or in a command: the session goes on
                    self.out.print()
        self.err.print(summary_line(self.session.totals, label="session: "), style="dim", soft_wrap=True)
        if sig.signum is not None and sig.signum != signal.SIGINT:
            return sig.exit_code()
        return 0

    def command(self, line: str) -> str | None:
        cmd, _, arg = line.partition(" ")
        arg = arg.strip()
        if cmd in ("/quit", "/exit", "/q"):
            return "quit"
        if cmd == "/help":
            self.out.print(HELP_TEXT, markup=False, highlight=False)
        elif cmd == "/stats":
            self.out.print(stats_table(self.session.totals))
        elif cmd == "/reset":
            self.session.reset()
            self.out.print("conversation cleared (KV cache reset)", style="dim")
        elif cmd == "/system":
            self.session.set_system(arg or None)
            self.out.print(f"system prompt {'set' if arg else 'cleared'}; new conversation", style="dim")
        elif cmd == "/save":
            if not arg:
                self.out.print("usage: /save FILE", style="yellow")
            else:
                try:
                    p = self.session.save(arg)
                    self.out.print(f"saved {p}", style="dim")
                except SpecrunError as e:
                    self.out.print(f"error: {e}", style="red")
        else:
            self.out.print(f"unknown command {cmd}; /help lists them", style="yellow")
        return None

    def reply(self, text: str) -> None:
        target = self.pair.target
        sig = self.sig
        if sig.signum is not None:  # SIGTERM came after the line was read: no new reply
            return
        sig.event.clear()
        # Ctrl-C now stops the reply after this round; it stays so until the turn's last line
        # is printed, so a late Ctrl-C cannot cut the summary off
        old = signal.signal(signal.SIGINT, sig._handler)
        try:
            stats = self._stream(text, target)
            if sig.signum == signal.SIGINT and (stats is None or stats.finish_reason == "interrupted"):
                self.err.print("(reply stopped; the session continues)", style="yellow")
            if stats is None:
                return
            if stats.finish_reason == "context":
                self.err.print(f"(the context is full at {target.n_ctx} tokens: the reply was cut. /reset starts a new conversation, or restart with a larger -c)", style="yellow")
            self.err.print(summary_line(stats), style="dim", soft_wrap=True)
        finally:
            signal.signal(signal.SIGINT, old)
            if sig.signum == signal.SIGINT:  # Ctrl-C stops this reply, never the session
                sig.signum = None

    def _stream(self, text: str, target):
        """Print the reply as it comes; returns the turn's stats (None if it never started)."""
        stream = Utf8Stream()
        stats = None
        try:
            gen = self.session.send(text, self.n_predict, self.sig.event)
            if self.tty:
                return self._live(gen, stream, target)
            for step in gen:
                stats = step.stats
                sys.stdout.write(stream.feed(b"".join(target.piece(t) for t in step.tokens if not target.is_eog(t))))
                sys.stdout.flush()
            sys.stdout.write(stream.flush() + "\n")
            sys.stdout.flush()
        except SpecrunError as e:
            self.err.print(f"specrun: error: {e}", style="red")
        return stats

    def _live(self, gen, stream: Utf8Stream, target):
        """Completed lines print above a live region holding the current line and the status."""
        stats = None
        line = ""
        with Live(console=self.out, refresh_per_second=8, transient=True) as live:
            for step in gen:
                stats = step.stats
                line += stream.feed(b"".join(target.piece(t) for t in step.tokens if not target.is_eog(t)))
                while "\n" in line:
                    done, line = line.split("\n", 1)
                    live.console.print(Text(done), soft_wrap=True)
                live.update(Group(Text(line), status_line(stats)))
        line += stream.flush()
        self.out.print(Text(line), soft_wrap=True)
        return stats
