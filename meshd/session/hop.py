"""The hop side of a session on Trio: read a seam, run the shard, pass results on.

A hop reads ``SessionOpen`` and then bundles from its upstream stream, and, unless it is the tail,
opens one long-lived stream to the next hop. What to do with each bundle is decided by the state
machines of :mod:`meshd.session.hop_state`; this module only moves messages, runs the shard and
records timings. Errors go back upstream as ``SessionError`` messages naming the peer at fault;
whatever way a session ends (close, error, a vanished neighbour), this hop releases its KV state, or
keeps it for a few seconds when the route failed, for a repaired route that keeps this hop.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from meshd.errors import BundleError, ErrorCode, MeshError
from meshd.logs import bind_log_context, route_id
from meshd.metrics import PeerMetrics
from meshd.runtime.host import ShardHost
from meshd.runtime.kv import SessionKey
from meshd.runtime.model_info import ModelInfo
from meshd.runtime.prefix_kv import scoped_name
from meshd.session import messages as m
from meshd.session.hop_state import (
    AdmissionLimits,
    Compute,
    Holding,
    HopAction,
    HopBook,
    HopSession,
    NextHopFailed,
    SendDownstream,
    SendToken,
)
from meshd.session.link_compression import CompressionPolicy
from meshd.stats import percentiles
from meshd.transport.streams import MessageStream, StreamOpener
from meshd.wire import bundle as wire
from meshd.wire.bundle import HiddenStateBundle, Phase

log = logging.getLogger("meshd.session")

OPEN_WAIT_S = 30.0  # how long a new stream may take to send its SessionOpen
RESULTS_WAIT_S = 10.0  # how long the tail waits for the entry's results stream before failing the session
STATS_WINDOW = 20000
PURGE_INTERVAL_S = 0.25  # how often kept KV is checked for an expired grace


def _window() -> deque[float]:
    return deque(maxlen=STATS_WINDOW)


@dataclass
class LiveHopSession:
    """A session passing through this hop, as ``meshctl sessions`` shows it."""

    session_id: str
    epoch: int
    model_id: str
    hop_index: int
    hops: int
    layers: tuple[int, int]
    started: float  # monotonic
    steps: int = 0  # decode steps computed here

    def as_json(self, now: float) -> dict:
        elapsed = max(now - self.started, 1e-9)
        role = "head" if self.hop_index == 0 else "tail" if self.hop_index == self.hops - 1 else "middle"
        return {"session_id": self.session_id, "role": f"hop {self.hop_index} ({role})", "model": self.model_id,
                "layers": list(self.layers), "tokens": self.steps, "tok_s": round(self.steps / elapsed, 2),
                "age_s": round(elapsed, 2), "epoch": self.epoch, "hops": self.hops}


@dataclass
class HopStats:
    """What a peer measures about its seams and compute (for status, profiles and benchmarks).

    ``seam_ms`` holds, per decode bundle received from the previous hop, the time from the sender
    starting to encode it to this hop having decoded it (wall clocks: exact on one host, only as good
    as clock sync across hosts); ``entry_seam_ms`` the same for bundles straight from the entry.
    A decode step's time on this hop is split further into ``deserialize_ms`` (parsing the bundle that
    arrived), ``queue_ms`` (waiting for the compute thread), ``compute_ms`` (the forward itself) and
    ``serialize_ms`` (encoding the bundle for the next hop); what a seam costs beyond the sender's
    serializing and the receiver's deserializing is the network and the event loops in between.
    """

    sessions_served: int = 0
    seam_errors: int = 0
    resumed_sessions: int = 0
    compressed_bundles: int = 0
    compression_saved_bytes: int = 0
    seam_ms: deque[float] = field(default_factory=_window)
    entry_seam_ms: deque[float] = field(default_factory=_window)
    seam_bytes: deque[float] = field(default_factory=_window)
    compute_ms: deque[float] = field(default_factory=_window)
    queue_ms: deque[float] = field(default_factory=_window)
    deserialize_ms: deque[float] = field(default_factory=_window)
    serialize_ms: deque[float] = field(default_factory=_window)
    # the same for prefill chunks: their seam crossing (from the previous hop or the entry), queueing
    # and compute, so that a time to first token can be taken apart too
    prefill_seam_ms: deque[float] = field(default_factory=_window)
    prefill_queue_ms: deque[float] = field(default_factory=_window)
    prefill_compute_ms: deque[float] = field(default_factory=_window)

    def _windows(self) -> tuple[deque[float], ...]:
        return (self.seam_ms, self.entry_seam_ms, self.seam_bytes, self.compute_ms, self.queue_ms,
                self.deserialize_ms, self.serialize_ms, self.prefill_seam_ms, self.prefill_queue_ms,
                self.prefill_compute_ms)

    def reset(self) -> None:
        for window in self._windows():
            window.clear()

    def summary(self) -> dict[str, object]:
        return {
            "sessions_served": self.sessions_served, "seam_errors": self.seam_errors,
            "resumed_sessions": self.resumed_sessions, "compressed_bundles": self.compressed_bundles,
            "compression_saved_bytes": self.compression_saved_bytes,
            "seam_ms": percentiles(self.seam_ms), "entry_seam_ms": percentiles(self.entry_seam_ms),
            "decode_bundle_bytes": percentiles(self.seam_bytes), "compute_ms": percentiles(self.compute_ms),
            "queue_ms": percentiles(self.queue_ms), "deserialize_ms": percentiles(self.deserialize_ms),
            "serialize_ms": percentiles(self.serialize_ms), "prefill_seam_ms": percentiles(self.prefill_seam_ms),
            "prefill_queue_ms": percentiles(self.prefill_queue_ms),
            "prefill_compute_ms": percentiles(self.prefill_compute_ms),
        }


class HopService:
    """Serves the seams and results streams of sessions that pass through this peer's shard.

    ``clock`` times the grace a failed session's KV gets (Trio's clock: a fake one in tests).
    """

    def __init__(self, peer_id: str, opener: StreamOpener, host: ShardHost | None, model: ModelInfo | None,
                 limits: AdmissionLimits | None = None, compression: str = "auto", stream_window: int = 1024 * 1024,
                 clock: Callable[[], float] = trio.current_time, metrics: PeerMetrics | None = None) -> None:
        self.peer_id = peer_id
        self.metrics = metrics or PeerMetrics()
        self.live: dict[SessionKey, LiveHopSession] = {}
        self.opener = opener
        self.host = host
        self.model = model
        self.book = HopBook(peer_id, limits or AdmissionLimits())
        self.stats = HopStats()
        self.compression = compression
        self.stream_window = stream_window
        self.clock = clock
        self._links: dict[str, CompressionPolicy] = {}  # per next hop's peer id
        self._sinks: dict[SessionKey, MessageStream] = {}
        self._sink_ready: dict[SessionKey, trio.Event] = {}
        self.on_kept: Callable[[bytes], None] | None = None  # told the store key of each prefix this hop keeps

    # -- what this hop holds --------------------------------------------------------------------

    @property
    def leaving(self) -> bool:
        return self.book.leaving

    @leaving.setter
    def leaving(self, value: bool) -> None:
        self.book.leaving = value

    @property
    def active_sessions(self) -> int:
        return self.book.active_sessions

    @property
    def queued(self) -> int:
        """Steps waiting for this peer's compute (not yet taken into a batch)."""
        return 0 if self.host is None else self.host.batcher.waiting

    def holding(self) -> Holding | None:
        host, model = self.host, self.model
        if host is None or model is None or host.shard is None:
            return None
        shard = host.shard
        return Holding(peer_id=self.peer_id, model_id=model.model_id, compat_key=model.compat_key,
                       layers=(shard.spec.start, shard.spec.end), kv_bytes_per_token=shard.kv_bytes_per_token(),
                       kv_budget_bytes=shard.kv.budget_bytes)

    def purge_retained(self) -> None:
        """Release the KV of failed sessions whose grace for a repair is over."""
        self._release(self.book.expired(self.clock()))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Release kept KV as its grace runs out, until cancelled."""
        task_status.started()
        while True:
            await trio.sleep(PURGE_INTERVAL_S)
            self.purge_retained()

    def _release(self, keys: list[SessionKey]) -> None:
        if self.host is not None:
            for key in keys:
                self.host.release(*key)

    def _resume_kv(self, old: SessionKey, new: SessionKey, limit: int) -> int:
        assert self.host is not None
        kept = self.host.require_shard().kv.resume(old, new, limit)
        if kept:
            self.host.batcher.forget(*old)  # the old epoch's KV lives on under the new one
            self.stats.resumed_sessions += 1
        return kept

    # -- results streams (tail side) -------------------------------------------------------------

    async def handle_results(self, stream: MessageStream) -> None:
        """The entry's stream for tokens of one session; held open until the entry ends it."""
        try:
            open_ = self.book.check_open(m.parse(await _receive_open(stream)), self.holding(), tail_only=True)
        except MeshError as exc:
            await _send_quietly(stream, m.error_from(exc, self.peer_id))
            await m.end_quietly(stream)
            return
        key = (open_.session_id, open_.epoch)
        refusal = ("only the session's entry opens its results stream" if stream.peer_id != open_.entry_peer_id
                   else "this session's results stream is open already" if key in self._sinks else None)
        if refusal is not None:  # a peer that learnt the session's id must not take its tokens
            await _send_quietly(stream, m.error_msg(ErrorCode.PROTOCOL, refusal, self.peer_id))
            await m.end_quietly(stream)
            return
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
            self._release(self.book.results_ended(key))
            with trio.CancelScope(shield=True):
                await m.end_quietly(stream)

    async def _sink_for(self, key: SessionKey) -> MessageStream:
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

    # -- seam streams ----------------------------------------------------------------------------

    async def handle_seam(self, stream: MessageStream) -> None:
        key: SessionKey | None = None
        downstream: MessageStream | None = None
        downstream_failed = trio.Event()  # the route failed further down (already reported upstream)
        failure: bytes | None = None
        try:
            holding = self.holding()
            open_ = self.book.check_open(m.parse(await _receive_open(stream)), holding)
            assert holding is not None
            bind_log_context(session=open_.session_id, route=route_id(open_.epoch, [h.peer_id for h in open_.hops]))
            key = self.book.admit(open_, holding, self.queued, opener=stream.peer_id, now=time.monotonic())
            self.stats.sessions_served += 1
            me = open_.hops[open_.hop_index]
            self.live[key] = LiveHopSession(open_.session_id, open_.epoch, open_.model_id, open_.hop_index,
                                            len(open_.hops), (me.range_start, me.range_end), time.monotonic())
            log.info("session %s opened on layers [%d, %d), hop %d of %d", open_.session_id, me.range_start,
                     me.range_end, open_.hop_index + 1, len(open_.hops))
            resumed, released = self.book.resume(open_, self._resume_kv, self.clock())
            self._release(released)
            session = HopSession(self.book, open_, resumed, upstream_peer_id=stream.peer_id)
            forwarded = session.downstream_open()
            if forwarded is not None:
                nxt = forwarded.hops[forwarded.hop_index]
                try:
                    downstream = await self.opener.open_stream(nxt.peer_id, nxt.address, m.SEAM_PATH)
                    await downstream.send_message(m.open_msg(forwarded))
                except Exception as exc:
                    raise NextHopFailed(nxt.peer_id, f"cannot reach the next hop: {exc}") from exc
            async with trio.open_nursery() as nursery:
                if downstream is not None:
                    nursery.start_soon(self._relay_errors_upstream, downstream, stream, nursery.cancel_scope,
                                       downstream_failed)
                try:
                    await self._pump(stream, session, downstream)
                except Exception as exc:  # inside the nursery, so that it is not wrapped in a group
                    failure = self._failed(key, exc)
                nursery.cancel_scope.cancel()
        except Exception as exc:
            failure = self._failed(key, exc)
        finally:
            if key is not None:
                done = self.live.pop(key, None)
                log.info("session %s closed on this hop after %d decode steps%s", key[0], done.steps if done else 0,
                         " (failed)" if failure is not None else "")
                failed = failure is not None or downstream_failed.is_set()
                kv_held = self.host is not None and self.host.shard is not None and key in self.host.shard.kv
                self._release(self.book.finish(key, failed=failed, kv_held=kv_held, now=self.clock()))
            # Shielded: when a neighbour's connection dies this task is being cancelled, and the other
            # neighbour must still hear that the session is over (each wait below is bounded).
            with trio.CancelScope(shield=True):
                if failure is not None:
                    await _send_quietly(stream, failure)
                if downstream is not None:
                    await m.finish_stream(downstream, m.CLOSE)
                await m.end_quietly(stream)

    async def _pump(self, stream: MessageStream, session: HopSession, downstream: MessageStream | None) -> None:
        first_hop = session.open.hop_index == 0
        live = self.live.get(session.key)
        seam_seconds = self.metrics.seam.labels("entry" if first_hop else "hop")  # looked up once per session
        while True:
            raw = await stream.receive_message()
            if raw is None:
                return
            parse_started = time.perf_counter()
            bundle = m.seam_bundle(m.parse(raw))
            if bundle is None:  # the entry closed the session
                return
            decoding = bundle.phase == Phase.DECODE
            if decoding:
                if live is not None:
                    live.steps += 1
                self.stats.deserialize_ms.append((time.perf_counter() - parse_started) * 1000)
            if bundle.sent_at_ns:
                crossed = (time.time_ns() - bundle.sent_at_ns) / 1e6
                if not decoding:
                    self.stats.prefill_seam_ms.append(crossed)
                else:
                    (self.stats.entry_seam_ms if first_hop else self.stats.seam_ms).append(crossed)
                    seam_seconds.observe(crossed / 1000)
                    self.stats.seam_bytes.append(len(raw))
            await self._perform(session, session.on_bundle(bundle), downstream)

    async def _perform(self, session: HopSession, actions: list[HopAction], downstream: MessageStream | None) -> None:
        for action in actions:
            if isinstance(action, Compute):
                assert self.host is not None
                result = await self.host.forward(action.bundle)
                if action.bundle.keep_prefix and self.on_kept is not None:
                    self.on_kept(scoped_name(action.bundle.prefix_scope, action.bundle.keep_prefix))
                if action.bundle.phase == Phase.DECODE:
                    self.stats.compute_ms.append(result.compute_ms)
                    self.stats.queue_ms.append(result.queue_ms)
                else:
                    self.stats.prefill_compute_ms.append(result.compute_ms)
                    self.stats.prefill_queue_ms.append(result.queue_ms)
                await self._perform(session, session.on_computed(action.bundle, result), downstream)
            elif isinstance(action, SendDownstream):
                assert downstream is not None and session.next_hop is not None
                await self._send_downstream(downstream, session.next_hop.peer_id, action.bundle)
                session.on_sent(action)
            elif isinstance(action, SendToken):
                sink = await self._sink_for(session.key)
                await sink.send_message(m.token_msg(action.position, action.token, action.logprob,
                                                    list(action.top_logprobs)))

    async def _send_downstream(self, downstream: MessageStream, next_peer: str, bundle: HiddenStateBundle) -> None:
        bundle.sent_at_ns = time.time_ns()
        link = self.link_policy(next_peer)
        raw_bytes = wire.raw_tensor_bytes(bundle)
        compress = link.should_compress(raw_bytes)
        started = time.perf_counter()
        data = m.bundle_msg(wire.encode(bundle, compress=compress))
        encoded = time.perf_counter()
        if bundle.phase == Phase.DECODE:
            self.stats.serialize_ms.append((encoded - started) * 1000)
        if compress:
            link.record_compression(raw_bytes, len(data), encoded - started)
            self.stats.compressed_bundles += 1
            self.stats.compression_saved_bytes += max(0, raw_bytes - len(data))
        try:
            await downstream.send_message(data)
        except Exception as exc:
            raise NextHopFailed(next_peer, f"the next hop went away: {exc}") from exc
        link.record_send(len(data), time.perf_counter() - encoded)

    def link_policy(self, peer_id: str) -> CompressionPolicy:
        """The compression policy of the link to ``peer_id`` (what was measured on it so far)."""
        link = self._links.get(peer_id)
        if link is None:
            link = self._links[peer_id] = CompressionPolicy(self.compression, window_bytes=self.stream_window)
        return link

    def _failed(self, key: SessionKey | None, exc: Exception) -> bytes:
        """Log a session's failure on this hop; return the error message for upstream, naming the
        peer at fault: the next hop when it could not be reached, else this one."""
        self.stats.seam_errors += 1
        if key is None:  # refused before admission
            code = str(exc.code if isinstance(exc, MeshError) else ErrorCode.SEAM_FAILED)
            self.metrics.refusals.labels(code).inc()
            self.metrics.event("refusal", code=code, message=str(exc))
        log.warning("session %s failed on this hop: %s: %s", key, type(exc).__name__, exc)
        if isinstance(exc, NextHopFailed):
            return m.error_msg(exc.code, str(exc), exc.peer_id)
        if isinstance(exc, MeshError):
            return m.error_from(exc, self.peer_id)
        return m.error_msg(ErrorCode.SEAM_FAILED, str(exc), self.peer_id)

    async def _relay_errors_upstream(self, downstream: MessageStream, upstream: MessageStream,
                                     scope: trio.CancelScope, failed: trio.Event) -> None:
        """Pass errors from further down the route back toward the entry; end the session on one."""
        try:
            while True:
                raw = await downstream.receive_message()
                if raw is None:
                    return
                if m.parse(raw).WhichOneof("kind") == "error":
                    failed.set()
                    await _send_quietly(upstream, raw)
                    scope.cancel()
                    return
        except Exception as exc:
            failed.set()
            await _send_quietly(upstream, m.error_msg(ErrorCode.UNREACHABLE, f"the next hop failed: {exc}",
                                                      downstream.peer_id))
            scope.cancel()


async def _receive_open(stream: MessageStream) -> bytes:
    with trio.fail_after(OPEN_WAIT_S):
        raw = await stream.receive_message()
    if raw is None:
        raise BundleError("stream ended before SessionOpen")
    return raw


async def _send_quietly(stream: MessageStream, data: bytes) -> None:
    """Best effort on a stream that may already be gone."""
    with trio.move_on_after(2), contextlib.suppress(Exception):
        await stream.send_message(data)

