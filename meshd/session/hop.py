"""The hop side of a session: receive bundles on a seam, run them, pass them on.

A hop reads ``SessionOpen`` then bundles from its upstream stream. It checks the open against what
it holds (model, compat key, its place in the route), runs each bundle through its shard, and sends
the hidden states downstream on one long-lived stream per session, or, on the tail, sends the
sampled token to the entry's results stream. Errors go back upstream as ``SessionError`` messages;
whatever way a session ends (close, error, a vanished neighbour), this hop releases its KV state.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import trio

from meshd.errors import BundleError, MeshError, RangeMismatch
from meshd.runtime.host import ShardHost
from meshd.runtime.shard import HIDDEN_STATES
from meshd.session import messages as m
from meshd.wire import bundle as wire
from meshd.wire import session_pb2 as pb
from meshd.wire.bundle import HiddenStateBundle, Phase

log = logging.getLogger("meshd.session")

RESULTS_WAIT_S = 10.0
STATS_WINDOW = 20000


class NextHopFailed(MeshError):
    """The next hop of the route could not be reached or went away; the entry should avoid it."""

    code = "unreachable"

    def __init__(self, peer_id: str, message: str) -> None:
        super().__init__(message)
        self.peer_id = peer_id


@dataclass
class HopStats:
    """What a peer measures about its seams and compute (for status, profiles and benchmarks).

    ``seam_ms`` holds, per decode bundle received from the previous hop, the time from the sender
    starting to encode it to this hop having decoded it (wall clocks: exact on one host, only as good
    as clock sync across hosts); ``entry_seam_ms`` the same for bundles straight from the entry.
    """

    sessions_served: int = 0
    seam_errors: int = 0
    seam_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    entry_seam_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    seam_bytes: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    compute_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))

    def reset(self) -> None:
        for window in (self.seam_ms, self.entry_seam_ms, self.seam_bytes, self.compute_ms):
            window.clear()

    def summary(self) -> dict:
        return {
            "sessions_served": self.sessions_served, "seam_errors": self.seam_errors,
            "seam_ms": _percentiles(self.seam_ms), "entry_seam_ms": _percentiles(self.entry_seam_ms),
            "decode_bundle_bytes": _percentiles(self.seam_bytes), "compute_ms": _percentiles(self.compute_ms),
        }


def _percentiles(values) -> dict:
    data = sorted(values)
    if not data:
        return {"count": 0}
    pick = lambda q: data[min(len(data) - 1, int(q * len(data)))]  # noqa: E731
    return {"count": len(data), "p50": pick(0.5), "p95": pick(0.95), "mean": sum(data) / len(data)}


class HopService:
    def __init__(
        self,
        peer_id: str,
        transport,
        host: ShardHost | None,
        model_id: str | None,
        compat_key: str | None,
    ) -> None:
        self.peer_id = peer_id
        self.transport = transport
        self.host = host
        self.model_id = model_id
        self.compat_key = compat_key
        self.stats = HopStats()
        self._sinks: dict[tuple[str, int], object] = {}
        self._sink_ready: dict[tuple[str, int], trio.Event] = {}

    # -- results streams (tail side) -------------------------------------------------------------

    async def handle_results(self, stream) -> None:
        """The entry's stream for tokens of one session; held open until the entry ends it."""
        try:
            open_ = self._check_open(m.parse(await _receive(stream)), tail_only=True)
        except MeshError as exc:
            await _send_quietly(stream, m.error_from(exc, self.peer_id))
            await _close_quietly(stream)
            return
        key = (open_.session_id, open_.epoch)
        self._sinks[key] = stream
        self._sink_ready.setdefault(key, trio.Event()).set()
        try:
            await stream.send_message(m.READY)
            while await stream.receive_message() is not None:
                pass
        except Exception as exc:
            log.debug("results stream for %s ended: %s", key, exc)
        finally:
            self._sinks.pop(key, None)
            self._sink_ready.pop(key, None)
            if self.host is not None:
                self.host.release(*key)
            await _close_quietly(stream)

    # -- seam streams ----------------------------------------------------------------------------

    async def handle_seam(self, stream) -> None:
        key = None
        downstream = None
        failure: bytes | None = None
        try:
            open_ = self._check_open(m.parse(await _receive(stream)))
            key = (open_.session_id, open_.epoch)
            self.stats.sessions_served += 1
            is_tail = open_.hop_index == len(open_.hops) - 1
            if not is_tail:
                nxt = open_.hops[open_.hop_index + 1]
                forwarded = pb.SessionOpen()
                forwarded.CopyFrom(open_)
                forwarded.hop_index = open_.hop_index + 1
                try:
                    downstream = await self.transport.open_stream(nxt.peer_id, m.split_address(nxt.address),
                                                                  m.SEAM_PATH)
                    await downstream.send_message(m.open_msg(forwarded))
                except Exception as exc:
                    raise NextHopFailed(nxt.peer_id, f"cannot reach the next hop: {exc}") from exc
            async with trio.open_nursery() as nursery:
                if downstream is not None:
                    nursery.start_soon(self._relay_upstream, downstream, stream, nursery.cancel_scope)
                try:
                    await self._pump(stream, open_, downstream, is_tail)
                except NextHopFailed as exc:
                    failure = self._failed(key, exc, m.error_msg(exc.code, str(exc), exc.peer_id))
                except MeshError as exc:
                    failure = self._failed(key, exc, m.error_from(exc, self.peer_id))
                except Exception as exc:
                    failure = self._failed(key, exc, m.error_msg("seam_failed", str(exc), self.peer_id))
                nursery.cancel_scope.cancel()
        except NextHopFailed as exc:
            failure = self._failed(key, exc, m.error_msg(exc.code, str(exc), exc.peer_id))
        except MeshError as exc:
            failure = self._failed(key, exc, m.error_from(exc, self.peer_id))
        except Exception as exc:
            failure = self._failed(key, exc, m.error_msg("seam_failed", str(exc), self.peer_id))
        finally:
            if key is not None and self.host is not None:
                self.host.release(*key)
            if failure is not None:
                await _send_quietly(stream, failure)
            if downstream is not None:
                await _send_quietly(downstream, m.CLOSE)
                await _close_quietly(downstream)
            await _close_quietly(stream)

    def _failed(self, key, exc: Exception, message: bytes) -> bytes:
        self.stats.seam_errors += 1
        log.warning("session %s failed on this hop: %s: %s", key, type(exc).__name__, exc)
        return message

    async def _pump(self, stream, open_: pb.SessionOpen, downstream, is_tail: bool) -> None:
        key = (open_.session_id, open_.epoch)
        nxt = open_.hops[open_.hop_index + 1] if not is_tail else None
        while True:
            raw = await stream.receive_message()
            if raw is None:
                return
            msg = m.parse(raw)
            kind = msg.WhichOneof("kind")
            if kind == "close":
                return
            if kind != "bundle":
                raise BundleError(f"unexpected {kind!r} message on a seam")
            bundle = wire.decode(msg.bundle)
            if (bundle.session_id, bundle.epoch) != key:
                raise BundleError("bundle belongs to another session than its stream")
            if bundle.phase == Phase.DECODE and bundle.sent_at_ns:
                crossed = (time.time_ns() - bundle.sent_at_ns) / 1e6
                (self.stats.seam_ms if open_.hop_index > 0 else self.stats.entry_seam_ms).append(crossed)
                self.stats.seam_bytes.append(len(raw))
            started = time.perf_counter()
            result = await self.host.forward(bundle)
            if bundle.phase == Phase.DECODE:
                self.stats.compute_ms.append((time.perf_counter() - started) * 1000)
            if not is_tail:
                out = HiddenStateBundle(
                    session_id=bundle.session_id, epoch=bundle.epoch, step=bundle.step, phase=bundle.phase,
                    start_position=bundle.start_position, token_count=bundle.token_count,
                    tensors={HIDDEN_STATES: result.hidden_states},
                    range_start=nxt.range_start, range_end=nxt.range_end,
                    sample=bundle.sample, sampling=bundle.sampling, sent_at_ns=time.time_ns(),
                )
                try:
                    await downstream.send_message(m.bundle_msg(wire.encode(out)))
                except Exception as exc:
                    raise NextHopFailed(nxt.peer_id, f"the next hop went away: {exc}") from exc
            elif result.token is not None:
                sink = await self._sink_for(key)
                await sink.send_message(m.token_msg(bundle.start_position + bundle.token_count, result.token))

    async def _sink_for(self, key):
        sink = self._sinks.get(key)
        if sink is not None:
            return sink
        event = self._sink_ready.setdefault(key, trio.Event())
        with trio.move_on_after(RESULTS_WAIT_S):
            await event.wait()
        sink = self._sinks.get(key)
        if sink is None:
            raise BundleError("the entry has no results stream open on this tail")
        return sink

    async def _relay_upstream(self, downstream, upstream, scope: trio.CancelScope) -> None:
        """Pass errors from further down the route back toward the entry; end the session on one."""
        try:
            while True:
                raw = await downstream.receive_message()
                if raw is None:
                    return
                msg = m.parse(raw)
                if msg.WhichOneof("kind") == "error":
                    await _send_quietly(upstream, raw)
                    scope.cancel()
                    return
        except Exception as exc:
            nxt_id = getattr(downstream, "peer_id", "") or ""
            await _send_quietly(upstream, m.error_msg("unreachable", f"the next hop failed: {exc}", nxt_id))
            scope.cancel()

    def _check_open(self, msg: pb.SeamMessage, tail_only: bool = False) -> pb.SessionOpen:
        if msg.WhichOneof("kind") != "open":
            raise BundleError("a seam stream starts with SessionOpen")
        open_ = msg.open
        if self.host is None or self.host.range is None:
            raise RangeMismatch("this peer holds no layers")
        if open_.model_id != self.model_id or open_.compat_key != self.compat_key:
            raise RangeMismatch(
                f"route is for {open_.model_id} ({open_.compat_key}); this peer serves "
                f"{self.model_id} ({self.compat_key})"
            )
        if not 0 <= open_.hop_index < len(open_.hops):
            raise BundleError(f"hop index {open_.hop_index} outside a route of {len(open_.hops)} hops")
        if tail_only and open_.hop_index != len(open_.hops) - 1:
            raise BundleError("results streams go to the tail of the route")
        me = open_.hops[open_.hop_index]
        if me.peer_id != self.peer_id or (me.range_start, me.range_end) != self.host.range:
            raise RangeMismatch(
                f"route names {me.peer_id[:12]} for [{me.range_start}, {me.range_end}); this is "
                f"{self.peer_id[:12]} holding {self.host.range}"
            )
        return open_


async def _receive(stream) -> bytes:
    with trio.fail_after(30):
        raw = await stream.receive_message()
    if raw is None:
        raise BundleError("stream ended before SessionOpen")
    return raw


async def _send_quietly(stream, data: bytes) -> None:
    """Best effort on a stream that may already be gone."""
    with trio.move_on_after(2), contextlib.suppress(Exception):
        await stream.send_message(data)


async def _close_quietly(stream) -> None:
    with trio.move_on_after(2), contextlib.suppress(Exception):
        await stream.aclose()


