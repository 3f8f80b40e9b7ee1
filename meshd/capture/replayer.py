"""The daemon's side of ``meshctl replay``: re-run one captured request on one route and compare.

A replay goes through the same code as a request of the API (:meth:`MeshBackend.replay`, then
:func:`~meshd.api.openai_server.run_generation`, so chat template, stop strings and tool calls are
handled as they were), with the captured seed, sampling and token limit, on one route run by an
:class:`~meshd.session.entry.EntrySessions` without repair, the one audits use: a hop that fails
fails the replay instead of being replaced. Replays run one at a time.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio

from meshd.api.backend import BackendEvent, GenerationRequest, ModelInfo, TokenLogprob
from meshd.api.errors import ApiError
from meshd.api.openai_server import run_generation
from meshd.api.validation import parse_chat, parse_completion
from meshd.capture.recorder import observe
from meshd.capture.records import (
    CapturedRequest,
    CaptureFormatError,
    CaptureKey,
    CaptureKeyError,
    RequestObservation,
    numerics_of,
    route_json,
)
from meshd.capture.replay import (
    DIFFERS,
    FAILED,
    IDENTICAL,
    PROMPT_MISMATCH,
    REQUEST_MISMATCH,
    UNMATCHED,
    PromptIndex,
    ReplayError,
    body_kind,
    first_difference,
    parse_route_spec,
    pin_route,
    resolve_peer,
    through_constraints,
)
from meshd.daemon.backend import MeshBackend
from meshd.errors import MeshError
from meshd.models.text import TextCodec
from meshd.session.entry import EntrySessions, PlannedRoute
from meshd.session.routes import RouteClient
from meshd.tracker.routing import NoRouteError
from meshd.tracker.view import Route

log = logging.getLogger("meshd.capture")


class _OnRoute:
    """The backend, running every request on one route by one entry, noting what it sees."""

    def __init__(self, backend: MeshBackend, planned: PlannedRoute, entry: EntrySessions,
                 seen: RequestObservation) -> None:
        self.backend, self.planned, self.entry, self.seen = backend, planned, entry, seen

    def list_models(self) -> list[ModelInfo]:
        return self.backend.list_models()

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
        events = self.backend.replay(req, self.planned, self.entry, self.seen)
        try:
            async for event in events:
                self.seen.on_event(event, time.monotonic())
                yield event
        finally:
            await events.aclose()


async def _discard(_text: str, _logprobs: list[TokenLogprob]) -> None:
    return None


def _parse(body: dict[str, Any], kind: str, request_id: str) -> GenerationRequest:
    return (parse_chat if kind == "chat" else parse_completion)(body, request_id).generation


class Replayer:
    def __init__(self, peer_id: str, backend: MeshBackend, entry: EntrySessions, routes: RouteClient,
                 codec_for: Callable[[str, str], Awaitable[TextCodec]], data_dir: Path) -> None:
        self.peer_id = peer_id
        self.backend = backend
        self.entry = entry  # its repair budget is zero: a replay runs on exactly the route it is given
        self.routes = routes
        self.codec_for = codec_for
        self.data_dir = Path(data_dir)
        self.replayed = 0
        self._lock = trio.Lock()
        self._key: CaptureKey | None = None

    def key(self) -> CaptureKey:
        """This peer's capture key (made now if capture never ran here: then no record matches it)."""
        if self._key is None:
            self._key = CaptureKey.load_or_create(self.data_dir)
        return self._key

    # -- matching re-supplied requests to metadata records ---------------------------------------

    async def match(self, records: Sequence[object], bodies: Sequence[object]) -> dict[str, Any]:
        """Which of ``bodies`` (OpenAI request bodies) is the request of which metadata record: the
        one whose prompt, tokenized for the record's compat key, and stop strings have the record's
        keyed hashes."""
        try:
            key = self.key()
        except CaptureKeyError as exc:
            raise ReplayError(str(exc)) from None
        parsed: list[CapturedRequest] = []
        errors: list[dict[str, Any]] = []
        for doc in records:
            try:
                record = CapturedRequest.from_json(doc)
            except CaptureFormatError as exc:
                errors.append({"record": doc.get("id") if isinstance(doc, dict) else None, "error": str(exc)})
                continue
            if record.key_id != key.key_id:
                errors.append({"record": record.id, "error": _foreign_key(record)})
                continue
            parsed.append(record)
        index = PromptIndex(parsed)
        matches: list[dict[str, Any]] = []
        for i, body in enumerate(bodies):
            try:
                kind = body_kind(body)
                assert isinstance(body, dict)
                req = _parse(body, kind, f"match-{i}")
                for compat_key in index.compat_keys(req.model, kind):
                    prompt = await self.backend.prompt_tokens(req, compat_key)
                    found = index.lookup(req.model, compat_key, kind, key.tokens_hash("prompt", prompt),
                                         key.stops_hash(req.stop))
                    matches.extend({"record": record_id, "body": i} for record_id in found)
            except (ReplayError, ApiError, MeshError) as exc:
                errors.append({"body": i, "error": str(exc)})
        return {"matches": matches, "errors": errors}

    # -- one replay ------------------------------------------------------------------------------

    async def replay(self, doc: object, body: object | None = None, route: str = "",
                     peers: Sequence[str] = (), exclude: Sequence[str] = ()) -> dict[str, Any]:
        """Replay one record (``body``: its request, for a metadata record) and compare its reply;
        every outcome, failures included, is a result with a status, never an exception."""
        result: dict[str, Any] = {"id": doc.get("id") if isinstance(doc, dict) else None, "status": FAILED}
        try:
            record = CapturedRequest.from_json(doc)
            result.update(id=record.id, mode=record.mode, model=record.model, captured={
                "route": [{"peer_id": p, "start": s, "end": e} for p, s, e in record.route],
                "compat_key": record.compat_key, "numerics": record.numerics, "tokens": record.completion_tokens,
                "ended_by": record.ended_by})
            async with self._lock:
                await self._replay(record, body, route, peers, exclude, result)
        except (ReplayError, CaptureFormatError, CaptureKeyError) as exc:
            result.update(status=FAILED, error=str(exc))
        except NoRouteError as exc:
            result.update(status=FAILED, error=f"{exc}; name the peers to replay through with --peers or --route")
        except (ApiError, MeshError) as exc:
            result.update(status=FAILED, error=f"the replay did not finish: {exc}")
        self.replayed += 1
        log.info("replay of %s: %s%s", result["id"], result["status"],
                 f" ({result['error']})" if result.get("error") else "")
        return result

    async def _replay(self, record: CapturedRequest, body: object | None, route_text: str, peers: Sequence[str],
                      exclude: Sequence[str], result: dict[str, Any]) -> None:
        key = self.key()
        same_key = record.key_id == key.key_id
        if record.mode == "metadata" and not same_key:
            raise ReplayError(_foreign_key(record))
        if body is None:
            body = record.request
        if body is None:
            result.update(status=UNMATCHED, error="a metadata record keeps no request: re-supply it (--requests)"
                          if record.mode == "metadata" else "the record keeps no request")
            return
        kind = body_kind(body)
        assert isinstance(body, dict)
        req = _parse(body, kind, f"replay-{secrets.token_hex(8)}")
        if kind != record.kind or req.model != record.model:
            result.update(status=REQUEST_MISMATCH, error=f"the request is a {kind} of {req.model}; the record a "
                          f"{record.kind} of {record.model}")
            return
        if same_key and key.stops_hash(req.stop) != record.stop_hash:
            result.update(status=REQUEST_MISMATCH, error=f"the request's stop strings ({len(req.stop)}) are not "
                          f"the captured ones ({record.stop_count})")
            return
        # exactly as captured: the seed used (drawn when the request had none), sampling, token limit
        req = replace(req, temperature=record.temperature, top_p=record.top_p, seed=record.seed,
                      max_tokens=record.max_new_tokens, ignore_eos=record.ignore_eos, stream=False, logprobs=False,
                      top_logprobs=0)
        planned = await self._route(record, route_text, peers, exclude)
        seen = observe(req)
        await run_generation(_OnRoute(self.backend, planned, self.entry, seen), req, _discard)
        seen.ended_at = time.monotonic()
        result["replayed"] = {
            **route_json(planned.route), "planned_by": planned.source, "compat_key": planned.route.compat_key,
            "numerics": numerics_of(self.routes.view.cards(), planned.route), "tokens": len(seen.reply),
            "ended_by": seen.ended_by(),
            "ttft_ms": None if seen.first_token_at is None else round((seen.first_token_at - seen.started) * 1000, 3),
            "total_ms": round((seen.ended_at - seen.started) * 1000, 3)}
        result["same_route"] = tuple((h.peer_id, h.start, h.end) for h in planned.route.hops) == record.route
        result["prompt_checked"] = same_key
        if same_key and key.tokens_hash("prompt", seen.prompt) != record.prompt_hash:
            result.update(status=PROMPT_MISMATCH, error=(
                f"the request tokenizes to another prompt than the captured one ({len(seen.prompt)} tokens, "
                f"captured {record.prompt_tokens}): the route's tokenizer differs, or redaction changed the request"))
            return
        if record.reply_tokens is not None:
            diff = first_difference(record.reply_tokens, seen.reply)
            if diff is None:
                result.update(status=IDENTICAL, first_difference=None)
                return
            codec = await self.codec_for(record.model, planned.route.compat_key)
            where = {"index": diff.index, "captured": _token(codec, diff.captured),
                     "replayed": _token(codec, diff.replayed)}
            result.update(status=DIFFERS, first_difference=where)
            return
        same = len(seen.reply) == record.completion_tokens and key.tokens_hash("reply", seen.reply) == record.reply_hash
        result.update(status=IDENTICAL if same else DIFFERS, first_difference=None)

    async def _route(self, record: CapturedRequest, route_text: str, peers: Sequence[str],
                     exclude: Sequence[str]) -> PlannedRoute:
        model = record.model
        view = self.routes.view
        offers = view.offers()
        if route_text:
            route = pin_route(model, parse_route_spec(route_text), offers, self.routes.duties.next_epoch(),
                              self.peer_id)
            return PlannedRoute(route, self._addresses(route), "pinned")
        known = {o.peer_id for o in offers}
        excluded = frozenset(resolve_peer(p, known, "is known here") for p in exclude)
        if peers:
            serving = {o.peer_id for o in offers if o.model_id == model}
            required = list(dict.fromkeys(resolve_peer(p, serving, f"serves {model}") for p in peers))
            if excluded & set(required):
                raise ReplayError("a peer cannot be both required and excluded")
            compat_key, forced_out = through_constraints(model, required, offers)
            try:
                planned = await self.routes.route_for(model, exclude=excluded | forced_out, keep=frozenset(required),
                                                      compat_key=compat_key)
            except NoRouteError as exc:
                raise ReplayError(f"no route of {model} runs through {', '.join(p[:12] for p in required)}: "
                                  f"{exc}") from None
            missing = [p for p in required if p not in planned.addresses]
            if missing:
                raise ReplayError(f"no route of {model} runs through {', '.join(p[:12] for p in missing)} (this "
                                  "peer's audits may exclude it)")
            return planned
        try:
            return await self.routes.route_for(model, exclude=excluded, compat_key=record.compat_key)
        except NoRouteError as exc:
            raise ReplayError(f"no route of {model} in the captured compat key {record.compat_key[:12]} now ({exc}); "
                              "name the peers to replay through with --peers or --route") from None

    def _addresses(self, route: Route) -> dict[str, str]:
        addresses = {}
        for hop in route.hops:
            address = self.routes.view.address_of(hop.peer_id)
            if address is None:
                raise ReplayError(f"no address is known for {hop.peer_id[:12]}")
            addresses[hop.peer_id] = address
        return addresses

    def status(self) -> dict[str, Any]:
        return {"replayed": self.replayed, "running": self._lock.locked()}


def _token(codec: TextCodec, token: int | None) -> dict[str, Any] | None:
    return None if token is None else {"token": token, "text": codec.token_text(token)}


def _foreign_key(record: CapturedRequest) -> str:
    return (f"record {record.id} was captured under another capture key ({record.key_id}): its hashes mean "
            "something only to the peer that made it; replay it through that peer's control API")
