"""Request bodies as pydantic models, and the OpenAI-shaped error.

A field of the wrong type or out of range fails validation with the field's JSON path
(``param``); a request that is well-formed but cannot be served (``n > 1``, a prompt longer
than the context, tools for a template that has none) is refused by the handler with the
field it is about. Fields that OpenAI clients send routinely and that change nothing here
(``store``, ``metadata``...) are accepted and ignored (``user`` only says whose earlier replies a
request may draft from); fields that would change
the answer and are not implemented are refused out loud, never silently dropped.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "SPECULATIVE", "ApiError", "ChatRequest", "CompletionRequest", "Message", "Prediction", "Speculative", "StreamOptions", "param_of",
]  # fmt: skip

MAX_STOP_CHARS = 1000  # a stop string is held back while the text could be its start: keep that short


class ApiError(Exception):
    """An HTTP error with an OpenAI-shaped body: ``{"error": {message, type, param, code}}``."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
             422: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 500: "server_error"}  # fmt: skip

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# The core's drafting settings under llama-server's names for them in a request's
# ``speculative`` object (``fixed`` is specrun's own): the one table between the two.
SPECULATIVE = {"draft_max": "n_max", "draft_min": "n_min", "p_min": "p_min", "fixed": "fixed"}


class Speculative(_Body):
    """llama-server's per-request drafting object (see SPECULATIVE for the core's names)."""

    n_max: Optional[int] = Field(None, ge=1, le=256, description="most draft tokens per round (draft_max)")
    n_min: Optional[int] = Field(None, ge=0, le=256, description="shorter drafts are dropped (draft_min)")
    p_min: Optional[float] = Field(None, ge=0.0, le=1.0, description="the draft model stops below this confidence (fixed mode)")
    fixed: Optional[bool] = Field(None, description="turn the adaptive chooser off for this request")


class StreamOptions(_Body):
    include_usage: bool = False
    include_drafts: bool = False  # specrun's: each chunk says which of its text came from accepted drafts (docs/serve.md)


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class FunctionCall(_Body):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"  # JSON text, as OpenAI sends it (an object is taken too)


class ToolCallIn(_Body):
    """A call the assistant made, sent back in the history."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef

    def for_template(self) -> dict:
        """OpenAI's tool object, as chat templates iterate over it."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None

    def for_template(self, where: str) -> dict:
        """The message as chat templates take it: ``developer`` is the newer ``system``; a
        call's arguments are an object (templates write them with ``tojson``)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text(where)}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id or f"call_{i}",
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for i, c in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self, where: str) -> str:
        """The message's text; parts other than text are refused (no vision here)."""
        return _text(self.content, f"{where}.content")


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    """Content as one text: a string, or text parts joined; other parts are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for i, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"content parts of type {part.type!r} are not supported: this server takes text only", f"{where}[{i}].type")
        out.append(part.text)
    return "".join(out)


class Prediction(_Body):
    """OpenAI's Predicted Outputs: text the reply is expected to mostly be (a file sent back with
    an edit), drafted from; the reply is the same with or without it."""

    type: Literal["content"]
    content: Union[str, list[ContentPart]]

    def text(self) -> str:
        return _text(self.content, "prediction.content")


def _arguments(arguments: str | dict) -> Any:
    """A call's arguments as an object when they are JSON text of one, else as given."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class _Generation(_Body):
    """What chat and completion requests share."""

    model: Optional[str] = Field(None, description="the served model's name or an alias; omit for the served model")
    max_tokens: Optional[int] = Field(None, ge=1, description="most tokens to generate (default: up to the context)")
    temperature: Optional[float] = Field(None, ge=0.0, description="0 is greedy")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0, description="llama.cpp's extra; 0 disables")
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0, description="llama.cpp's extra; 0 disables")
    seed: Optional[int] = Field(None, ge=-1, description="-1 or absent: a fresh random seed (as in llama-server)")
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1)
    speculative: Optional[Speculative] = None
    draft: Optional[Literal["model", "ngram", "mtp", "eagle3", "dflash", "hybrid", "none"]] = Field(
        None, description="the drafter for this request"
    )
    prediction: Optional[Prediction] = None
    user: Optional[str] = Field(None, max_length=256, description="who the request is for: its own earlier replies are drafted from")
    # accepted but refused unless they are their no-op value (see check_unsupported)
    logprobs: Union[bool, int, None] = None
    top_logprobs: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        items = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(items) > 16:
            raise ApiError(400, f"at most 16 stop strings, got {len(items)}", "stop")
        longest = max((len(s) for s in items), default=0)
        if longest > MAX_STOP_CHARS:
            raise ApiError(400, f"a stop string has {longest} characters; at most {MAX_STOP_CHARS}", "stop")
        return [s for s in items if s]

    def check_unsupported(self) -> None:
        """Refuse, naming the field, what would change the answer and is not implemented."""
        if self.n != 1:
            raise ApiError(400, f"n must be 1 (one choice per request), got {self.n}: send the request {self.n} times instead", "n")
        if self.logprobs or self.top_logprobs:
            raise ApiError(400, "logprobs are not supported by this server", "logprobs" if self.logprobs else "top_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported by this server (only 0 or absent)", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported by this server", "logit_bias")

    def predicted(self) -> str | None:
        """The prediction's text (None: none, or an empty one); non-text parts are refused."""
        return (self.prediction.text() or None) if self.prediction is not None else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def include_drafts(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_drafts)


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="the newer name of max_tokens")
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None

    def limit(self) -> tuple[int | None, str]:
        """The token limit asked for, and the field it came from."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tool_choice is not None and self.tool_choice not in ("none", "auto"):
            what = repr(self.tool_choice) if isinstance(self.tool_choice, str) else "naming a function"
            raise ApiError(400, f'tool_choice {what} is not supported: send "auto" (the model decides) or "none"', "tool_choice")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ApiError(
                400, f'response_format {self.response_format.get("type")!r} is not supported (only "text")', "response_format.type"
            )

    def conversation(self) -> list[dict]:
        """Messages as the chat template takes them."""
        return [m.for_template(f"messages[{i}]") for i, m in enumerate(self.messages)]

    def calling(self) -> list[dict] | None:
        """The tools the model may call (None: none, or ``tool_choice`` "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.for_template() for t in self.tools]


class CompletionRequest(_Generation):
    prompt: Union[str, list[str], list[int]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def limit(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported by this server", "echo")
        if self.suffix:
            raise ApiError(400, "suffix (fill-in-the-middle) is not supported by this server", "suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of must be 1", "best_of")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ApiError(400, f"one prompt per request, got {len(self.prompt)}", "prompt")
        if not self.prompt or self.prompt == [""]:
            raise ApiError(400, "the prompt is empty", "prompt")

    def prompt_text(self) -> str | None:
        """The prompt as text, or None when it was given as token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        if self.prompt and isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return None


def param_of(err: ValidationError) -> tuple[str, str]:
    """The JSON path of the first failing field (``messages[0].content``) and a message."""
    e = err.errors()[0]
    path = ""
    for part in e.get("loc", ()):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[ContentPart]", "function-after", "literal") or "[" in str(part):
            continue  # union branches pydantic names by their type
        else:
            path += f".{part}" if path else str(part)
    msg = e.get("msg", "invalid value")
    where = path or "body"
    return where, f"{where}: {msg}" + (f" (got {_short(e['input'])})" if "input" in e and e.get("type") != "missing" else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
