"""The OpenAI-compatible HTTP API of a peer, served by hypercorn's Trio worker.

Each generation request runs in its own nursery next to a task that watches for the client going
away; when it does, the generation is cancelled and the backend generator closed, so the mesh
session is released at once instead of running to ``max_tokens`` for nobody.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import hypercorn.trio
import trio
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from meshd.address import Address
from meshd.api.backend import (
    ChatBackend,
    Finished,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    RequestKind,
    Started,
    TokenEvent,
    TokenLogprob,
)
from meshd.api.errors import ApiError, BadRequest, InternalError, ModelNotFound, PayloadTooLarge
from meshd.api.stops import StopMatcher
from meshd.api.validation import ParsedRequest, decode_json_object, parse_chat, parse_completion
from meshd.errors import ErrorCode, ListenError, first_leaf

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# How long a closing backend generator may take to release its session once we stop reading it;
# shielded, so a client disconnect cannot cut the release short.
CLOSE_GRACE_S = 5.0


@dataclass(frozen=True)
class Outcome:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


TextSink = Callable[[str, list[TokenLogprob]], Awaitable[None]]
"""``on_text(text, logprobs)``: text now safe to show, and the log-probabilities of the tokens that
arrived since the last call (empty unless the request asked for them)."""


async def run_generation(backend: ChatBackend, req: GenerationRequest, on_text: TextSink) -> Outcome:
    """Drive one backend generation, passing out text that is safe to show, and always close it.

    Stops on the backend's ``Finished``, on a stop string (text before it is kept), or when the
    backend overruns ``max_tokens``. Without a ``Started`` event the prompt count of a generation
    cut short by a stop string is unknown and reported as 0.
    """
    matcher = StopMatcher(req.stop)
    prompt_tokens = 0
    produced = 0
    pending: list[TokenLogprob] = []

    async def out(text: str) -> None:
        if text or pending:
            entries = pending.copy()
            pending.clear()
            await on_text(text, entries)

    events = backend.generate(req)
    try:
        async for event in events:
            if isinstance(event, Started):
                prompt_tokens = event.prompt_tokens
            elif isinstance(event, TokenEvent):
                if req.max_tokens is not None and produced >= req.max_tokens:
                    return Outcome("length", prompt_tokens, produced)
                produced += 1
                if event.logprob is not None:
                    pending.append(event.logprob)
                await out(matcher.feed(event.text))
                if matcher.stopped:
                    return Outcome("stop", prompt_tokens, produced)
            elif isinstance(event, Finished):
                await out(matcher.feed(event.text) if event.text else "")
                if matcher.stopped:
                    return Outcome("stop", prompt_tokens, produced)
                await out(matcher.flush())
                return Outcome(event.finish_reason, event.prompt_tokens, event.completion_tokens,
                               list(event.tool_calls))
            else:
                raise TypeError(f"backend yielded {type(event).__name__}, not a generation event")
        raise RuntimeError("backend generation ended without a Finished event")
    finally:
        with trio.move_on_after(CLOSE_GRACE_S, shield=True):
            try:
                await events.aclose()
            except Exception:
                log.exception("closing the backend generation of %s failed", req.request_id)


def _chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": list(entry.token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in entry.top]}


class _Shape:
    """The OpenAI object shapes of one endpoint: ``chat.completion`` or ``text_completion``."""

    def __init__(self, req: GenerationRequest) -> None:
        self.kind = req.kind
        self.id = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.request_id
        self.model = req.model
        self.created = int(time.time())
        self.logprobs = req.logprobs
        self._offset = 0  # legacy completions: where the next token's text starts

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": [_chat_logprob(e) for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [dict(e.top) for e in entries] if any(e.top for e in entries) else None,
                "text_offset": offsets}

    def completion(self, text: str, entries: list[TokenLogprob], outcome: Outcome) -> dict[str, Any]:
        logprobs = self._logprobs(entries)
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text or (None if outcome.tool_calls else "")}
            if outcome.tool_calls:
                message["tool_calls"] = outcome.tool_calls
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": outcome.finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": outcome.finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = outcome.usage()
        return body

    def chunk(self, text: str, entries: list[TokenLogprob] | None = None, *, first: bool = False,
              finish: FinishReason | None = None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        logprobs = self._logprobs(entries) if entries else None
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, outcome: Outcome) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, []), "usage": outcome.usage()}


async def _send_json(send: Send, status: int, body: object, headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


class _EventStream:
    """Server-sent events, with the response head sent lazily so early errors keep their status."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self._request_id = request_id
        self.opened = False

    async def open(self) -> None:
        if self.opened:
            return
        self.opened = True
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-request-id", self._request_id.encode()),
        ]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

    async def event(self, data: object) -> None:
        text = data if isinstance(data, str) else json.dumps(data)
        await self._send({"type": "http.response.body", "body": f"data: {text}\n\n".encode(), "more_body": True})

    async def close(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


class _GenerationEndpoint:
    """ASGI endpoint for ``/v1/chat/completions`` or ``/v1/completions``."""

    def __init__(self, backend: ChatBackend, kind: RequestKind, max_body_bytes: int) -> None:
        self._backend = backend
        self._kind = kind
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = uuid.uuid4().hex
        try:
            body = decode_json_object(await _read_body(Request(scope, receive), self._max_body_bytes))
            parse = parse_chat if self._kind == "chat" else parse_completion
            parsed = parse(body, request_id)
            if body.get("user"):
                log.info("request %s for %s from user %r", request_id, parsed.generation.model, body["user"])
        except ApiError as exc:
            await _send_json(send, exc.status, exc.body(), {**exc.headers(), "x-request-id": request_id})
            return
        except ClientDisconnect:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            if parsed.generation.stream:
                await self._stream(parsed, send)
            else:
                await self._complete(parsed, send)
            nursery.cancel_scope.cancel()

    async def _complete(self, parsed: ParsedRequest, send: Send) -> None:
        req = parsed.generation
        parts: list[str] = []
        entries: list[TokenLogprob] = []

        async def collect(text: str, logprobs: list[TokenLogprob]) -> None:
            parts.append(text)
            entries.extend(logprobs)

        try:
            outcome = await run_generation(self._backend, req, collect)
        except Exception as exc:
            error = _as_api_error(exc, req)
            await _send_json(send, error.status, error.body(), {**error.headers(), "x-request-id": req.request_id})
            return
        body = _Shape(req).completion("".join(parts), entries, outcome)
        await _send_json(send, 200, body, {"x-request-id": req.request_id})

    async def _stream(self, parsed: ParsedRequest, send: Send) -> None:
        req = parsed.generation
        shape = _Shape(req)
        stream = _EventStream(send, req.request_id)

        async def open_stream() -> None:
            if not stream.opened:
                await stream.open()
                if req.kind == "chat":
                    await stream.event(shape.chunk("", first=True))

        async def emit(text: str, logprobs: list[TokenLogprob]) -> None:
            await open_stream()
            await stream.event(shape.chunk(text, logprobs))

        try:
            outcome = await run_generation(self._backend, req, emit)
        except Exception as exc:
            error = _as_api_error(exc, req)
            if not stream.opened:
                await _send_json(send, error.status, error.body(),
                                 {**error.headers(), "x-request-id": req.request_id})
                return
            await stream.event(error.body())
            await stream.close()
            return
        await open_stream()
        await stream.event(shape.chunk("", finish=outcome.finish_reason, tool_calls=outcome.tool_calls))
        if parsed.include_usage:
            await stream.event(shape.usage_chunk(outcome))
        await stream.event("[DONE]")
        await stream.close()


def _as_api_error(exc: Exception, req: GenerationRequest) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    log.error("generation %s for model %r failed", req.request_id, req.model, exc_info=exc)
    return InternalError()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body exceeds {limit} bytes.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The request body exceeds {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _model_object(info: ModelInfo) -> dict[str, Any]:
    return {"id": info.id, "object": "model", "created": info.created, "owned_by": info.owned_by}


def build_app(backend: ChatBackend, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The Starlette app of the API; it uses Trio directly, so serve it with a Trio worker."""

    async def list_models(_request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_object(m) for m in backend.list_models()]})

    async def get_model(request: Request) -> Response:
        model_id = request.path_params["model"]
        for info in backend.list_models():
            if info.id == model_id:
                return JSONResponse(_model_object(info))
        return _error_response(ModelNotFound(model_id))

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}.get(exc.status_code, ErrorCode.HTTP_ERROR)
        error = BadRequest(str(exc.detail), code=code)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    async def internal_error(_request: Request, exc: Exception) -> Response:
        log.error("unhandled error in the API", exc_info=exc)
        return _error_response(InternalError())

    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", _GenerationEndpoint(backend, "chat", max_body_bytes), methods=["POST"]),
        Route("/v1/completions", _GenerationEndpoint(backend, "completion", max_body_bytes), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})


async def serve_api(
    backend: ChatBackend,
    listen: Address | str = "127.0.0.1:0",
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the API until cancelled; reports the bound port (useful with port 0) once listening."""
    app = build_app(backend, max_body_bytes=max_body_bytes)
    await serve_asgi(app, listen, "meshd.api.http", task_status=task_status)


async def start_listener(nursery: trio.Nursery, what: str, address: Address | str, serve: Callable[..., Any],
                         *args: Any) -> Any:
    """``nursery.start(serve, *args)`` for a task that opens a listener at ``address``; a socket error
    (port in use, address not on this machine) becomes one ``ListenError`` line naming ``what``."""
    try:
        return await nursery.start(serve, *args)
    except OSError as exc:
        raise ListenError(f"cannot listen for {what} on {address}: {exc.strerror or exc}") from None
    except BaseExceptionGroup as group:
        found = group.subgroup(OSError)
        if found is None:
            raise
        leaf = first_leaf(found)
        reason = leaf.strerror if isinstance(leaf, OSError) and leaf.strerror else str(leaf)
        raise ListenError(f"cannot listen for {what} on {address}: {reason}") from None


async def serve_asgi(
    app: Callable[..., Awaitable[None]],
    listen: Address | str,
    log_name: str,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an ASGI app with hypercorn's Trio worker until cancelled; reports the bound port."""
    config = Config()
    config.bind = [str(Address.coerce(listen))]
    config.accesslog = None
    config.graceful_timeout = 1.0
    config.errorlog = logging.getLogger(log_name)
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(partial(hypercorn.trio.serve, app, config, mode="asgi"))
        bound = urlsplit(binds[0]).port
        if bound is None:
            raise RuntimeError(f"hypercorn reported no port for {binds[0]!r}")
        task_status.started(bound)
