"""The OpenAI API's view of the mesh: tokenize, find a route, run the session, stream text.

Every peer answers the API, with or without layers of its own: it needs the model's tokenizer (its
own copy, or one fetched from a serving peer and checked against the compat key) and a route.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import replace

import trio

from meshd.api.backend import BackendEvent, Finished, GenerationRequest, ModelInfo, Started, TokenEvent
from meshd.api.errors import BadRequest, DeadlineExceeded, ModelNotFound, NoRoute, Overloaded, RouteFailed
from meshd.session.detokenize import IncrementalDetokenizer
from meshd.session.entry import SessionPlan, run_session
from meshd.session.hop import STATS_WINDOW
from meshd.tracker.routing import NoRouteError
from meshd.wire.bundle import Sampling

log = logging.getLogger("meshd.api")

DEFAULT_MAX_TOKENS = 256


class MeshBackend:
    def __init__(self, peer) -> None:
        self.peer = peer

    def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(id=model_id) for model_id in self.peer.covered_models()]

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
        peer = self.peer
        if peer.leaving:
            raise Overloaded("this peer is leaving the mesh; ask another peer", retry_after=1.0)
        peer.entry_sessions += 1
        try:
            async for event in self._generate(req):
                yield event
        finally:
            peer.entry_sessions -= 1

    async def _generate(self, req: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
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
        cfg = peer.config
        yield Started(prompt_tokens=len(prompt))
        detok = IncrementalDetokenizer(tokenizer)
        generated: list[int] = []
        avoid: set[str] = set()
        refusals: list[str] = []
        deadline = trio.current_time() + cfg.request_timeout_s
        repairing_since: float | None = None
        cause = ""
        failure: list[BaseException] = []
        pending_repair: tuple[float, str] | None = None
        previous = None
        ran_epoch = 0  # the epoch the last session actually ran under: hops keep their KV by it
        for attempt in range(cfg.repair_attempts + 1):
            if attempt:
                if trio.current_time() - repairing_since > cfg.repair_budget_s:
                    break
                try:
                    keep = frozenset(h.peer_id for h in previous.hops) - avoid if previous else frozenset()
                    route, addresses, _source = await peer.route_for(req.model, exclude=frozenset(avoid), keep=keep)
                except NoRouteError as exc:
                    if not generated and refusals:
                        raise Overloaded("; ".join(refusals), retry_after=2.0) from None
                    if not generated:
                        raise NoRoute(req.model, exc.missing) from None
                    cause = str(exc)
                    await trio.sleep(min(2.0, 0.25 * 2**attempt))
                    continue
            unchanged = 0
            if previous is not None:
                for old_hop, new_hop in zip(previous.hops, route.hops, strict=False):
                    if old_hop != new_hop:
                        break
                    unchanged += 1
            previous = route
            plan = SessionPlan(
                unchanged_prefix=unchanged, resume_from_epoch=ran_epoch,
                route=replace(route, epoch=attempt), addresses=addresses, prompt=prompt + generated,
                max_new_tokens=max_new - len(generated), sampling=sampling, eos_token_id=eos,
                chunk_tokens=cfg.chunk_tokens, step_timeout_s=cfg.step_timeout_s, session_id=req.request_id,
                alive=peer.is_alive,
            )
            send, receive = trio.open_memory_channel(math.inf)
            failure = []
            done = trio.Event()
            scope = await peer.sessions_nursery.start(_session_task, peer, plan, send, failure, deadline, done)
            ran_epoch = attempt
            try:
                async with receive:
                    async for token in receive:
                        if pending_repair is not None:
                            failed_at, position = pending_repair
                            pending_repair = None
                            took_ms = (trio.current_time() - failed_at) * 1000
                            peer.repair_ms.setdefault(position, deque(maxlen=STATS_WINDOW)).append(took_ms)
                            log.info("session %s repaired (%s hop lost) in %.0f ms: epoch %d on %s",
                                     req.request_id, position, took_ms, attempt, route.describe())
                        generated.append(token)
                        yield TokenEvent(text=detok.push(token), token_id=token)
                await done.wait()  # the attempt's outcome is recorded only once its task has ended
            finally:
                scope.cancel()
            if not failure:
                break
            exc = failure[0]
            if isinstance(exc, _DeadlineHit):
                raise DeadlineExceeded(cfg.request_timeout_s)
            code, blamed = getattr(exc, "remote_code", ""), getattr(exc, "peer_id", "")
            cause = f"{type(exc).__name__}: {exc}"
            repairing_since = repairing_since or trio.current_time()
            if generated and pending_repair is None:
                pending_repair = (trio.current_time(), _position(route, blamed))
            if code in REFUSALS:
                refusals.append(f"{blamed[:12]}: {code}")
            if blamed and code not in KEEP_PEER:
                avoid.add(blamed)
                if code not in REFUSALS:
                    peer.mark_unreachable(blamed)
            log.info("session %s epoch %d on %s failed after %d tokens (%s); repairing", req.request_id, attempt,
                     route.describe(), len(generated), cause)
        if failure and len(generated) < max_new:
            if not generated and refusals:
                raise Overloaded("; ".join(refusals), retry_after=2.0)
            raise RouteFailed(cause)
        reason = "stop" if generated and eos is not None and generated[-1] == eos else "length"
        yield Finished(reason, len(prompt), len(generated), text=detok.flush())


# Failure codes: peers that refuse admission, and failures that are no fault of the peer that reports them.
REFUSALS = frozenset({"overloaded", "kv_budget", "leaving"})
KEEP_PEER = frozenset({"cache_miss", "position_mismatch"})


def _position(route, peer_id: str) -> str:
    ids = [h.peer_id for h in route.hops]
    if peer_id not in ids:
        return "unknown"
    index = ids.index(peer_id)
    return "head" if index == 0 else "tail" if index == len(ids) - 1 else "middle"


class _DeadlineHit(Exception):
    pass


async def _session_task(peer, plan: SessionPlan, send, failure: list, deadline: float, done: trio.Event,
                        task_status=trio.TASK_STATUS_IGNORED):
    """Run one route attempt under the daemon's sessions nursery; failures are reported, never raised."""
    try:
        with trio.CancelScope(deadline=deadline) as scope:
            task_status.started(scope)
            try:
                await run_session(peer.transport, peer.peer_id, plan, send)
            except Exception as exc:
                log.warning("session %s failed: %s: %s", plan.session_id, type(exc).__name__, exc)
                failure.append(exc)
        if scope.cancelled_caught and trio.current_time() >= deadline:
            failure.append(_DeadlineHit())
    finally:
        send.close()
        done.set()


def _encode(tokenizer, req: GenerationRequest) -> list[int]:
    if req.kind == "chat":
        encoded = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)
        return list(encoded["input_ids"])
    return list(tokenizer(req.prompt or "")["input_ids"])
