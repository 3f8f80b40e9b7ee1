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

import torch
import trio

from meshd.errors import BundleError, MeshError, RangeMismatch
from meshd.runtime.host import ShardHost
from meshd.runtime.shard import HIDDEN_STATES
from meshd.session import messages as m
from meshd.session.link_compression import CompressionPolicy
from meshd.stats import percentiles
from meshd.wire import bundle as wire
from meshd.wire import session_pb2 as pb
from meshd.wire.bundle import HiddenStateBundle, Phase

log = logging.getLogger("meshd.session")

RESULTS_WAIT_S = 10.0
RESUME_GRACE_S = 5.0
OUTPUT_CACHE_BYTES = 64 * 1024**2
STATS_WINDOW = 20000


class NextHopFailed(MeshError):
    """The next hop of the route could not be reached or went away; the entry should avoid it."""

    code = "unreachable"

    def __init__(self, peer_id: str, message: str) -> None:
        super().__init__(message)
        self.peer_id = peer_id


class Refused(MeshError):
    """This hop does not admit the session now; the entry should route around it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class AdmissionLimits:
    max_sessions: int = 64
    max_queue: int = 32


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
    seam_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    entry_seam_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    seam_bytes: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    compute_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    queue_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    deserialize_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    serialize_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    # the same for prefill chunks: their seam crossing (from the previous hop or the entry), queueing
    # and compute, so that a time to first token can be taken apart too
    prefill_seam_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    prefill_queue_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    prefill_compute_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))

    def _windows(self) -> tuple[deque, ...]:
        return (self.seam_ms, self.entry_seam_ms, self.seam_bytes, self.compute_ms, self.queue_ms,
                self.deserialize_ms, self.serialize_ms, self.prefill_seam_ms, self.prefill_queue_ms,
                self.prefill_compute_ms)

    def reset(self) -> None:
        for window in self._windows():
            window.clear()

    def summary(self) -> dict:
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
    def __init__(
        self,
        peer_id: str,
        transport,
        host: ShardHost | None,
        model_id: str | None,
        compat_key: str | None,
        limits: AdmissionLimits | None = None,
        compression: str = "auto",
    ) -> None:
        self.peer_id = peer_id
        self.transport = transport
        self.host = host
        self.model_id = model_id
        self.compat_key = compat_key
        self.limits = limits or AdmissionLimits()
        self.leaving = False
        self.stats = HopStats()
        self.compression = compression
        self._links: dict[str, CompressionPolicy] = {}  # per next hop's peer id
        self._reserved: dict[tuple[str, int], int] = {}
        # What this hop sent downstream per session (for resuming after a repair), and sessions whose
        # route failed, kept for RESUME_GRACE_S in case the entry's new route keeps this hop.
        self._outputs: dict[tuple[str, int], _OutputCache] = {}
        self._retained: dict[tuple[str, int], float] = {}
        self._sinks: dict[tuple[str, int], object] = {}
        self._sink_ready: dict[tuple[str, int], trio.Event] = {}

    # -- results streams (tail side) -------------------------------------------------------------

    async def handle_results(self, stream) -> None:
        """The entry's stream for tokens of one session; held open until the entry ends it."""
        try:
            open_ = self._check_open(m.parse(await _receive(stream)), tail_only=True)
        except MeshError as exc:
            await _send_quietly(stream, m.error_from(exc, self.peer_id))
            await m.end_quietly(stream)
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
            if key not in self._reserved and key not in self._retained:  # no seam owns the KV
                self._forget(key)
            with trio.CancelScope(shield=True):
                await m.end_quietly(stream)

    # -- seam streams ----------------------------------------------------------------------------

    async def handle_seam(self, stream) -> None:
        key = None
        downstream_failed = trio.Event()  # set when the route failed further down (reported upstream already)
        downstream = None
        failure: bytes | None = None
        try:
            open_ = self._check_open(m.parse(await _receive(stream)))
            self._admit(open_)
            key = (open_.session_id, open_.epoch)
            self.stats.sessions_served += 1
            is_tail = open_.hop_index == len(open_.hops) - 1
            resumed = self._resume(open_, is_tail)
            if not is_tail:
                nxt = open_.hops[open_.hop_index + 1]
                forwarded = pb.SessionOpen()
                forwarded.CopyFrom(open_)
                forwarded.hop_index = open_.hop_index + 1
                if not resumed:  # what follows gets recomputed inputs: nothing downstream may resume
                    forwarded.unchanged_prefix = min(forwarded.unchanged_prefix, open_.hop_index)
                try:
                    downstream = await self.transport.open_stream(nxt.peer_id, nxt.address,
                                                                  m.SEAM_PATH)
                    await downstream.send_message(m.open_msg(forwarded))
                except Exception as exc:
                    raise NextHopFailed(nxt.peer_id, f"cannot reach the next hop: {exc}") from exc
            async with trio.open_nursery() as nursery:
                if downstream is not None:
                    nursery.start_soon(self._relay_upstream, downstream, stream, nursery.cancel_scope,
                                       downstream_failed)
                try:
                    await self._pump(stream, open_, downstream, is_tail, resumed)
                except Exception as exc:  # inside the nursery, so that it is not wrapped in a group
                    failure = self._failed(key, exc)
                nursery.cancel_scope.cancel()
        except Exception as exc:
            failure = self._failed(key, exc)
        finally:
            if key is not None:
                self._reserved.pop(key, None)
                failed = failure is not None or downstream_failed.is_set()
                if failed and self.host is not None and key in self.host.shard.kv:
                    self._retained[key] = time.monotonic() + RESUME_GRACE_S
                else:
                    self._forget(key)
            # Shielded: when a neighbour's connection dies this task is being cancelled, and the other
            # neighbour must still hear that the session is over (each wait below is bounded).
            with trio.CancelScope(shield=True):
                if failure is not None:
                    await _send_quietly(stream, failure)
                if downstream is not None:
                    await m.finish_stream(downstream, m.CLOSE)
                await m.end_quietly(stream)

    # -- admission ------------------------------------------------------------------------------

    @property
    def active_sessions(self) -> int:
        return len(self._reserved)

    @property
    def queued(self) -> int:
        """Steps waiting for this peer's compute (not yet taken into a batch)."""
        return 0 if self.host is None else self.host.batcher.waiting

    def kv_bytes_per_token(self) -> int:
        cfg = self.host.shard.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers = self.host.shard.spec.end - self.host.shard.spec.start
        return layers * 2 * cfg.num_key_value_heads * head_dim * 4

    def _admit(self, open_: pb.SessionOpen) -> None:
        """Admit a session against the session limit, the compute queue and the KV byte budget, or
        refuse with a reason the entry routes around."""
        if self.leaving:
            raise Refused("leaving", "this peer is leaving the mesh and takes no new sessions")
        if len(self._reserved) >= self.limits.max_sessions:
            raise Refused("overloaded", f"{len(self._reserved)} sessions running (limit {self.limits.max_sessions})")
        if self.queued >= self.limits.max_queue:
            raise Refused("overloaded", f"{self.queued} steps queued for compute (limit {self.limits.max_queue})")
        need = max(1, open_.max_tokens) * self.kv_bytes_per_token()
        budget = self.host.shard.kv.budget_bytes
        if budget is not None:
            reserved = sum(self._reserved.values())
            if reserved + need > budget:
                raise Refused("kv_budget", f"session needs {need} KV bytes; {budget - reserved} of {budget} free")
        self._reserved[(open_.session_id, open_.epoch)] = need

    def _failed(self, key, exc: Exception) -> bytes:
        """Log a session's failure on this hop; return the error message for upstream, naming the
        peer at fault: the next hop when it could not be reached, else this one."""
        self.stats.seam_errors += 1
        log.warning("session %s failed on this hop: %s: %s", key, type(exc).__name__, exc)
        if isinstance(exc, NextHopFailed):
            return m.error_msg(exc.code, str(exc), exc.peer_id)
        if isinstance(exc, MeshError):
            return m.error_from(exc, self.peer_id)
        return m.error_msg("seam_failed", str(exc), self.peer_id)

    async def _pump(self, stream, open_: pb.SessionOpen, downstream, is_tail: bool, resumed: int) -> None:
        key = (open_.session_id, open_.epoch)
        nxt = open_.hops[open_.hop_index + 1] if not is_tail else None
        outputs = self._outputs.get(key) if not is_tail else None
        while True:
            raw = await stream.receive_message()
            if raw is None:
                return
            parse_started = time.perf_counter()
            msg = m.parse(raw)
            kind = msg.WhichOneof("kind")
            if kind == "close":
                return
            if kind != "bundle":
                raise BundleError(f"unexpected {kind!r} message on a seam")
            bundle = wire.decode(msg.bundle)
            if (bundle.session_id, bundle.epoch) != key:
                raise BundleError("bundle belongs to another session than its stream")
            decoding = bundle.phase == Phase.DECODE
            if decoding:
                self.stats.deserialize_ms.append((time.perf_counter() - parse_started) * 1000)
            if bundle.sent_at_ns:
                crossed = (time.time_ns() - bundle.sent_at_ns) / 1e6
                if not decoding:
                    self.stats.prefill_seam_ms.append(crossed)
                else:
                    (self.stats.seam_ms if open_.hop_index > 0 else self.stats.entry_seam_ms).append(crossed)
                    self.stats.seam_bytes.append(len(raw))
            if bundle.start_position < resumed:
                # kept from the previous epoch: pass on what was computed then, compute only the rest
                cut = min(resumed, bundle.start_position + bundle.token_count)
                if not is_tail:
                    kept = outputs.slice(bundle.start_position, cut)
                    await self._send_downstream(downstream, nxt, _part(bundle, bundle.start_position, cut, kept))
                if cut == bundle.start_position + bundle.token_count:
                    continue
                bundle = _part(bundle, cut, bundle.start_position + bundle.token_count)
            result = await self.host.forward(bundle)
            if decoding:
                self.stats.compute_ms.append(result.compute_ms)
                self.stats.queue_ms.append(result.queue_ms)
            else:
                self.stats.prefill_compute_ms.append(result.compute_ms)
                self.stats.prefill_queue_ms.append(result.queue_ms)
            if not is_tail:
                out = _part(bundle, bundle.start_position, bundle.start_position + bundle.token_count,
                            result.hidden_states)
                await self._send_downstream(downstream, nxt, out)
                if outputs is None:  # kept after sending: the next hop need not wait for the copy
                    outputs = self._outputs.setdefault(key, _OutputCache())
                outputs.append(bundle.start_position, result.hidden_states)
            elif result.token is not None:
                sink = await self._sink_for(key)
                await sink.send_message(m.token_msg(bundle.start_position + bundle.token_count, result.token))

    async def _send_downstream(self, downstream, nxt: pb.HopAddress, bundle: HiddenStateBundle) -> None:
        bundle.range_start, bundle.range_end = nxt.range_start, nxt.range_end
        bundle.sent_at_ns = time.time_ns()
        link = self.link_policy(nxt.peer_id)
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
            raise NextHopFailed(nxt.peer_id, f"the next hop went away: {exc}") from exc
        link.record_send(len(data), time.perf_counter() - encoded)

    def link_policy(self, peer_id: str) -> CompressionPolicy:
        """The compression policy of the link to ``peer_id`` (what was measured on it so far)."""
        link = self._links.get(peer_id)
        if link is None:
            link = self._links[peer_id] = CompressionPolicy(self.compression,
                                                            window_bytes=self.transport.config.stream_window)
        return link

    # -- resuming after a repair ------------------------------------------------------------------

    def _resume(self, open_: pb.SessionOpen, is_tail: bool) -> int:
        """Keep the previous epoch's KV when every hop up to this one is unchanged; returns how many
        tokens of the session need no recomputing here (0: compute everything)."""
        self.purge_retained()
        if open_.hop_index >= open_.unchanged_prefix:
            return 0
        old = (open_.session_id, open_.resume_from_epoch)
        new = (open_.session_id, open_.epoch)
        if old not in self._retained:
            return 0
        outputs = self._outputs.get(old)
        # the last prompt token is always recomputed, so that the tail has logits to sample from
        limit = max(0, open_.prompt_tokens - 1)
        if not is_tail:
            limit = min(limit, outputs.length if outputs is not None else 0)
        kept = self.host.shard.kv.resume(old, new, limit) if limit else 0
        self._retained.pop(old, None)
        cache = self._outputs.pop(old, None)
        if kept and cache is not None:
            cache.truncate(kept)
            self._outputs[new] = cache
        if kept:
            self.host.batcher.forget(*old)  # the old epoch's KV lives on under the new one
            self.stats.resumed_sessions += 1
            log.info("session %s: kept %d tokens of epoch %d's KV for epoch %d", open_.session_id[:12], kept,
                     old[1], new[1])
        else:
            self._forget(old)
        return kept

    def purge_retained(self) -> None:
        now = time.monotonic()
        for key in [k for k, until in self._retained.items() if until <= now]:
            self._retained.pop(key, None)
            self._forget(key)

    def _forget(self, key) -> None:
        self._outputs.pop(key, None)
        if self.host is not None:
            self.host.release(*key)

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

    async def _relay_upstream(self, downstream, upstream, scope: trio.CancelScope, failed: trio.Event) -> None:
        """Pass errors from further down the route back toward the entry; end the session on one."""
        try:
            while True:
                raw = await downstream.receive_message()
                if raw is None:
                    return
                msg = m.parse(raw)
                if msg.WhichOneof("kind") == "error":
                    failed.set()
                    await _send_quietly(upstream, raw)
                    scope.cancel()
                    return
        except Exception as exc:
            failed.set()
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


class _OutputCache:
    """Hidden states a hop sent downstream for one session, in position order, bounded in size.

    A gap in positions or the size bound ends caching for the session: it then has nothing to resume.
    """

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.length = 0
        self.nbytes = 0
        self.broken = False

    def append(self, start: int, hidden: torch.Tensor) -> None:
        size = hidden.numel() * hidden.element_size()
        if self.broken or start != self.length or self.nbytes + size > OUTPUT_CACHE_BYTES:
            self.broken, self.parts, self.length, self.nbytes = True, [], 0, 0
            return
        if hidden.untyped_storage().nbytes() > size:  # a row of a batched step: do not keep the whole batch
            hidden = hidden.clone()
        self.parts.append(hidden)
        self.length += hidden.shape[0]
        self.nbytes += size

    def slice(self, start: int, end: int) -> torch.Tensor:
        return torch.cat(self.parts, dim=0)[start:end]

    def truncate(self, length: int) -> None:
        whole = torch.cat(self.parts, dim=0)[:length]
        self.parts, self.length, self.nbytes = [whole], length, whole.numel() * whole.element_size()


def _part(bundle: HiddenStateBundle, start: int, end: int, hidden: torch.Tensor | None = None) -> HiddenStateBundle:
    """Positions ``[start, end)`` of a bundle: its own input slice, or ``hidden`` as the output to pass on."""
    offset = start - bundle.start_position
    if hidden is not None:
        tensors = {HIDDEN_STATES: hidden}
    else:
        tensors = {name: t[offset : offset + end - start] for name, t in bundle.tensors.items()}
    last = end == bundle.start_position + bundle.token_count
    return HiddenStateBundle(
        session_id=bundle.session_id, epoch=bundle.epoch, step=bundle.step, phase=bundle.phase,
        start_position=start, token_count=end - start, tensors=tensors,
        range_start=bundle.range_start, range_end=bundle.range_end,
        sample=bundle.sample and last, sampling=bundle.sampling if start == 0 else None,
        sent_at_ns=bundle.sent_at_ns,
    )
