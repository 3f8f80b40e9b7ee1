"""The model this peer offers, and the one shard of it that it loads: placement, loading, speed.

A peer offers one model directory. Its range comes from the operator (``--layers``) or from the
tracker's placement order; either way it loads once, checks that the shard computes
(:mod:`meshd.runtime.doctor`), measures how fast it decodes its range, and from then on its card says
so. A range that fails to load or to pass the checks is not served: the card says why instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import trio

from meshd.audit import speed
from meshd.errors import ErrorCode, KVBudgetExceeded, MeshError
from meshd.identity import Identity
from meshd.kvtier.snapshots import Encoded, Expected, encode_snapshot
from meshd.models.text import TextCodec
from meshd.runtime.doctor import Check, check_shard
from meshd.runtime.host import ShardHost
from meshd.runtime.model_info import ModelInfo
from meshd.runtime.prefix_kv import MAX_PROBED_PREFIXES, PrefixSnapshot, prefix_scope, scoped_name
from meshd.runtime.shard import Shard
from meshd.runtime.speed_probe import decode_steps, measure_decode_tok_s, measure_prefill_tok_s
from meshd.wire import card_pb2 as cpb
from meshd.wire import kv_tier_pb2 as kvpb
from meshd.wire import rpc_pb2 as rpb

log = logging.getLogger("meshd.runtime")


class PlacementRefused(MeshError):
    """A placement order this peer cannot follow (another model or compat key, a range outside it)."""

    code = ErrorCode.BAD_REQUEST


OUTBOX_SNAPSHOTS = 2  # encoded prefixes a worker holds for the hops importing them


Importer = Callable[[Expected, str], Awaitable[PrefixSnapshot | None]]
"""``importer(expected, source)``: the snapshot ``expected`` describes, from the peer ``source`` (a prefill
worker) or, with ``source`` empty, from the KV tier; None when it has none."""


class CheckRefused(MeshError):
    """A speed check this peer does not run: another model or compat key, no range, too many steps."""

    code = ErrorCode.BAD_REQUEST


class ServedModel:
    def __init__(self, info: ModelInfo, host: ShardHost, pinned: tuple[int, int] | None = None,
                 on_change: Callable[[], None] = lambda: None, measured_ms: dict[str, float] | None = None,
                 prepare: Callable[[int, int], Awaitable[None]] | None = None, prefill_only: bool = False) -> None:
        """``prepare(start, end)``: what must happen before a range can load (fetching its tensors);
        ``prefill_only``: the card offers the range to prefill workers only."""
        self.info = info
        self.prepare = prepare
        self.host = host
        self.pinned = pinned
        self.prefill_only = prefill_only
        self.on_change = on_change
        self.measured_ms = measured_ms or {}  # what choosing the numerics measured
        self.class_since_ms = int(time.time() * 1000)  # computing the model in this numerics class since
        self.class_from = ""  # the peer whose numerics class this peer took instead of the one it measured
        self.decode_tok_s = 0.0
        self.probed_prefill_tok_s = 0.0  # measured after loading; the batcher's own figure once it has one
        self.card_prefill_tok_s = 0.0  # the figure cards carry: moved only when the measured one moved clearly
        self.load_started = False  # a range was ordered or pinned and is to load: no other order is taken
        self.loading = False  # a load is running now
        self.measured = False     # loaded, checked and its speeds measured: only then does the card offer the range
        self.error = ""          # why no range is served, after a failed load or check
        self.checks: list[Check] = []
        self._speed_checking = trio.Lock()
        self._outbox: OrderedDict[bytes, Encoded] = OrderedDict()  # kept prefixes encoded for importing hops
        self._outbox_lock = threading.Lock()

    @property
    def range(self) -> tuple[int, int] | None:
        """The loaded range; None until loading finished."""
        return self.host.range

    def card_entry(self) -> cpb.ModelServed:
        """This model's entry in the capability card."""
        info = self.info
        # not before its speeds are measured: a route planned meanwhile would queue behind the probes,
        # and a card claiming no speed yet is re-issued with one, which starts the entries' checks again
        loaded = self.host.range if self.measured else None
        start = loaded[0] if loaded else (self.pinned[0] if self.pinned else 0)
        return cpb.ModelServed(
            model_id=info.model_id, compat_key=info.compat_key, n_layers=info.n_layers, range_start=start,
            range_end=loaded[1] if loaded else 0, decode_tok_s=self.decode_tok_s, pinned=self.pinned is not None,
            layer_bytes=info.layer_bytes, edge_bytes=info.edge_bytes, context_length=info.context_length,
            numerics=info.numerics.name, shard_error=self.error, backend=info.numerics.backend,
            quantization=info.numerics.weights.removeprefix("gguf-"),
            prefill_tok_s=self._card_prefill_figure(),
            kv_token_bytes=shard.kv_bytes_per_token() if (shard := self.host.shard) is not None else 0,
            prefill_only=self.prefill_only, class_since_ms=self.class_since_ms,
        )

    def _card_prefill_figure(self) -> float:
        measured = self.host.batcher.costs.prefill_tok_s() or self.probed_prefill_tok_s
        self.card_prefill_tok_s = card_figure(self.card_prefill_tok_s, measured)
        return self.card_prefill_tok_s

    def accept(self, order: rpb.PlacementOrder) -> tuple[int, int] | None:
        """Check a placement order; the range to load now, or None when loading already started."""
        info = self.info
        if order.model_id != info.model_id:
            raise PlacementRefused(f"placement for {order.model_id!r}; this peer offers {info.model_id!r}")
        if order.compat_key != info.compat_key:
            raise PlacementRefused(f"placement for compat key {order.compat_key}; this peer has {info.compat_key}")
        start, end = order.range.start, order.range.end
        if not 0 <= start < end <= info.n_layers:
            raise PlacementRefused(f"placement range [{start}, {end}) is outside the model's {info.n_layers} layers")
        if self.pinned is not None:
            raise PlacementRefused(f"this peer's range is pinned to {list(self.pinned)}")
        if self.error:
            raise PlacementRefused(f"this peer's shard failed its checks: {self.error}")
        if self.load_started:
            return None
        self.load_started = True
        return start, end

    async def load(self, start: int, end: int) -> None:
        """Load ``[start, end)``, check it, measure its decode and prefill speeds, and tell the card; a failure is
        recorded and said by the card, never raised (the peer goes on without a range)."""
        self.load_started = self.loading = True
        try:
            await self._load(start, end)
        finally:
            self.loading = False

    async def _load(self, start: int, end: int) -> None:
        if self.prepare is not None:
            try:
                await self.prepare(start, end)
            except (MeshError, OSError) as exc:  # nothing is lost: the next placement order tries again
                self.load_started = False
                log.error("layers [%d, %d) of %s cannot load yet: %s", start, end, self.info.model_id, exc)
                return
        try:
            # requests are answered with the model's tokenizer: a model whose tokenizer fails is not served
            await trio.to_thread.run_sync(TextCodec.load, self.host.model_dir)
            self.checks = await self.host.load(start, end, check=check_shard) or []
            self.decode_tok_s = await self.host.run_sync(measure_decode_tok_s, self.host.require_shard())
            try:
                self.probed_prefill_tok_s = await self.host.run_sync(measure_prefill_tok_s, self.host.require_shard())
            except KVBudgetExceeded:
                log.info("the KV budget holds no prefill probe: the prefill speed is unmeasured until prompts come")
        except MeshError as exc:
            self.error = str(exc)
            log.error("layers [%d, %d) of %s are not served: %s", start, end, self.info.model_id, exc)
        else:
            self.measured = True
            log.info("layers [%d, %d) passed their checks and decode at %.1f tok/s on this peer", start, end,
                     self.decode_tok_s)
        self.on_change()

    async def serve_speed_check(self, sender: str, check: rpb.SpeedCheck) -> rpb.SpeedChecked:
        """Decode ``check.steps`` steps of the loaded range for a peer timing this one's card claim
        (:mod:`meshd.audit.speed`), one check at a time, on the compute thread the sessions use."""
        if check.model_id != self.info.model_id or check.compat_key != self.info.compat_key:
            raise CheckRefused(f"speed check for {check.model_id!r} ({check.compat_key[:12]}); this peer serves "
                               f"{self.info.model_id!r} ({self.info.compat_key[:12]})")
        allowed = speed.check_steps_allowed(self.decode_tok_s)  # the speed its card claims
        if check.steps > allowed:
            raise CheckRefused(f"a speed check runs at most {allowed} steps on this peer "
                               f"({speed.MAX_CHECK_S:g} s at its {self.decode_tok_s:.0f} tok/s), not {check.steps}")
        if self.range is None or self.error:
            raise CheckRefused("this peer serves no range of the model yet")
        async with self._speed_checking:
            await self.host.run_sync(decode_steps, self.host.require_shard(), check.steps,
                                     f"check-{sender[:16]}")
        return rpb.SpeedChecked(steps=check.steps)

    async def serve_prefix_probe(self, sender: str, probe: rpb.PrefixProbe,
                                 importer: Importer | None = None, own_id: str = "") -> rpb.PrefixHeld:
        """Which of the prefixes an entry names this peer's shard keeps for its sessions through
        ``probe.upstream_peer_id`` (:mod:`meshd.runtime.prefix_kv`). The longest one not kept here is
        imported first when it can be: from the prefill worker the probe names (this peer's own copy
        under the worker route's scope when it was its own worker), else from the KV tier through
        ``importer``. ``own_id``: this peer's id."""
        if probe.model_id != self.info.model_id or probe.compat_key != self.info.compat_key:
            raise CheckRefused(f"prefix probe for {probe.model_id!r} ({probe.compat_key[:12]}); this peer serves "
                               f"{self.info.model_id!r} ({self.info.compat_key[:12]})")
        if len(probe.names) != len(probe.lengths) or len(probe.names) > MAX_PROBED_PREFIXES:
            raise CheckRefused(f"a prefix probe names at most {MAX_PROBED_PREFIXES} prefixes, each with its length")
        shard = self.host.shard
        if shard is None:
            return rpb.PrefixHeld()
        scope = prefix_scope(sender, probe.upstream_peer_id)
        asked = [(name, length, scoped_name(scope, name)) for name, length in zip(probe.names, probe.lengths,
                                                                                   strict=True)]
        held = [name for name, length, key in asked if shard.kv.prefixes.holds(key, length)]
        longest = max((length for name, length, _key in asked if name in held), default=0)
        missing = sorted(((length, key, name) for name, length, key in asked if length > longest), reverse=True)
        if not missing:
            return rpb.PrefixHeld(names=held)
        length, key, name = missing[0]
        snapshot: PrefixSnapshot | None = None
        if probe.source_peer_id:
            worker_key = scoped_name(prefix_scope(sender, probe.source_upstream_peer_id), name)
            if probe.source_peer_id == own_id:
                snapshot = shard.kv.prefixes.peek(worker_key)
                snapshot = snapshot if snapshot is not None and snapshot.length == length else None
            elif importer is not None:
                snapshot = await importer(self.tier_expected(shard, worker_key, length), probe.source_peer_id)
        elif importer is not None:
            snapshot = await importer(self.tier_expected(shard, key, length), "")
        if snapshot is not None and shard.kv.keep_snapshot(key, snapshot):
            held.append(name)
        return rpb.PrefixHeld(names=held)

    def kept_chunk(self, get: kvpb.KVGet, identity: Identity) -> kvpb.KVChunk | None:
        """Chunk ``get.index`` of a prefix this hop keeps, as the KV tier would hand it out (for a decode
        hop importing what this peer prefilled as a worker); None when it is not kept here. Encoded once
        per prefix (in the caller's worker thread) and held for the chunks that follow."""
        shard = self.host.shard
        if shard is None or get.compat_key != self.info.compat_key or \
                (get.range_start, get.range_end) != (shard.spec.start, shard.spec.end):
            return None
        with self._outbox_lock:
            encoded = self._outbox.get(get.key)
            if encoded is None:
                encoded = self.encoded_for_tier(get.key, identity)
                if encoded is None:
                    return None
                self._outbox[get.key] = encoded
                while len(self._outbox) > OUTBOX_SNAPSHOTS:
                    self._outbox.popitem(last=False)
            described, chunks = encoded
            if get.index >= len(chunks):
                return None
            if get.index == len(chunks) - 1:
                self._outbox.pop(get.key, None)  # the last chunk: whoever asked has it all
        return kvpb.KVChunk(snapshot=described, index=get.index, data=chunks[get.index])

    def tier_expected(self, shard: Shard, key: bytes, length: int) -> Expected:
        """What a snapshot of the prefix ``key`` of ``length`` tokens is on this peer's shard."""
        kv_heads, head_dim = shard.adapter.kv_heads_and_dim(shard.config)
        return Expected(key=key, model_id=self.info.model_id, compat_key=self.info.compat_key,
                        numerics=shard.numerics.name, range_start=shard.spec.start, range_end=shard.spec.end,
                        length=length, kv_heads=kv_heads, head_dim=head_dim, dtype=shard.spec.dtype)

    def encoded_for_tier(self, key: bytes, identity: Identity) -> Encoded | None:
        """The kept prefix ``key`` as the KV tier takes it (None once it is no longer kept)."""
        shard = self.host.shard
        snapshot = shard.kv.prefixes.peek(key) if shard is not None else None
        if shard is None or snapshot is None:
            return None
        return encode_snapshot(snapshot, self.tier_expected(shard, key, snapshot.length), identity)


CARD_FIGURE_BAND = 1.25  # a card's speed figure follows a measurement that differs by more than this factor


def card_figure(published: float, measured: float) -> float:
    """What a card says of a speed last published as ``published`` once ``measured``: ``measured`` to two
    significant figures when it differs from ``published`` by more than :data:`CARD_FIGURE_BAND` times
    (or nothing was published), else ``published`` unchanged. A card is re-issued when it changes, and
    a smoothed figure that wanders a few percent is no news to a route or a cost estimate."""
    if measured <= 0:
        return published
    if published > 0 and published / CARD_FIGURE_BAND <= measured <= published * CARD_FIGURE_BAND:
        return published
    return float(f"{measured:.2g}")
