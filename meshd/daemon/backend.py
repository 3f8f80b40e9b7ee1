"""The OpenAI API's view of the mesh: tokenize, find a route, run the generation, stream text.

Every peer answers the API, with or without layers of its own: it needs the model's tokenizer (its
own copy, or one fetched from a serving peer and checked against the compat key) and a route. The
generation itself, with its repairs, is the session plane's (:class:`~meshd.session.entry.EntrySessions`);
this adapter turns requests into generations, tokens into text, log-probabilities and tool calls, and
the session plane's errors into API errors.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable

import trio

from meshd.api.backend import BackendEvent, Finished, GenerationRequest, ModelInfo, Started, TokenEvent, TokenLogprob
from meshd.api.errors import ApiError, BadRequest, DeadlineExceeded, ModelNotFound, NoRoute, Overloaded, RouteFailed
from meshd.capture.recorder import CaptureRecorder, observe
from meshd.capture.records import RequestObservation, numerics_of
from meshd.models.artifacts import ModelFilesCache, ModelFilesUnavailable
from meshd.models.text import ChatRefused, TextCodec, ToolCall
from meshd.session.attempt import GeneratedToken
from meshd.session.entry import DeadlinePassed, EntrySessions, Generation, PlannedRoute
from meshd.session.repair import AllRefused, NoCompleteRoute, RepairFailed
from meshd.session.routes import RouteClient
from meshd.tracker.routing import NoRouteError
from meshd.tracker.view import MeshView, Route
from meshd.wire.bundle import Sampling

log = logging.getLogger("meshd.api")

DEFAULT_MAX_TOKENS = 256


class MeshBackend:
    """A :class:`~meshd.api.backend.ChatBackend` that answers from the whole mesh."""

    def __init__(self, view: MeshView, routes: RouteClient, entry: EntrySessions, files: ModelFilesCache,
                 leaving: Callable[[], bool], after_request: Callable[[Route], None] | None = None,
                 capture: CaptureRecorder | None = None) -> None:
        self.view = view
        self.routes = routes
        self.entry = entry
        self.files = files
        self.leaving = leaving
        self.after_request = after_request  # told the route of every request answered in full (audits sample it)
        self.capture = capture  # handed what every request answered here looked like, when capture is on
        # templates and tokenizers run in a worker thread (a long chat renders once per message), one at a
        # time (a tokenizer is not meant to be used from two threads at once)
        self.tokenizing = trio.CapacityLimiter(1)

    def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(id=model_id) for model_id in self.view.covered_models()]

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
        """The events of one generation, counted in the entry's metrics (outcome, tokens, first token)."""
        metrics = self.entry.metrics
        model = req.model if req.model in self.view.known_models() else "unknown"  # clients choose the text
        started = time.monotonic()
        outcome = "cancelled"
        first = True
        tokens = metrics.tokens.labels(model)  # looked up once per request, counted per token
        seen = observe(req) if self.capture is not None and self.capture.enabled else None
        events = self._generate(req, seen)
        try:
            async for event in events:
                if seen is not None:
                    seen.on_event(event, time.monotonic())
                if isinstance(event, TokenEvent):
                    if first:
                        metrics.ttft.labels(model).observe(time.monotonic() - started)
                        first = False
                    tokens.inc()
                elif isinstance(event, Finished):
                    outcome = "finished"  # the API may close this generator once it has the last event
                yield event
        except ApiError as exc:
            outcome = str(exc.code)
            raise
        finally:
            metrics.requests.labels(model, outcome).inc()
            if seen is not None and self.capture is not None:
                seen.ended_at = time.monotonic()
                self.capture.submit(seen)  # a request that was not answered is dropped there
            await events.aclose()

    async def prompt_tokens(self, req: GenerationRequest, compat_key: str) -> list[int]:
        """``req``'s prompt as the model of ``compat_key`` tokenizes it (what a replay matches by)."""
        codec = await self.files.codec_for(req.model, compat_key, self.view.sources_of)
        return await trio.to_thread.run_sync(_encode, codec, req, limiter=self.tokenizing)

    def replay(self, req: GenerationRequest, planned: PlannedRoute, entry: EntrySessions,
               seen: RequestObservation) -> AsyncGenerator[BackendEvent, None]:
        """The events of ``req`` run on exactly ``planned`` by ``entry`` (one without repair), as the
        API path runs a request otherwise; neither counted, captured nor audited."""
        return self._generate(req, seen, planned, entry)

    async def _generate(self, req: GenerationRequest, seen: RequestObservation | None = None,
                        pinned: PlannedRoute | None = None, entry: EntrySessions | None = None,
                        ) -> AsyncGenerator[BackendEvent, None]:
        if self.leaving():
            raise Overloaded("this peer is leaving the mesh; ask another peer", retry_after=1.0)
        if req.model not in self.view.known_models():
            raise ModelNotFound(req.model)
        sessions = entry or self.entry
        if pinned is not None:
            first = pinned
        else:
            try:
                first = await self.routes.route_for(req.model)
            except NoRouteError as exc:
                raise NoRoute(req.model, exc.missing) from None
        try:
            codec = await self.files.codec_for(req.model, first.route.compat_key, self.view.sources_of)
        except ModelFilesUnavailable as exc:
            raise NoRoute(req.model, []) from exc
        prompt = await trio.to_thread.run_sync(_encode, codec, req, limiter=self.tokenizing)
        context = self.view.context_length(req.model)
        room = context - len(prompt)
        if room <= 0:
            raise BadRequest(f"the prompt has {len(prompt)} tokens; the model's context is {context}", "messages")
        if req.max_tokens is not None and req.max_tokens > room:
            raise BadRequest(f"max_tokens is {req.max_tokens}, but the prompt's {len(prompt)} tokens leave room for "
                             f"{room} in the model's context of {context}", "max_tokens")
        max_new = req.max_tokens if req.max_tokens is not None else min(DEFAULT_MAX_TOKENS, room)
        yield Started(prompt_tokens=len(prompt))
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        stops = frozenset() if req.ignore_eos else codec.stop_token_ids
        gen = Generation(session_id=req.request_id, model_id=req.model, prompt=prompt, max_new_tokens=max_new,
                         sampling=Sampling(temperature=req.temperature, top_p=req.top_p, seed=seed % (1 << 63),
                                           logprobs=req.logprobs, top_logprobs=req.top_logprobs),
                         stop_token_ids=stops, vocab_size=codec.vocab_size,
                         speculation=sessions.speculation(req.model, codec.tokenizer),
                         prefixes=sessions.prompt_prefixes(
                             prompt, await trio.to_thread.run_sync(_boundaries, codec, req, prompt,
                                                                   limiter=self.tokenizing),
                             first.route.compat_key, req.kind == "chat"))
        if pinned is None:  # the hops that kept the longest known prefix of the prompt, when it pays
            first = await sessions.route_for_prefix(gen, first)
        if seen is not None:  # the seed used, drawn or given, so that a replay samples the same reply
            seen.planned(first.route, first.source, numerics_of(self.view.cards(), first.route), prompt,
                         gen.sampling.seed, max_new)
        reply = _Reply(codec, tools=bool(req.tools))
        last: int | None = None
        count = 0
        tokens = sessions.generate(gen, first)
        try:
            async for token in tokens:
                if seen is not None and count == 0 and (live := sessions.live.get(gen.session_id)) is not None:
                    seen.live = live  # its route and repairs, as the generation goes on
                last, count = token.token, count + 1
                yield TokenEvent(text=reply.push(token.token), token_id=token.token, logprob=_logprob(codec, token))
        except NoCompleteRoute as exc:
            raise NoRoute(req.model, exc.missing) from None
        except AllRefused as exc:
            raise Overloaded(str(exc), retry_after=2.0) from None
        except RepairFailed as exc:
            raise RouteFailed(str(exc)) from None
        except DeadlinePassed:
            raise DeadlineExceeded(self.entry.config.request_timeout_s) from None
        finally:
            await tokens.aclose()  # type: ignore[attr-defined]
        if self.after_request is not None and pinned is None:
            self.after_request(first.route)
        text, calls = reply.finish()
        if calls:
            chosen = calls if req.parallel_tool_calls else calls[:1]
            yield Finished("tool_calls", len(prompt), count, text=text, tool_calls=[c.as_openai() for c in chosen])
            return
        yield Finished("stop" if last is not None and last in stops else "length", len(prompt), count, text=text)


class _Reply:
    """Text of the reply as it is released: streamed as it comes, except that a reply which may be a
    tool call is held until it ends, then read as one."""

    def __init__(self, codec: TextCodec, tools: bool) -> None:
        self.codec = codec
        self.detok = codec.detokenizer()
        self.holding = tools
        self.held = ""

    def push(self, token_id: int) -> str:
        text = self.detok.push(token_id)
        if not self.holding:
            return text
        self.held += text
        if self.codec.may_be_tool_call(self.held):
            return ""
        self.holding = False
        released, self.held = self.held, ""
        return released

    def finish(self) -> tuple[str, list[ToolCall]]:
        tail = self.detok.flush()
        if not self.holding:
            return tail, []
        content, calls = self.codec.tool_calls(self.held + tail)
        return content, calls


def _logprob(codec: TextCodec, token: GeneratedToken) -> TokenLogprob | None:
    if token.logprob is None:
        return None
    return TokenLogprob(codec.token_text(token.token), token.logprob,
                        [(codec.token_text(t), lp) for t, lp in token.top_logprobs])


def _boundaries(codec: TextCodec, req: GenerationRequest, prompt: list[int]) -> list[int]:
    """Where the chat's messages end in its prompt (a completion's prompt has none)."""
    return codec.chat_boundaries(req.messages or [], prompt, req.tools) if req.kind == "chat" else []


def _encode(codec: TextCodec, req: GenerationRequest) -> list[int]:
    if req.kind == "chat":
        if not codec.has_chat_template:
            raise BadRequest("this model has no chat template; send a prompt to /v1/completions", "messages")
        if req.tools and codec.tool_format is None:
            raise BadRequest("this model's chat template takes no tools", "tools")
        try:
            tokens = codec.encode_chat(req.messages or [], req.tools)
        except ChatRefused as exc:
            raise BadRequest(f"the model's chat template refused these messages: {exc}", "messages") from None
    else:
        tokens = codec.encode_text(req.prompt or "")
    if not tokens:  # a model without a start token encodes "" as nothing: there is nothing to continue
        param, what = ("messages", "the messages encode") if req.kind == "chat" else ("prompt", "the prompt encodes")
        raise BadRequest(f"{what} to no tokens; a generation continues at least one", param)
    return tokens
