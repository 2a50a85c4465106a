"""Chat templates from GGUF files, rendered in a sandbox.

A GGUF file's ``tokenizer.chat_template`` is Jinja code written by whoever made the file. It
is rendered only in Jinja's ImmutableSandboxedEnvironment: no filesystem loader, no imports,
no access to private or mutating attributes, ``range`` capped, a time limit (on the main
thread, where signals can interrupt it) and a cap on the output size. Operators, calls and
filters that could build a huge value in one C call (``10 ** 10 ** 9``, ``'x' * 10 ** 10``,
``'x' | center(10 ** 10)``), where neither the time limit nor the output cap can reach, are
checked before they run, and kept out of Jinja's compile-time constant folding, which would
run them before any limit is in place. A template that raises, loops or reaches for what it
should not gives a :class:`TemplateError`; callers fall back to a plain ChatML-style format
with a warning.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_OUTPUT_CHARS = 4_000_000
TIME_LIMIT_S = 2.0
MAX_RANGE = 10_000
MAX_INT_BITS = 100_000  # about 30,000 decimal digits
MAX_ARG_INT = 100_000  # widths, counts and indents passed to filters and methods


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


def _check_size(n: int, what: str) -> None:
    if n > MAX_OUTPUT_CHARS:
        raise TemplateError(f"template tried to build {what} of {n} items (limit {MAX_OUTPUT_CHARS})")


def _check_args(values) -> None:
    """No chat template needs a width, count or indent this large."""
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_ARG_INT:
            raise TemplateError(f"template passed {v} as an argument (limit {MAX_ARG_INT})")
        if isinstance(v, str):
            _check_size(len(v), "an argument")


def _check_format(fmt: str, args=()) -> None:
    """printf- and str.format-style widths: digits in the format string, or arguments where
    the format takes them from there (``%*d``, ``{:>{}}``)."""
    _check_args([int(d) for d in re.findall(r"\d{6,}", fmt)])
    if "*" in fmt or re.search(r"\{[^{}]*\{", fmt):
        _check_args(args if isinstance(args, tuple) else (args,))
    else:
        _check_args([a for a in (args if isinstance(args, tuple) else (args,)) if isinstance(a, str)])


def _str_len(x) -> int:
    return len(x) if isinstance(x, str) else 0


def _check_replace(s: str, old, new) -> None:
    old, new = str(old), str(new)
    hits = s.count(old) if old else len(s) + 1
    _check_size(len(s) + hits * len(new), "a replacement")


def _check_join(items: list, sep) -> None:
    _check_size(sum(map(_str_len, items)) + _str_len(sep) * len(items), "a joined string")


# str methods a template may call; others (translate, expandtabs, encode...) are refused
STR_METHODS = frozenset(
    "strip lstrip rstrip split rsplit splitlines startswith endswith upper lower title capitalize "
    "swapcase casefold find rfind index rindex count partition rpartition removeprefix removesuffix "
    "isalpha isdigit isalnum isspace islower isupper isnumeric isdecimal istitle replace join format "
    "ljust rjust center zfill".split()
)


class _CodeGenerator(CodeGenerator):
    def visit_Concat(self, node, frame):  # ``a ~ b``: sized before it is built
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    """Every value the template builds stays under MAX_OUTPUT_CHARS, checked before the C code
    that would build it runs. Intercepted operators are also never constant-folded."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def checked_concat(self, parts) -> str:
        parts = [str(p) for p in parts]
        _check_size(sum(map(len, parts)), "a string")
        return "".join(parts)

    def call_binop(self, context, operator, left, right):
        if operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right * left.bit_length() > MAX_INT_BITS:
                raise TemplateError(f"template asked for a {right * left.bit_length()}-bit number (limit {MAX_INT_BITS})")
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                    _check_size(len(seq) * n, "a sequence")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateError(f"template multiplied numbers larger than {MAX_INT_BITS} bits")
        elif operator == "+":
            if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
                _check_size(len(left) + len(right), "a sequence")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        method = getattr(__obj, "__wrapped__", __obj)  # Jinja wraps str.format in its own sandbox
        owner = getattr(method, "__self__", None)
        name = getattr(method, "__name__", "") if isinstance(owner, str) else None
        if name == "format":
            _check_format(owner, (*args, *kwargs.values()))
        else:
            _check_args((*args, *kwargs.values()))
        if name is not None:
            if name not in STR_METHODS:
                raise jinja2.exceptions.SecurityError(f"str.{name}() is not allowed in a chat template")
            if name == "replace" and len(args) >= 2:
                _check_replace(owner, args[0], args[1])
            elif name == "join" and args:
                args = (list(args[0]), *args[1:])
                _check_join(args[0], owner)
        return super().call(__context, __obj, *args, **kwargs)


def _guard_filter(name: str, f):
    """Filter arguments are bounded like call arguments; the filters that can multiply their
    input (replace, join, indent, format) are sized before they run."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # (context,) value, args...

    @functools.wraps(f)
    def guarded(*args, **kwargs):
        value, rest = args[skip - 1] if len(args) >= skip else None, args[skip:]
        if name == "format" and isinstance(value, str):
            _check_format(value, (*rest, *kwargs.values()))
        else:
            _check_args((*rest, *kwargs.values()))
        if name == "replace" and isinstance(value, str) and len(rest) >= 2:
            _check_replace(value, rest[0], rest[1])
        elif name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            per_line = width if isinstance(width, int) else _str_len(width)
            _check_size(len(value) + (value.count("\n") + 1) * per_line, "an indented string")
        elif name == "join" and value is not None:
            items = list(value)
            _check_join(items, rest[0] if rest else kwargs.get("d", ""))
            args = (*args[: skip - 1], items, *rest)
        return f(*args, **kwargs)

    return guarded


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False) -> str:
    """``tojson`` as Hugging Face's template runner defines it (the one templates are written
    for): keys in their order, no HTML escaping, Unicode as is."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    _check_format(fmt)
    return datetime.datetime.now().strftime(fmt[:100])


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(loader=None, autoescape=False, trim_blocks=True, lstrip_blocks=True)
    env.globals = {"range": _safe_range, "raise_exception": _raise, "namespace": env.globals["namespace"], "strftime_now": _strftime_now}
    env.filters.pop("attr", None)
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    return env


@dataclass(frozen=True)
class ChatTemplate:
    source: str | None
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """Render with the model's template (``tools``: OpenAI's tool objects, for a template
        that shows them to the model); raises TemplateError on any failure."""
        if not self.source:
            raise TemplateError("the model has no chat template")
        env = _environment()
        try:
            with _time_limit(TIME_LIMIT_S):  # compiling runs template code too (constant folding)
                tmpl = env.from_string(self.source)
                out = []
                size = 0
                for chunk in tmpl.generate(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                    tools=tools or None,
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


PROBE_TOOL = "specrun_probe_tool"


def renders_tools(template: ChatTemplate) -> bool:
    """Whether the template shows the model a tool it is given (as llama.cpp's minja probes
    a template's capabilities: render one, look for its name)."""
    tool = {
        "type": "function",
        "function": {"name": PROBE_TOOL, "description": "a probe", "parameters": {"type": "object", "properties": {}}},
    }
    try:
        return PROBE_TOOL in template.render([{"role": "user", "content": "hi"}], True, [tool])
    except TemplateError:
        return False


def render_chat(
    template: ChatTemplate, messages: list[dict], warn=None, add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> str:
    """The model's template if it works, else the plain format (``warn`` gets the reason).
    With ``tools`` there is no fallback: a template that cannot show them raises TemplateError."""
    try:
        return template.render(messages, add_generation_prompt, tools)
    except TemplateError as e:
        if tools:
            raise
        if warn is not None:
            warn(f"{e}; using a plain ChatML format instead")
        return plain_format(messages, add_generation_prompt)
