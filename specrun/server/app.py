"""The OpenAI-compatible HTTP API: a thin adapter over the engine host and the stream layer.

Routes (also without the ``/v1`` prefix, for clients configured that way):

* ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` true: server-sent
  events, ``data: [DONE]`` last);
* ``GET /v1/models``, ``GET /v1/models/{id}``;
* ``GET /health`` and ``GET /metrics`` (Prometheus), open even with an API key;
* ``GET /``: the chat page (``page/``, static files; it calls the routes above with the key
  the user types in, and nothing but this origin).

Every error is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status:
400 a body that is not a JSON object as OpenAI requests are (not UTF-8, nested deeper than
64 levels, NaN, numbers past 64 bits, lone surrogates: see body.py) or a request that cannot
be served (``n > 1``, a prompt longer than the context, tools for a template without them),
401 a missing or wrong key, 404 an unknown model or route, 413 a body over ``max_body``, 422
a field of the wrong type or out of range, 429 the queue is full (with ``Retry-After``), 503
the server is stopping. Messages name the JSON field, never a flag.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specrun.decode.engine import Settings
from specrun.decode.sampling import Sampler
from specrun.decode.stats import RunStats
from specrun.errors import SpecrunError, UsageError
from specrun.run.prompt import model_template
from specrun.run.stream import Event
from specrun.run.template import TemplateError, render_chat, renders_tools
from specrun.run.toolcalls import CallDelta, ToolCallParser, parse_tool_calls, tool_format
from specrun.server.body import load_object
from specrun.server.host import Busy, Host, Job, Request, ShuttingDown, Start
from specrun.server.metrics import CONTENT_TYPE, Metrics
from specrun.server.schemas import SPECULATIVE, ApiError, ChatRequest, CompletionRequest, param_of
from specrun.server.suffixes import tenant

_Req = TypeVar("_Req", ChatRequest, CompletionRequest)

__all__ = ["Served", "create_app", "finish_reason", "timings", "usage"]

# core settings as a request names them (the rest are the server's own flags)
SAME_NAME = ("temperature", "top_k", "top_p", "min_p", "seed", "prompt", "max_tokens")
PARAMS = {setting: f"speculative.{name}" for setting, name in SPECULATIVE.items()} | {s: s for s in SAME_NAME} | {"mode": "draft"}
# specrun's finish reasons as OpenAI's (a full context is "length", as in llama-server);
# "interrupted" (the server is stopping) has no OpenAI word and keeps its own
FINISH = {"stop": "stop", "stop_string": "stop", "length": "length", "context": "length", "interrupted": "interrupted"}


@dataclass(frozen=True)
class Served:
    """What the server serves and how: the model's names and the request defaults."""

    name: str  # the target's registry name (or file name)
    aliases: tuple[str, ...] = ()
    draft_model: str | None = None  # the draft model's name (the drafting mode is settings.mode)
    n_ctx: int = 0
    settings: Settings = field(default_factory=Settings)
    sampler: Sampler = field(default_factory=Sampler)
    api_key: str | None = None
    max_body: int = 4 << 20
    flag_name: Callable[[str], str] = lambda s: s  # a server setting as its flag, for messages
    created: int = field(default_factory=lambda: int(time.time()))

    def accepts(self, model: str) -> bool:
        return model in (self.name, *self.aliases)


def finish_reason(reason: str | None) -> str:
    return FINISH.get(reason or "interrupted", "stop")


def timings(s: RunStats) -> dict:
    """llama-server's ``timings`` object for one request."""

    def per(n: float, seconds: float) -> float:
        return round(n / seconds, 3) if seconds > 0 else 0.0

    return {
        "cache_n": s.n_cached_tokens,
        "prompt_n": s.n_prompt_tokens,
        "prompt_ms": round(s.prompt_s * 1e3, 3),
        "prompt_per_token_ms": round(s.prompt_s * 1e3 / s.n_prompt_tokens, 3) if s.n_prompt_tokens else 0.0,
        "prompt_per_second": per(s.n_prompt_tokens, s.prompt_s),
        "predicted_n": s.n_generated,
        "predicted_ms": round(s.wall_s * 1e3, 3),
        "predicted_per_token_ms": round(s.wall_s * 1e3 / s.n_generated, 3) if s.n_generated else 0.0,
        "predicted_per_second": per(s.n_generated, s.wall_s),
        "draft_n": s.n_drafted,
        "draft_n_accepted": s.n_accepted,
    }


def usage(start: Start, s: RunStats) -> dict:
    """OpenAI's ``usage``. The prediction-token details are about the request's ``prediction``
    (0 and 0 without one): its tokens the reply wrote where the prediction had them, and the
    rest of its tokens, so the two add up to the prediction's length (what speculation drafted
    and accepted overall is in ``timings``)."""
    followed = s.n_prediction_followed
    return {
        "prompt_tokens": start.n_prompt,
        "completion_tokens": s.n_generated,
        "total_tokens": start.n_prompt + s.n_generated,
        "prompt_tokens_details": {"cached_tokens": s.n_cached_tokens},
        "completion_tokens_details": {"accepted_prediction_tokens": followed, "rejected_prediction_tokens": s.n_predicted - followed},
    }


# the chat page (specrun/server/page): static files, served as they are
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8"}
# the page talks to this origin only: scripts, styles and fetches from here, nothing else, no framing
PAGE_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _page(name: str) -> Response:
    body = resources.files("specrun.server").joinpath("page").joinpath(name).read_bytes()
    headers = {"Content-Security-Policy": PAGE_POLICY, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
               "Cache-Control": "no-cache"}  # fmt: skip
    return Response(body, media_type=PAGE_FILES[name], headers=headers)


def drafted(event: Event, spans: bool = True) -> dict:
    """specrun's extension of a stream chunk (``stream_options.include_drafts``): the chunk's
    text as runs of ``[text, source]`` (the draft source's name, "model", "ngram", "prediction"...,
    for text from accepted drafts, null for the target's own tokens; the texts join to the
    chunk's content; a third item, "branch", where the drafts were a token tree's branch other
    than the first), and the request's statistics so far."""
    s = event.stats
    runs = [[text, source, "branch"] if branch else [text, source] for text, source, branch in event.segments]
    out: dict[str, Any] = {"spans": runs} if spans else {}
    out["stats"] = {
        "generated": s.n_generated, "tok_s": round(s.generation_tps, 2), "drafted": s.n_drafted, "accepted": s.n_accepted,
        "by_source": {k: {"rounds": v[0], "drafted": v[1], "accepted": v[2]} for k, v in sorted(s.by_source.items())},
        "tree_rounds": s.n_tree_rounds, "tree_nodes": s.n_tree_nodes, "branch_wins": s.n_branch_wins,
    }  # fmt: skip
    return out


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413, by Content-Length or as it streams in."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = ApiError(
            413, f"the request body is over the server's limit of {self.limit} bytes (--max-body)", None, "request_too_large"
        )
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _error_response(too_big)(scope, receive, send)
        seen = 0
        started = False

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooBig()
            return msg

        async def tracked(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counted, tracked)
        except _TooBig:
            if not started:
                await _error_response(too_big)(scope, receive, send)


class _TooBig(Exception):
    pass


class Api:
    """What the routes share: the engine host, what is served, its chat template, the key."""

    def __init__(self, host: Host, served: Served, metrics: Metrics):
        self.host, self.served, self.metrics = host, served, metrics
        self.template = model_template(host.pair)
        self.shows_tools = renders_tools(self.template)  # on the main thread, where the template's time limit applies
        self.call_format = tool_format(self.template.source) if self.shows_tools else None
        self.key = served.api_key.encode() if served.api_key else None

    def name_of(self, setting: str) -> str:
        return PARAMS.get(setting) or f"the server's {self.served.flag_name(setting)}"

    def api_error(self, e: BaseException, status: int = 400) -> ApiError:
        if isinstance(e, ApiError):
            return e
        if isinstance(e, ShuttingDown):
            return ApiError(503, "the server is shutting down", None, "shutting_down")
        if isinstance(e, SpecrunError):
            param = PARAMS.get(e.field or "") if e.field else None
            return ApiError(status, e.render(self.name_of), param, "context_length_exceeded" if e.field == "n_ctx" else None)
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error")

    def authorize(self, request: HttpRequest) -> None:
        if self.key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # constant-time: the comparison takes as long whatever the first wrong byte is
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.key):
            raise ApiError(401, "a valid API key is required: send Authorization: Bearer KEY", None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})  # fmt: skip

    def tenant(self, request: HttpRequest, req: ChatRequest | CompletionRequest) -> str:
        """Who sent the request: the key it presented and its ``user`` (see suffixes.py)."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return tenant(given.strip() if scheme.lower() == "bearer" else None, req.user)

    async def parse(self, request: HttpRequest, model: type[_Req]) -> _Req:
        self.authorize(request)
        data = load_object(await request.body())  # a client gone mid-body: ClientDisconnect, answered by _client_gone
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            param, msg = param_of(e)
            raise ApiError(422, msg, param, "invalid_value") from None
        req.check_unsupported()
        if req.model is not None and not self.served.accepts(req.model):
            names = ", ".join((self.served.name, *self.served.aliases))
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {names}", "model", "model_not_found")
        return req

    def drafting(self, req) -> tuple[Settings, Sampler]:
        """The server's settings with the request's overrides (validated by the core values)."""
        spec = req.speculative
        changes: dict[str, Any] = {}
        if req.draft is not None:
            changes["mode"] = req.draft
        if spec is not None:
            for setting, name in SPECULATIVE.items():
                if getattr(spec, name) is not None:
                    changes[setting] = getattr(spec, name)
        picks = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed") if getattr(req, k) is not None}
        if picks.get("seed") == -1:  # llama-server's "random"
            picks["seed"] = None
        try:
            return dataclasses.replace(self.served.settings, **changes), dataclasses.replace(self.served.sampler, **picks)
        except UsageError as e:
            raise ApiError(422, e.render(self.name_of), PARAMS.get(e.field or ""), "invalid_value") from None

    async def run(self, request: HttpRequest, r: Request, stream: bool, shape: _Shape):
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def post(msg: tuple[str, Any]) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, msg)
            except RuntimeError:  # the loop has closed: nobody is listening
                pass

        client = request.client.host if request.client else "-"
        job = Job(r, post, label=f"#{self.host.next_id()} {r.kind} {client}", stream=stream)
        try:
            self.host.submit(job)
        except Busy as e:
            self.metrics.rejected.inc()
            raise ApiError(429, f"{e}; retry in {e.retry_after} s", None, "queue_full", {"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown as e:
            raise self.api_error(e) from None
        try:
            kind, payload = await _next(inbox, request, job)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        except BaseException:
            job.cancel.set()
            raise
        if kind == "error":
            raise self.api_error(payload)
        start: Start = payload
        headers = {"X-Specrun-Notice": "; ".join(start.notices)} if start.notices else {}
        if stream:
            return StreamingResponse(
                _events(inbox, job, start, shape, self.api_error), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
            )  # fmt: skip
        try:  # one message: the last event, with the whole text
            kind, payload = await _next(inbox, request, job)
            if kind == "error":
                raise self.api_error(payload)
        except _ClientGone:
            return Response(status_code=499)
        except BaseException:
            job.cancel.set()
            raise
        body = shape.whole(payload.text, payload, start)
        if start.notices:
            body["notices"] = list(start.notices)
        return JSONResponse(body, headers=headers)

    # --- routes --------------------------------------------------------------------------

    async def health(self):
        host = self.host
        if host.stopping:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {
            "status": "ok",
            "model": self.served.name,
            "busy": host.busy(),
            "running": len(host.running),
            "parallel": len(host.slots),
            "queued": host.queue_length(),
        }

    async def prometheus(self):
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)

    def model_card(self) -> dict:
        s = self.served
        return {
            "id": s.name, "object": "model", "created": s.created, "owned_by": "specrun",
            "aliases": list(s.aliases), "draft": s.draft_model, "meta": {"n_ctx": s.n_ctx, "draft": s.settings.mode},
        }  # fmt: skip

    async def models(self, request: HttpRequest):
        self.authorize(request)
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, model_id: str, request: HttpRequest):
        self.authorize(request)
        if not self.served.accepts(model_id):
            raise ApiError(404, f"model {model_id!r} is not served here; this server serves {self.served.name}", "model", "model_not_found")
        return self.model_card()

    async def chat(self, request: HttpRequest):
        req = await self.parse(request, ChatRequest)
        settings, sampler = self.drafting(req)
        limit, limit_field = req.limit()
        tools = req.calling()
        name = self.served.name
        if tools is not None and self.call_format is None:
            why = "does not show tools to the model" if not self.shows_tools else "writes tool calls in a format specrun does not read"
            raise ApiError(
                400,
                f"model {name!r} cannot call tools: its chat template {why} (specrun reads Hermes/Qwen <tool_call> and "
                'Llama 3 JSON calls); send no tools (or tool_choice "none"), or serve a model whose template has tool calls',
                "tools", "tools_not_supported",
            )  # fmt: skip
        # rendered here, on the main thread, where the sandbox's time limit (SIGALRM) applies
        try:
            text = render_chat(self.template, req.conversation(), self.host.warn, tools=tools)
        except TemplateError as e:  # only with tools: without, the plain format stands in
            raise ApiError(400, f"model {name!r}'s chat template cannot render this request with tools: {e}", "tools") from None
        add_special = not (self.template.bos_token and text.startswith(self.template.bos_token))
        r = Request("chat", settings, sampler, tuple(req.stops()), limit, limit_field, prompt_text=text, add_special=add_special,
                    prediction=req.predicted(), tenant=self.tenant(request, req))  # fmt: skip
        names = frozenset(t["function"]["name"] for t in tools or ())
        shape = _Shape("chat", name, req.include_usage, self.call_format if tools else None, names, req.parallel_tool_calls is not False,
                       req.include_drafts)  # fmt: skip
        return await self.run(request, r, req.stream, shape)

    async def completions(self, request: HttpRequest):
        req = await self.parse(request, CompletionRequest)
        settings, sampler = self.drafting(req)
        text = req.prompt_text()
        ids = () if text is not None else tuple(int(t) for t in req.prompt)
        r = Request("completion", settings, sampler, tuple(req.stops()), req.max_tokens, "max_tokens",
                    prompt_text=text, prompt_ids=ids, prompt_field="prompt", prediction=req.predicted(),
                    tenant=self.tenant(request, req))  # fmt: skip
        shape = _Shape("completion", self.served.name, req.include_usage, drafts=req.include_drafts)
        return await self.run(request, r, req.stream, shape)


def create_app(host: Host, served: Served, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="specrun", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=served.max_body)
    api = Api(host, served, metrics)

    @app.exception_handler(ApiError)
    async def _api_error(request: HttpRequest, e: ApiError):
        return _error_response(e)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: HttpRequest, e: ClientDisconnect):
        return Response(status_code=499)  # it left before its body was whole: nobody reads an answer, nothing to log

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HttpRequest, e: StarletteHTTPException):
        what = {404: f"no route {request.method} {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return _error_response(
            ApiError(e.status_code, what.get(e.status_code, str(e.detail)), None, "not_found" if e.status_code == 404 else None)
        )

    @app.exception_handler(Exception)
    async def _internal(request: HttpRequest, e: Exception):
        return _error_response(api.api_error(e))

    @app.get("/", include_in_schema=False)
    async def page_index():
        return _page("index.html")

    @app.get("/page/{name}", include_in_schema=False)
    async def page_file(name: str):
        if name not in PAGE_FILES or name == "index.html":
            raise ApiError(404, f"no page file {name!r}", None, "not_found")
        return _page(name)

    app.get("/health")(api.health)
    app.get("/metrics")(api.prometheus)
    for prefix in ("/v1", ""):  # the routes also without /v1, for clients configured that way
        shown = prefix == "/v1"
        app.get(f"{prefix}/models", include_in_schema=shown)(api.models)
        app.get(prefix + "/models/{model_id:path}", include_in_schema=shown)(api.model)
        app.post(f"{prefix}/chat/completions", include_in_schema=shown)(api.chat)
        app.post(f"{prefix}/completions", include_in_schema=shown)(api.completions)
    return app


async def _next(inbox: asyncio.Queue, request: HttpRequest, job: Job) -> tuple[str, Any]:
    """The engine's next message; a client that has gone away cancels the job."""
    while True:
        try:
            return await asyncio.wait_for(inbox.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel.set()
                raise _ClientGone() from None


class _ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


@dataclass
class _Shape:
    """OpenAI's response objects for one request: chat or text completion."""

    kind: str
    model: str
    include_usage: bool
    tools: str | None = None  # the tool-call format to read from the reply (None: no tools offered)
    names: frozenset[str] = frozenset()  # the tools offered
    parallel: bool = True  # False: only the first call is kept (``parallel_tool_calls``)
    drafts: bool = False  # stream_options.include_drafts: chunks carry a "specrun" object (see drafted())
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.kind == "chat" else "text_completion"
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": "specrun"}

    def whole(self, text: str, last: Event, start: Start) -> dict:
        reason = finish_reason(last.finish_reason)
        if self.kind == "chat" and self.tools:
            content, calls = parse_tool_calls(self.tools, text, self.names)
            calls = calls if self.parallel else calls[:1]
            message: dict[str, Any] = {"role": "assistant", "content": content if content.strip() or not calls else None}
            if calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
                ]
                reason = "tool_calls" if reason == "stop" else reason
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        elif self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._head(False), "choices": [choice], "usage": usage(start, last.stats), "timings": timings(last.stats)}

    def chunk(
        self, text: str | None, reason: str | None = None, role: bool = False, call: CallDelta | None = None, event: Event | None = None
    ) -> dict:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if call is not None:
                delta = {"tool_calls": [call.to_openai()]}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        out = {**self._head(True), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        if self.drafts and event is not None:
            out["specrun"] = drafted(event, spans=text is not None and call is None and not self.tools)
        return out


async def _events(inbox: asyncio.Queue, job: Job, start: Start, shape: _Shape, api_error) -> AsyncIterator[bytes]:
    """The SSE stream; leaving early (the client went away, the server stops) cancels the job."""
    calls = ToolCallParser(shape.tools, shape.names) if shape.tools else None

    def pieces(items: list[str | CallDelta], event: Event) -> list[bytes]:
        """Content and tool-call deltas as chunks (with ``parallel_tool_calls`` false, the first call only)."""
        return [
            _sse(shape.chunk(item, event=event) if isinstance(item, str) else shape.chunk(None, call=item, event=event))
            for item in items
            if isinstance(item, str) or shape.parallel or item.index == 0
        ]

    try:
        if shape.kind == "chat":
            yield _sse(shape.chunk(None, role=True))
        while True:
            kind, payload = await inbox.get()
            if kind == "error":
                yield _sse(api_error(payload).body())
                return
            event: Event = payload
            if event.finish_reason is None:
                if calls is not None:
                    out = pieces(calls.feed(event.text), event)
                else:
                    out = [_sse(shape.chunk(event.text, event=event))] if event.text else []
                for piece in out:
                    yield piece  # resumes once the chunk has been sent
                job.delivered()
                continue
            reason = finish_reason(event.finish_reason)
            if calls is not None:
                for piece in pieces(calls.feed(event.text) + calls.finish(), event):
                    yield piece
                reason = "tool_calls" if calls.calls and reason == "stop" else reason
                event = dataclasses.replace(event, text="")
            last = shape.chunk(event.text or None, reason, event=event)
            last["timings"] = timings(event.stats)
            if event.text and shape.kind == "chat":  # the held-back tail, then the finish on its own
                yield _sse(shape.chunk(event.text, event=event))
                last = {**shape.chunk(None, reason, event=event), "timings": last["timings"]}
            yield _sse(last)
            if shape.include_usage:
                yield _sse({**shape._head(True), "choices": [], "usage": usage(start, event.stats)})
            yield b"data: [DONE]\n\n"
            return
    finally:
        job.cancel.set()  # a no-op once the job is done; otherwise it ends within a round
