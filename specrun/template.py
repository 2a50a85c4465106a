"""Chat templates from GGUF files, rendered in a sandbox.

A GGUF file's ``tokenizer.chat_template`` is Jinja code written by whoever made the file. It
is rendered only in Jinja's ImmutableSandboxedEnvironment: no filesystem loader, no imports,
no access to private or mutating attributes, ``range`` capped, a time limit (on the main
thread, where signals can interrupt it) and a cap on the output size. A template that raises,
loops or reaches for what it should not gives a :class:`TemplateError`; callers fall back to
a plain ChatML-style format with a warning.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_OUTPUT_CHARS = 4_000_000
TIME_LIMIT_S = 2.0
MAX_RANGE = 10_000


class TemplateError(Exception):
    pass


class _Timeout(BaseException):  # BaseException: templates cannot swallow it
    pass


@contextmanager
def _time_limit(seconds: float):
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _safe_range(*args):
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise TemplateError(f"template asked for range() of {len(r)} items (limit {MAX_RANGE})")
    return r


def _raise(msg):
    raise TemplateError(f"template raised: {msg}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(loader=None, autoescape=False, trim_blocks=True, lstrip_blocks=True)
    env.globals = {"range": _safe_range, "raise_exception": _raise, "namespace": env.globals["namespace"]}
    env.filters.pop("attr", None)
    return env


@dataclass(frozen=True)
class ChatTemplate:
    source: str | None
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render with the model's template; raises TemplateError on any failure."""
        if not self.source:
            raise TemplateError("the model has no chat template")
        env = _environment()
        try:
            tmpl = env.from_string(self.source)
            with _time_limit(TIME_LIMIT_S):
                out = []
                size = 0
                for chunk in tmpl.generate(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                    tools=None,
                ):
                    size += len(chunk)
                    if size > MAX_OUTPUT_CHARS:
                        raise TemplateError(f"template output exceeds {MAX_OUTPUT_CHARS} characters")
                    out.append(chunk)
                return "".join(out)
        except _Timeout:
            raise TemplateError(f"template ran longer than {TIME_LIMIT_S:g} s") from None
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"template tried something unsafe: {e}") from None
        except (jinja2.exceptions.TemplateError, RecursionError, MemoryError) as e:
            raise TemplateError(f"template failed: {type(e).__name__}: {e}") from None
        except Exception as e:  # a template can raise anything its expressions can
            raise TemplateError(f"template failed: {type(e).__name__}: {e}") from None


def plain_format(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The fallback: ChatML-style turns, which most instruct models at least tolerate."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render_chat(template: ChatTemplate, messages: list[dict], warn=None, add_generation_prompt: bool = True) -> str:
    """The model's template if it works, else the plain format (``warn`` gets the reason)."""
    try:
        return template.render(messages, add_generation_prompt)
    except TemplateError as e:
        if warn is not None:
            warn(f"{e}; using a plain ChatML format instead")
        return plain_format(messages, add_generation_prompt)
