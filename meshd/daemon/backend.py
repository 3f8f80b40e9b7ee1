"""The OpenAI API's view of the mesh: tokenize, find a route, run the session, stream text.

Every peer answers the API, with or without layers of its own: it needs the model's tokenizer (its
own copy, or one fetched from a serving peer and checked against the compat key) and a route.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import AsyncGenerator

import trio

from meshd.api.backend import BackendEvent, Finished, GenerationRequest, ModelInfo, Started, TokenEvent
from meshd.api.errors import BadRequest, ModelNotFound, NoRoute, Overloaded
from meshd.session.detokenize import IncrementalDetokenizer
from meshd.session.entry import SessionPlan, run_session
from meshd.tracker.routing import NoRouteError
from meshd.wire.bundle import Sampling

log = logging.getLogger("meshd.api")

DEFAULT_MAX_TOKENS = 256
SETUP_ATTEMPTS = 3


class MeshBackend:
    def __init__(self, peer) -> None:
        self.peer = peer

    def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(id=model_id) for model_id in self.peer.covered_models()]

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
        peer = self.peer
        if req.model not in peer.known_models():
            raise ModelNotFound(req.model)
        try:
            route, addresses, _source = await peer.route_for(req.model)
        except NoRouteError as exc:
            raise NoRoute(req.model, exc.missing) from None
        tokenizer = await peer.tokenizer_for(req.model, route.compat_key)
        prompt = _encode(tokenizer, req)
        context = peer.context_length(req.model)
        room = context - len(prompt)
        if room <= 0:
            raise BadRequest(f"the prompt has {len(prompt)} tokens; the model's context is {context}", "messages")
        max_new = min(req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS, room)
        if max_new == 0:
            yield Started(prompt_tokens=len(prompt))
            yield Finished("length", len(prompt), 0)
            return
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        sampling = Sampling(temperature=req.temperature, top_p=req.top_p, seed=seed % (1 << 63))
        eos = None if req.ignore_eos else tokenizer.eos_token_id
        yield Started(prompt_tokens=len(prompt))
        detok = IncrementalDetokenizer(tokenizer)
        produced = 0
        last: TokenEvent | None = None
        avoid: set[str] = set()
        for attempt in range(SETUP_ATTEMPTS):
            if attempt:
                try:
                    route, addresses, _source = await peer.route_for(req.model, exclude=frozenset(avoid))
                except NoRouteError as exc:
                    raise NoRoute(req.model, exc.missing) from None
            plan = SessionPlan(
                route=route, addresses=addresses, prompt=prompt, max_new_tokens=max_new, sampling=sampling,
                eos_token_id=eos, chunk_tokens=peer.config.chunk_tokens, step_timeout_s=peer.config.step_timeout_s,
                session_id=f"{req.request_id}-{attempt}" if attempt else req.request_id,
            )
            send, receive = trio.open_memory_channel(math.inf)
            failure: list[BaseException] = []
            scope = await peer.sessions_nursery.start(_session_task, peer, plan, send, failure)
            try:
                async with receive:
                    async for token in receive:
                        produced += 1
                        if last is not None:
                            yield last
                        last = TokenEvent(text=detok.push(token), token_id=token)
            finally:
                scope.cancel()
            if not failure:
                break
            exc = failure[0]
            blamed = getattr(exc, "peer_id", "")
            if produced or not blamed or attempt + 1 == SETUP_ATTEMPTS:
                raise Overloaded(f"the route failed: {exc}", retry_after=1.0)
            log.info("route %s failed before its first token (%s); re-routing around %s",
                     route.describe(), exc, blamed[:12])
            peer.mark_unreachable(blamed)
            avoid.add(blamed)
        if last is not None:
            yield TokenEvent(text=last.text + detok.flush(), token_id=last.token_id)
        reason = "stop" if last is not None and eos is not None and last.token_id == eos else "length"
        yield Finished(reason, len(prompt), produced)


async def _session_task(peer, plan: SessionPlan, send, failure: list, task_status=trio.TASK_STATUS_IGNORED):
    """Run one session under the daemon's sessions nursery; failures are reported, never raised."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        try:
            await run_session(peer.transport, peer.peer_id, plan, send)
        except Exception as exc:
            log.warning("session %s failed: %s: %s", plan.session_id, type(exc).__name__, exc)
            failure.append(exc)
            await send.aclose()


def _encode(tokenizer, req: GenerationRequest) -> list[int]:
    if req.kind == "chat":
        encoded = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)
        return list(encoded["input_ids"])
    return list(tokenizer(req.prompt or "")["input_ids"])
