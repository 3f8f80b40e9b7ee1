"""The OpenAI API's view of the mesh: tokenize, find a route, run the generation, stream text.

Every peer answers the API, with or without layers of its own: it needs the model's tokenizer (its
own copy, or one fetched from a serving peer and checked against the compat key) and a route. The
generation itself, with its repairs, is the session plane's (:class:`~meshd.session.entry.EntrySessions`);
this adapter turns requests into generations and the session plane's errors into API errors.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncGenerator, Callable
from typing import Any

from meshd.api.backend import BackendEvent, Finished, GenerationRequest, ModelInfo, Started, TokenEvent
from meshd.api.errors import BadRequest, DeadlineExceeded, ModelNotFound, NoRoute, Overloaded, RouteFailed
from meshd.models.artifacts import ModelFilesCache, ModelFilesUnavailable
from meshd.session.detokenize import IncrementalDetokenizer
from meshd.session.entry import DeadlinePassed, EntrySessions, Generation
from meshd.session.repair import AllRefused, NoCompleteRoute, RepairFailed
from meshd.session.routes import RouteClient
from meshd.tracker.routing import NoRouteError
from meshd.tracker.view import MeshView
from meshd.wire.bundle import Sampling

log = logging.getLogger("meshd.api")

DEFAULT_MAX_TOKENS = 256


class MeshBackend:
    """A :class:`~meshd.api.backend.ChatBackend` that answers from the whole mesh."""

    def __init__(self, view: MeshView, routes: RouteClient, entry: EntrySessions, files: ModelFilesCache,
                 leaving: Callable[[], bool]) -> None:
        self.view = view
        self.routes = routes
        self.entry = entry
        self.files = files
        self.leaving = leaving

    def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(id=model_id) for model_id in self.view.covered_models()]

    def _sources(self, compat_key: str) -> list[tuple[str, str]]:
        """Peers serving ``compat_key`` that can hand out its files, by peer id."""
        out = []
        for offer in sorted(self.view.offers(), key=lambda o: o.peer_id):
            address = self.view.address_of(offer.peer_id)
            if offer.compat_key == compat_key and offer.peer_id != self.view.self_id and address is not None:
                out.append((offer.peer_id, address))
        return out

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
        if self.leaving():
            raise Overloaded("this peer is leaving the mesh; ask another peer", retry_after=1.0)
        if req.model not in self.view.known_models():
            raise ModelNotFound(req.model)
        try:
            first = await self.routes.route_for(req.model)
        except NoRouteError as exc:
            raise NoRoute(req.model, exc.missing) from None
        try:
            tokenizer = await self.files.tokenizer_for(req.model, first.route.compat_key, self._sources)
        except ModelFilesUnavailable as exc:
            raise NoRoute(req.model, []) from exc
        prompt = _encode(tokenizer, req)
        context = self.view.context_length(req.model)
        room = context - len(prompt)
        if room <= 0:
            raise BadRequest(f"the prompt has {len(prompt)} tokens; the model's context is {context}", "messages")
        max_new = min(req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS, room)
        yield Started(prompt_tokens=len(prompt))
        if max_new == 0:
            yield Finished("length", len(prompt), 0)
            return
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        eos = None if req.ignore_eos else tokenizer.eos_token_id
        gen = Generation(session_id=req.request_id, model_id=req.model, prompt=prompt, max_new_tokens=max_new,
                         sampling=Sampling(temperature=req.temperature, top_p=req.top_p, seed=seed % (1 << 63)),
                         eos_token_id=eos)
        detok = IncrementalDetokenizer(tokenizer)
        last: int | None = None
        count = 0
        tokens = self.entry.generate(gen, first)
        try:
            async for token in tokens:
                last, count = token, count + 1
                yield TokenEvent(text=detok.push(token), token_id=token)
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
        yield Finished("stop" if eos is not None and last == eos else "length", len(prompt), count,
                       text=detok.flush())


def _encode(tokenizer: Any, req: GenerationRequest) -> list[int]:
    if req.kind == "chat":
        encoded = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)
        return list(encoded["input_ids"])
    return list(tokenizer(req.prompt or "")["input_ids"])
