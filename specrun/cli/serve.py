"""`specrun serve`: the pair behind an OpenAI-compatible HTTP API, with a live line per request."""

from __future__ import annotations

import dataclasses
import ipaddress
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text

from specrun.cli.common import load_pair, load_registry, stderr
from specrun.cli.display import request_line
from specrun.cli.options import ALL, Options, flag_name, shared
from specrun.errors import EXIT_SIGINT, EXIT_SIGTERM, UsageError, render
from specrun.run.session import OpenPair, cost_store, open_engine

if TYPE_CHECKING:
    from specrun.decode.engine import Engine
    from specrun.server.suffixes import SuffixCache, Suffixes

MAX_BODY = 4 << 20
# a prompt to time the draft step on before the first client (past its first tokens, as a
# request's is: a step into a nearly empty cache is far slower)
WARM_UP = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n" * 4
SUFFIX_MB = 64.0  # the tenants' earlier replies and the corpus, kept to draft from: ~250,000 tokens (256 bytes each, as counted)


class TerminalView:
    """The host's observer: the running request on a live line (in a terminal), one line per
    finished request above it; ``quiet`` keeps only warnings and errors."""

    def __init__(self, err: Console, quiet: bool):
        self.err, self.quiet = err, quiet
        self.live: Live | None = None
        self.jobs: list = []  # the running requests, in the order they started
        self.waiting = lambda: 0
        self.lock = threading.Lock()

    def __enter__(self) -> TerminalView:
        if not self.quiet and self.err.is_terminal:
            self.live = Live(get_renderable=self._render, console=self.err, refresh_per_second=4, transient=True)
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.stop()

    def _render(self) -> Text:
        jobs = list(self.jobs)
        if not jobs:
            waiting = self.waiting()
            return Text(f"idle{f', {waiting} waiting' if waiting else ''}", style="dim")
        return Text("\n").join(
            request_line(j.label, j.state, j.stats, self.waiting() if i == len(jobs) - 1 else 0) for i, j in enumerate(jobs)
        )

    def print(self, text: Text | str, style: str | None = None) -> None:
        with self.lock:
            self.err.print(text, style=style, soft_wrap=True, highlight=False)

    def started(self, job) -> None:
        with self.lock:
            self.jobs.append(job)

    def progress(self, job) -> None:
        pass  # the live line reads the job's stats when it refreshes

    def finished(self, job) -> None:
        with self.lock:
            if job in self.jobs:
                self.jobs.remove(job)
        if not self.quiet and job.stats is not None:
            self.print(request_line(job.label, job.state, job.stats))
        elif not self.quiet:
            self.print(Text(f"{job.label}  {job.state}", style="dim"))

    def notice(self, text: str) -> None:
        self.print(f"specrun: {text}", style="yellow" if text.startswith(("warning", "internal")) else "dim")


@dataclass(frozen=True)
class SuffixPlan:
    """What the suffix sources keep (``--suffix-mb``, ``--suffix-cache``, ``--suffix-corpus``)."""

    mb: float
    cache: Path | None = None
    corpus: Path | None = None

    def check(self) -> None:
        """Refuse folders that cannot be used, before the models load."""
        from specrun.server import corpus
        from specrun.server.suffixes import SuffixCache

        for given, name in ((self.cache, "suffix_cache"), (self.corpus, "suffix_corpus")):
            if given is not None and self.mb <= 0:
                raise UsageError(
                    f"{{{name}}} needs {{suffix_mb}} above 0 (0 keeps nothing)", f"raise {{suffix_mb}} or leave out {{{name}}}", name
                )
        if self.cache is not None:
            SuffixCache.check(self.cache)
        if self.corpus is not None:
            corpus.check(self.corpus)

    def open(self, pair: OpenPair, say: Callable[[str], None]) -> tuple[Suffixes | None, SuffixCache | None]:
        """The store (None: ``mb`` 0), with the corpus read and the cache loaded, and the cache
        (None: none), already saving."""
        from specrun.models.catalog import fingerprint
        from specrun.server import corpus
        from specrun.server.suffixes import SuffixCache, Suffixes

        if self.mb <= 0:
            return None, None
        store = Suffixes(int(self.mb * 2**20))
        if self.corpus is not None:
            tokenize = lambda text: pair.target.tokenize(text, add_special=False, parse_special=False)  # noqa: E731
            say(render(corpus.load(store, self.corpus, tokenize), flag_name))
        cache = None
        if self.cache is not None:
            cache = SuffixCache(self.cache, fingerprint(pair.target_info), pair.target.n_vocab, lambda m: say(render(m, flag_name)))
            say(render(cache.load(store), flag_name))
            cache.keep_saving(store)
        return store, cache


def exposure_warning(address: str, key: str | None) -> str | None:
    """The warning for a server other machines can reach without a key (None when it is fine)."""
    if key is not None or ipaddress.ip_address(address).is_loopback:
        return None
    return (
        f"warning: listening on {address}, which other machines can reach, with no API key: anyone who can reach this port "
        "can use the models; set SPECRUN_API_KEY or --api-key, or listen on 127.0.0.1"
    )


def register(app: typer.Typer) -> None:
    @app.command("serve")
    @shared(ALL)
    def serve(
        opts: Options,
        host: Annotated[
            str, typer.Option("--host", help="Address to listen on. Anything but loopback needs an API key to be safe.")
        ] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on (0 picks a free one and prints it).")] = 8080,
        api_key: Annotated[
            Optional[str],
            typer.Option(
                "--api-key",
                envvar="SPECRUN_API_KEY",
                show_default=False,
                help="Require Authorization: Bearer KEY on /v1 routes (prefer the SPECRUN_API_KEY variable: flags show in ps).",
            ),
        ] = None,  # fmt: skip
        parallel: Annotated[
            Optional[int],
            typer.Option(
                "--parallel",
                "-np",
                min=0,
                max=64,
                help="Requests that decode together, in one batch per step; 0 (the default): as many as the KV cache fits in memory, up to 4 (1 with MTP heads or recurrent models); 1: one at a time. Greedy output of concurrent requests can then differ from a request's alone where batched kernels move a logit (see docs/serve.md).",
            ),
        ] = 0,
        max_queue: Annotated[
            int,
            typer.Option(
                "--max-queue", min=0, help="Requests that may wait while the --parallel ones run; past that, 429 with Retry-After."
            ),
        ] = 16,
        max_body: Annotated[int, typer.Option("--max-body", min=1024, help="Largest request body in bytes (413 past it).")] = MAX_BODY,
        suffix_mb: Annotated[
            float,
            typer.Option(
                "--suffix-mb",
                min=0.0,
                help="Memory for earlier replies, kept per API key and user to draft the next ones from (the oldest go first), and for the --suffix-corpus; 0: none kept.",
            ),
        ] = SUFFIX_MB,  # fmt: skip
        suffix_cache: Annotated[
            Optional[Path],
            typer.Option(
                "--suffix-cache",
                show_default=False,
                help="Folder to keep the earlier replies in across restarts (saved every 64 replies and at a clean stop, loaded at start; made if missing).",
            ),
        ] = None,  # fmt: skip
        suffix_corpus: Annotated[
            Optional[Path],
            typer.Option(
                "--suffix-corpus",
                show_default=False,
                help="Folder of text files (a repository) that every request drafts from as well, read at start; it takes at most half of --suffix-mb.",
            ),
        ] = None,  # fmt: skip
        quiet: Annotated[
            bool, typer.Option("--quiet", "-q", help="No per-request lines on the terminal (warnings and errors still show).")
        ] = False,
    ) -> int:
        """Serve the pair over an OpenAI-compatible HTTP API (/v1/chat/completions with tool
        calls, /v1/completions, /v1/models, /health, /metrics) and a chat page at /, with
        speculative decoding. Up to --parallel requests decode together (each
        in a sequence of its own, one batch per step), the others wait in arrival order; each
        sequence's KV cache is kept across requests, and a request goes to the one that shares
        the longest prefix with it.

        Exit codes: 143 after SIGTERM, 130 after SIGINT (in-flight streams end first, with
        finish_reason "interrupted"); 1 if the port cannot be bound or the pair cannot be
        used; 2 usage error (a --suffix-cache folder that cannot be written, too); 3 unreadable
        model or registry, or a --suffix-corpus folder that is missing, unreadable or holds no
        text file.
        """
        from specrun.server.run import listen

        err = stderr()
        suffixes = SuffixPlan(suffix_mb, suffix_cache, suffix_corpus)
        suffixes.check()  # before loading, as the port: a bad folder fails in milliseconds
        sock = listen(host, port)  # before loading: a taken port fails in milliseconds
        try:
            opts = dataclasses.replace(opts, pair=dataclasses.replace(opts.pair, parallel=parallel or None))
            pair = load_pair(opts, err)
            released = True
            try:
                signum, released = _serve(pair, opts, sock, api_key or None, max_queue, max_body, suffixes, quiet, err)
            finally:
                if released:  # else the engine thread still holds the models: exit frees them
                    pair.close()
        finally:
            sock.close()
        return EXIT_SIGTERM if signum == signal.SIGTERM else EXIT_SIGINT if signum == signal.SIGINT else 0


def _serve(
    pair: OpenPair, opts: Options, sock: socket.socket, key: str | None, max_queue: int, max_body: int, plan: SuffixPlan, quiet: bool,
    err: Console,
):  # fmt: skip
    """Serve until a signal; returns it, and whether the engine thread has let go of the models."""
    from specrun.llama import on_own_thread
    from specrun.server.app import Served, create_app
    from specrun.server.host import Host
    from specrun.server.metrics import Metrics
    from specrun.server.run import address, serve, signals_held

    where, port = address(sock)
    settings = pair.settings_for(opts.settings)
    store = cost_store()

    def opened() -> Engine:
        engine = open_engine(pair, settings, opts.sampler, store, lambda m: err.print(f"specrun: {m}", style="dim"))
        engine.warm_up(pair.target.tokenize(WARM_UP))  # the first client need not wait for a draft step's timing
        return engine

    # a calibration and the warm-up decode: on a thread that ends, so that the engine threads
    # decode alone (see on_own_thread)
    engine = on_own_thread(opened)
    resolved = load_registry(opts.registry).resolve(opts.model)
    served = Served(
        name=pair.labels[0], aliases=tuple(resolved.entry.aliases) if resolved.entry else (), draft_model=pair.labels[1],
        n_ctx=pair.target.n_ctx, settings=settings, sampler=opts.sampler, api_key=key, max_body=max_body, flag_name=flag_name,
    )  # fmt: skip
    with TerminalView(err, quiet) as view:
        suffixes, cache = plan.open(pair, view.notice)
        host = Host(pair, engine, max_queue=max_queue, observer=view, parallel=pair.parallel, gate=pair.gate, suffixes=suffixes)
        metrics = Metrics(host.queue_length, lambda: len(host.running), suffixes)
        host.on_finish = metrics.observe
        view.waiting = host.queue_length
        host.start()
        url_host = f"[{where}]" if ":" in where else where
        drafts = f" + {pair.labels[1]}" if pair.labels[1] else ""
        per = f", {pair.parallel} in parallel" if pair.parallel > 1 else ""
        view.print(f"specrun serve: {pair.labels[0]}{drafts} (draft {settings.mode}), context {pair.target.n_ctx}{per}", style="dim")
        with signals_held() as held:  # a stop right after "listening" still ends in order
            view.print(f"specrun: listening on http://{url_host}:{port}/v1 ({'API key required' if key else 'no API key'}; Ctrl-C stops)")
            view.print(f"specrun: chat page at http://{url_host}:{port}/", style="dim")
            warning = exposure_warning(where, key)
            if warning:
                view.print(f"specrun: {warning}", style="bold yellow")
            signum = serve(create_app(host, served, metrics), sock, host.stop, held=held)
        released = host.join(timeout=60)
        if cache is not None:
            cache.close()
    store.save(pair.cost_key, host.engine.learned())  # the server's own settings' engine: its costs, copies and near-ties
    err.print("specrun: stopped" + (f" by {signal.Signals(signum).name}" if signum else ""), style="dim")
    return signum, released
