"""The entry side of a session: open it along a route, feed it, collect its tokens.

The entry opens a results stream to the tail, then the seam to the head; it sends the prompt in
bounded prefill chunks and then one decode bundle per token; tokens arrive from the tail, errors
from the head's side of the seam. Every hop releases the session when the entry closes it or goes
away.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from meshd.errors import MeshError
from meshd.runtime.chain import input_bundles
from meshd.session import messages as m
from meshd.tracker.view import Route
from meshd.transport import TransportError
from meshd.wire import bundle as wire
from meshd.wire import session_pb2 as pb
from meshd.wire.bundle import Sampling

log = logging.getLogger("meshd.session")

HEALTH_INTERVAL_S = 0.2


class SessionFailed(MeshError):
    code = "session_failed"

    def __init__(self, code: str, message: str, peer_id: str = "") -> None:
        super().__init__(f"{code}: {message}" + (f" (peer {peer_id[:12]})" if peer_id else ""))
        self.remote_code = code
        self.peer_id = peer_id


@dataclass
class SessionPlan:
    route: Route
    addresses: dict[str, str]   # peer id -> host:port of its transport
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: Sampling
    eos_token_id: int | None
    chunk_tokens: int = 128
    step_timeout_s: float = 30.0
    session_id: str = ""
    alive: Callable[[str], bool] | None = None  # gossip's verdict on a peer; a dead hop ends the attempt
    unchanged_prefix: int = 0                   # repair: leading hops shared with epoch resume_from_epoch
    resume_from_epoch: int = 0


async def run_session(transport, entry_peer_id: str, plan: SessionPlan, out: trio.MemorySendChannel) -> None:
    """Drive one generation; send each token id to ``out``, then close it. Raises SessionFailed."""
    route = plan.route
    session_id = plan.session_id or uuid.uuid4().hex
    hops = [
        pb.HopAddress(peer_id=h.peer_id, address=plan.addresses[h.peer_id], range_start=h.start, range_end=h.end)
        for h in route.hops
    ]

    def open_for(index: int) -> bytes:
        return m.open_msg(pb.SessionOpen(
            session_id=session_id, epoch=route.epoch, model_id=route.model_id, compat_key=route.compat_key,
            hops=hops, hop_index=index, entry_peer_id=entry_peer_id,
            max_tokens=len(plan.prompt) + plan.max_new_tokens, prompt_tokens=len(plan.prompt),
            unchanged_prefix=plan.unchanged_prefix, resume_from_epoch=plan.resume_from_epoch,
        ))

    tail, head = hops[-1], hops[0]
    results = head_stream = None
    async with out:
        try:
            results = await _dial(transport, tail, m.RESULTS_PATH)
            await results.send_message(open_for(len(hops) - 1))
            with trio.fail_after(plan.step_timeout_s):
                first = m.parse(await _must_receive(results))
            _raise_if_error(first)
            head_stream = await _dial(transport, head, m.SEAM_PATH)
            await head_stream.send_message(open_for(0))
            events_send, events = trio.open_memory_channel(math.inf)
            error: Exception | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_into, results, events_send.clone(), "results", tail.peer_id)
                nursery.start_soon(_read_into, head_stream, events_send.clone(), "seam", head.peer_id)
                if plan.alive is not None:
                    nursery.start_soon(_watch_hops, plan.alive, [h.peer_id for h in hops], events_send.clone())
                events_send.close()
                try:
                    await _generate(plan, session_id, route, head_stream, events, out)
                except Exception as exc:
                    error = exc
                nursery.cancel_scope.cancel()
            if error is not None:
                raise error
        finally:
            if head_stream is not None:
                await m.finish_stream(head_stream, m.CLOSE)
            if results is not None:
                await m.finish_stream(results)


async def _generate(plan: SessionPlan, session_id: str, route: Route, head_stream, events, out) -> None:
    """Feed the route and pass its tokens on. Each new token goes back into the route before it goes to
    ``out``, so the API's work on a token (detokenizing, streaming it) overlaps the next step's compute
    instead of delaying it."""
    head_range = (route.hops[0].start, route.hops[0].end)

    async def feed(tokens: list[int], position: int, step: int) -> None:
        for bundle in input_bundles(session_id, route.epoch, tokens, position, plan.chunk_tokens, head_range,
                                    plan.sampling, step=step):
            bundle.sent_at_ns = time.time_ns()
            await head_stream.send_message(m.bundle_msg(wire.encode(bundle)))

    position = len(plan.prompt)
    await feed(list(plan.prompt), 0, 0)
    for step in range(plan.max_new_tokens):
        with trio.fail_after(plan.step_timeout_s):
            msg = await events.receive()
        if isinstance(msg, Exception):
            raise msg
        _raise_if_error(msg)
        if msg.WhichOneof("kind") != "token" or msg.token.position != position:
            raise SessionFailed("protocol", f"expected the token for position {position}, got {msg}")
        token = int(msg.token.token)
        finished = plan.eos_token_id is not None and token == plan.eos_token_id
        if not finished and step + 1 < plan.max_new_tokens:
            try:
                await feed([token], position, step + 1)
            except Exception:
                await out.send(token)  # the token itself is good: only the route failed after it
                raise
            position += 1
        await out.send(token)
        if finished:
            return


async def _watch_hops(alive: Callable[[str], bool], peer_ids: list[str], sink: trio.MemorySendChannel) -> None:
    """Fail the attempt as soon as gossip declares a hop of the route dead."""
    async with sink:
        while True:
            for peer_id in peer_ids:
                if not alive(peer_id):
                    await sink.send(SessionFailed("peer_dead", "gossip declared the hop dead", peer_id))
                    return
            await trio.sleep(HEALTH_INTERVAL_S)


async def _dial(transport, hop: pb.HopAddress, path: str):
    try:
        return await transport.open_stream(hop.peer_id, hop.address, path)
    except Exception as exc:
        raise SessionFailed("unreachable", f"cannot reach {hop.address}: {exc}", hop.peer_id) from exc


async def _read_into(stream, sink: trio.MemorySendChannel, name: str, peer_id: str) -> None:
    async with sink:
        try:
            while True:
                raw = await stream.receive_message()
                if raw is None:
                    await sink.send(SessionFailed("seam_closed", f"{name} stream ended early", peer_id))
                    return
                await sink.send(m.parse(raw))
        except (TransportError, OSError, trio.BrokenResourceError) as exc:
            await sink.send(SessionFailed("unreachable", f"{name} stream: {exc}", peer_id))
        except MeshError as exc:
            await sink.send(SessionFailed(exc.code, f"{name} stream: {exc}", peer_id))


async def _must_receive(stream) -> bytes:
    raw = await stream.receive_message()
    if raw is None:
        raise SessionFailed("seam_closed", "stream ended before the session opened")
    return raw


def _raise_if_error(msg: pb.SeamMessage) -> None:
    if msg.WhichOneof("kind") == "error":
        raise SessionFailed(msg.error.code, msg.error.message, msg.error.peer_id)
