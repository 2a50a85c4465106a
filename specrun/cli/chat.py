"""`specrun chat`: a multi-turn chat with a live speculation status line."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.live import Live
from rich.text import Text

from specrun.cli.common import SignalStop, load_pair, stderr, stdout
from specrun.cli.display import event_text, stats_table, status_line, summary_line
from specrun.cli.options import ALL, Options, flag_name, shared
from specrun.errors import SpecrunError
from specrun.run.chat import ChatSession
from specrun.run.prompt import model_template
from specrun.run.session import cost_store, open_engine
from specrun.run.stream import Event

HELP_TEXT = """commands:
  /stats          this session's numbers, with acceptance per draft position
  /reset          forget the conversation and clear the KV cache
  /system TEXT    set the system prompt (starts a new conversation)
  /save FILE      write the transcript and stats as JSON
  /help           this help
  /quit           leave (Ctrl-D too); Ctrl-C stops a reply and keeps the session"""


CTRL_C_GRACE_S = 0.25  # a Ctrl-C at the prompt not acted on within this is sent again (readline's race)


class _Terminated(Exception):
    """SIGTERM while waiting for input."""


def register(app: typer.Typer) -> None:
    @app.command("chat")
    @shared(ALL)
    def chat(
        opts: Options,
        system: Annotated[Optional[str], typer.Option("--system", help="System prompt.", show_default=False)] = None,
        n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="Most tokens per reply.", min=1)] = 1024,
        show_drafts: Annotated[
            bool,
            typer.Option(
                "--show-drafts/--no-show-drafts",
                help="In a terminal, show tokens that came from accepted drafts in a subtle colour, those from a token tree's "
                "branch other than the first (--tree) in another (off with NO_COLOR too).",
            ),
        ] = True,
    ) -> int:
        """Chat with a model, speculatively. Replies stream with a live line showing tokens/s,
        acceptance, mean accepted length, draft length and the draft/verify split; tokens that
        came from accepted drafts are shown in a subtle colour. The KV cache is kept between
        turns. Type /help for commands; Ctrl-C stops a reply, Ctrl-D or /quit leaves (exit 0).
        SIGTERM exits 143."""
        err = stderr()
        pair = load_pair(opts, err)
        try:
            settings = pair.settings_for(opts.settings)
            store = cost_store()
            engine = open_engine(pair, settings, opts.sampler, store, lambda m: err.print(f"specrun: {m}", style="dim"))
            try:
                return Repl(pair, engine, system, n_predict, err, show_drafts and not os.environ.get("NO_COLOR")).run()
            finally:
                store.save(pair.cost_key, engine.learned())
        finally:
            pair.close()


class Repl:
    def __init__(self, pair, engine, system, n_predict: int, err, show_drafts: bool = False):
        self.pair = pair
        self.show_drafts = show_drafts
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
                self.prompts += 1
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

    def _watch_signals(self) -> None:
        """A signal that lands between readline's signal check and its select() is only seen
        after the next keystroke (a race in readline's input loop). Signals also write their
        number to a wakeup pipe; this thread reads it. A SIGTERM while the prompt is waiting: it
        prints the session summary and exits 143 itself. A Ctrl-C the prompt has not acted on
        within ``CTRL_C_GRACE_S`` (no new prompt since): it sends the main thread the signal
        again, until one lands. During a reply the engine's flag handles both."""
        import os
        import threading

        def again(seen: int) -> None:
            if self.at_prompt and self.prompts == seen:
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

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
                if signal.SIGINT in data and self.at_prompt:
                    timer = threading.Timer(CTRL_C_GRACE_S, again, (self.prompts,))
                    timer.daemon = True
                    timer.start()
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
        self.prompts = 0  # prompts shown so far: a Ctrl-C acted on shows a new one
        if self.interactive:
            self._watch_signals()
        if self.interactive:
            self.err.print(
                f"specrun chat: {self.pair.target_info.name}"
                + (f" + {self.pair.draft_info.name}" if self.pair.draft_info else "")
                + ". /help for commands, Ctrl-D to leave.",
                style="dim",
            )
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
                self.err.print(
                    f"(the context is full at {target.n_ctx} tokens: the reply was cut. /reset starts a new conversation, or restart with a larger -c)",
                    style="yellow",
                )
            self.err.print(summary_line(stats), style="dim", soft_wrap=True)
        finally:
            signal.signal(signal.SIGINT, old)
            if sig.signum == signal.SIGINT:  # Ctrl-C stops this reply, never the session
                sig.signum = None

    def _stream(self, text: str, target):
        """Print the reply as it comes; returns the turn's stats (None if it never started)."""
        stats = None
        try:
            events = self.session.send(text, self.n_predict, self.sig.event)
            if self.tty:
                return self._live(events)
            for event in events:
                stats = event.stats
                sys.stdout.write(event.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()
        except SpecrunError as e:
            self.err.print(f"specrun: error: {e.render(flag_name)}", style="red")
        return stats

    def _live(self, events: Iterator[Event]):
        """Completed lines print above a live region holding the current line and the status."""
        stats = None
        line = Text()
        with Live(console=self.out, refresh_per_second=8, transient=True) as live:
            for event in events:
                stats = event.stats
                line.append_text(event_text(event, self.show_drafts))
                while "\n" in line.plain:
                    cut = line.plain.index("\n")
                    done, line = line[:cut], line[cut + 1 :]
                    live.console.print(done, soft_wrap=True)
                live.update(Group(line, status_line(stats)))
        self.out.print(line, soft_wrap=True)
        return stats
