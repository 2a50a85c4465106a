"""The `specrun` command: the one place errors become messages and exit codes.

Exit codes: 0 ok; 1 valid request that cannot be satisfied (incompatible pair, does not fit,
prompt longer than the context); 2 usage error; 3 an input cannot be read (missing file,
directory, not GGUF, truncated or corrupt GGUF, unknown model or alias, invalid registry);
130 interrupted (SIGINT); 143 terminated (SIGTERM). SPECRUN_DEBUG=1 shows tracebacks.
"""

from __future__ import annotations

import functools
import os
import sys

import typer

try:  # typer >= 0.2x vendors click as typer._click; older ones depend on click itself
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover
    from click import exceptions as _cx

from specrun.cli.common import silence_stdout
from specrun.cli.options import flag_name
from specrun.errors import EXIT_FAIL, EXIT_SIGINT, EXIT_USAGE, SpecrunError
from specrun.fit.rpc import on_fatal

HELP = """Speculative decoding for local GGUF models: check a target/draft pair before
loading, then run it faster, with live numbers on how much speculation helps.

Exit codes: 0 ok; 1 incompatible pair, does not fit, or prompt too long; 2 usage error;
3 unreadable input (missing or corrupt GGUF, unknown model, invalid registry);
130 interrupted; 143 terminated. Set SPECRUN_DEBUG=1 to see tracebacks.
"""

app = typer.Typer(
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _register() -> None:
    """Attach the commands to `app`, once: main() may run many times in one process."""
    if app.registered_commands:
        return
    from specrun.cli import bench, chat, check_pair, costs, devices, doctor, drafts, generate, inspect_cmd, models, pull, serve, worker

    for mod in (models, inspect_cmd, check_pair, drafts, pull, generate, chat, bench, serve, costs, doctor, devices, worker):
        mod.register(app)


@functools.cache
def _command() -> typer.core.TyperGroup:
    """The click command tree, built once (building it is most of a header-only command's time
    in-process)."""
    _register()
    cmd = typer.main.get_command(app)
    assert isinstance(cmd, typer.core.TyperGroup)
    return cmd


def debug() -> bool:
    return os.environ.get("SPECRUN_DEBUG", "") not in ("", "0")


def fail(message: str, code: int) -> int:
    try:
        sys.stderr.write(f"specrun: error: {message}\n")
        sys.stderr.flush()
    except (BrokenPipeError, OSError):
        pass
    return code


def die(err: SpecrunError) -> None:
    """llama.cpp is about to abort the process (an RPC worker was lost mid-run): flush what was
    printed, say why in one line, and exit with the error's code before the abort can."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass
    fail(err.render(flag_name), err.exit_code)
    os._exit(err.exit_code)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    on_fatal(die)
    cmd = _command()
    try:
        rv = cmd.main(args=argv, prog_name="specrun", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except SpecrunError as e:
        if debug():
            raise
        return fail(e.render(flag_name), e.exit_code)
    except typer.Exit as e:
        return e.exit_code
    except _cx.ClickException as e:  # usage errors from the option parser
        if debug():
            raise
        msg = e.format_message()
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `specrun`: show the help
            print(msg)
            return 0
        ctx = getattr(e, "ctx", None)
        hint = f"; see `{ctx.command_path} --help`" if ctx is not None else "; see `specrun --help`"
        return fail(msg.replace("\n", " ").rstrip(". ") + hint, EXIT_USAGE if e.exit_code == 2 else e.exit_code)
    except typer.Abort:
        return fail("interrupted", EXIT_SIGINT)
    except KeyboardInterrupt:
        return fail("interrupted", EXIT_SIGINT)
    except BrokenPipeError:
        silence_stdout()
        return 0
    except Exception as e:
        if debug():
            raise
        return fail(f"internal error: {type(e).__name__}: {e} (run with SPECRUN_DEBUG=1 for a traceback)", EXIT_FAIL)


def run() -> None:
    code = main()
    try:
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        silence_stdout()
    sys.exit(code)
