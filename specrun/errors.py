"""The few domain exceptions specrun raises, and the exit code each maps to.

Exit codes (documented in the README and in ``specrun --help``):

* 0 - success (for ``check-pair``: compatible and fits)
* 1 - the request is valid but cannot be satisfied (incompatible pair, does not fit,
  prompt longer than the context)
* 2 - usage error (a bad flag or value)
* 3 - an input cannot be read (missing file, not GGUF, corrupt GGUF, unknown model,
  invalid registry, an RPC worker that cannot be reached or is lost mid-run)
* 130 / 143 - interrupted by SIGINT / SIGTERM

The CLI turns these into a one-line message at exactly one place (``specrun.cli.main``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


_SETTING = re.compile(r"\{([a-z][a-z0-9_]*)\}")


class SpecrunError(Exception):
    """Base class: ``str(err)`` is the one-line message shown to the user.

    The core names settings, never flags: a message or fix may write ``{draft_max}`` for a
    setting, and each front end renders it in its own words (the CLI as ``--draft-max``, the
    HTTP server as a JSON field). ``field`` is the setting the error is about, if any.
    """

    exit_code = EXIT_FAIL

    def __init__(self, message: str, fix: str | None = None, field: str | None = None):
        self.message = message
        self.fix = fix
        self.field = field
        super().__init__(self.render())

    def render(self, name_of: Callable[[str], str] = lambda s: s) -> str:
        """The one-line message, with every ``{setting}`` written as ``name_of(setting)``."""
        return render(self.message if not self.fix else f"{self.message}; {self.fix}", name_of)


def render(text: str, name_of: Callable[[str], str] = lambda s: s) -> str:
    """A core message (an error, a notice) with every ``{setting}`` written as ``name_of(setting)``."""
    return _SETTING.sub(lambda m: name_of(m.group(1)), text)


class UsageError(SpecrunError):
    """A flag or value the user gave is invalid."""

    exit_code = EXIT_USAGE


class InputError(SpecrunError):
    """An input (model file, registry, prompt file) cannot be read."""

    exit_code = EXIT_INPUT


class BadModelFile(InputError):
    """A file is not a well-formed GGUF file."""


class UnknownModel(InputError):
    """A model name is neither a registry entry, an alias nor a path."""


class RegistryError(InputError):
    """models.toml is malformed or invalid."""


class IncompatiblePair(SpecrunError):
    """The target and draft cannot be used together."""


class UnsupportedArchitecture(SpecrunError):
    """The installed llama.cpp cannot load a model of this architecture."""


class PromptTooLong(SpecrunError):
    """The prompt does not fit in the context."""


class WorkerUnreachable(InputError):
    """An RPC worker does not answer, or stopped answering."""


class WorkerMismatch(SpecrunError):
    """An RPC worker speaks another version of llama.cpp's RPC protocol."""


class BackendError(SpecrunError):
    """llama.cpp refused to load or run a model."""


class DownloadError(SpecrunError):
    """A download failed or arrived corrupted (and was deleted)."""
