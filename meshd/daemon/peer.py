"""One meshd peer: the planes of the design, wired together under one nursery.

``Peer`` builds each plane from the one configuration and connects them; it decides nothing itself.
The identity signs; the transport carries peer RPC (:mod:`meshd.rpc`) and session streams; the
control plane (:mod:`meshd.daemon.control_plane`) runs gossip, the election and the tracker's
duties; the served model (:mod:`meshd.runtime.served_model`) loads this peer's range; the hop
service (:mod:`meshd.session.hop`) serves seams through it; the entry (:mod:`meshd.session.entry`)
runs the generations this peer's API receives; reachability keeps relays and dial-back tests going.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, replace

import psutil
import trio

from meshd import __version__
from meshd.address import Address
from meshd.admission import Membership, NotMember
from meshd.admission.gate import MEMBERSHIP_HEADER
from meshd.api.openai_server import build_app, serve_asgi, start_listener
from meshd.audit.auditor import Auditor
from meshd.audit.book import AuditBook
from meshd.audit.speed import SpeedChecks
from meshd.capture.recorder import CaptureRecorder
from meshd.capture.replayer import Replayer
from meshd.capture.store import Retention
from meshd.daemon.backend import MeshBackend
from meshd.daemon.config import PeerConfig
from meshd.daemon.control import build_control_app
from meshd.daemon.control_plane import ControlPlane
from meshd.daemon.numerics_adoption import ClassHolder, NumericsAdoption
from meshd.daemon.reachability import Reachability
from meshd.daemon.status import peer_status
from meshd.errors import MeshError, ModelFormatError
from meshd.files import write_atomically
from meshd.identity import Identity
from meshd.identity.keys import IdentityError, is_peer_id
from meshd.identity.private_files import PrivateFileError
from meshd.kvtier.client import TierClient
from meshd.kvtier.snapshots import Expected
from meshd.kvtier.store import TierRefused, TierStore
from meshd.links.profiles import parse_link_shape
from meshd.logs import RecentRecords
from meshd.metrics import Levels, PeerMetrics, metrics_app
from meshd.models.artifacts import ModelFilesCache
from meshd.models.gguf_model import model_directory
from meshd.models.text import TextCodec
from meshd.rpc import RPC_PATH, RpcRouter
from meshd.rpc.router import MAX_OUTSIDER_REQUEST_BYTES, MAX_REQUEST_BYTES
from meshd.runtime.cpu_turn import CpuTurn
from meshd.runtime.devices import device_memory_bytes, resolve_device
from meshd.runtime.host import ComputeThread, ShardHost
from meshd.runtime.model_info import ModelInfo, choose_numerics, class_here, describe_model
from meshd.runtime.prefix_kv import PrefixSnapshot
from meshd.runtime.served_model import CheckRefused, PlacementRefused, ServedModel
from meshd.session import messages as seam
from meshd.session.drafting import DraftModel
from meshd.session.entry import EntryConfig, EntrySessions
from meshd.session.hop import HopService
from meshd.session.hop_state import AdmissionLimits
from meshd.session.prefixes import load_secret
from meshd.session.repair import RepairConfig
from meshd.session.routes import RouteClient
from meshd.trace.service import TraceService
from meshd.tracker.links import LinkTable
from meshd.tracker.view import ShardOffer
from meshd.transport import MessageStream, StreamHandler, Transport
from meshd.weights.join import ModelJoin
from meshd.weights.source import WeightsSource
from meshd.wire import admission_pb2 as apb
from meshd.wire import card_pb2 as cpb
from meshd.wire import kv_tier_pb2 as kvpb
from meshd.wire import rpc_pb2 as rpb

log = logging.getLogger("meshd.peer")

CARD_REFRESH_S = 2.0  # how often load changes are checked for and re-published
PINNED_RETRY_S = 10.0  # a pinned range whose tensors could not be fetched is tried again after this


@dataclass
class BoundAddresses:
    """Where this peer actually listens (a configured port 0 becomes the port the kernel chose)."""

    listen: str
    advertise: str
    api: str
    control: str
    metrics: str


class Peer:
    """One daemon: builds every plane from ``config`` and runs them under one nursery (``run``)."""

    def __init__(self, config: PeerConfig, recent_logs: RecentRecords | None = None) -> None:
        self.config = config
        self.recent_logs = recent_logs or RecentRecords()  # what `meshctl logs` shows
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.identity = Identity.load_or_create(config.data_dir)
        try:
            self.prefix_secret = load_secret(config.data_dir)  # what this entry's prefix names are keyed with
        except PrivateFileError as exc:
            raise IdentityError(str(exc)) from None
        self.peer_id = self.identity.peer_id
        self.membership = Membership.load(config.data_dir, self.identity, open_mesh=config.open_mesh,
                                          invite=config.invite, founding=not config.bootstrap)
        for address in self.membership.addresses:  # where the invite's issuer listens: join through it
            if address not in config.bootstrap:
                config.bootstrap.append(address)
        self.bound = BoundAddresses(listen=config.listen, advertise=config.advertised, api=config.api,
                                    control=config.control, metrics=config.metrics)
        self.metrics = PeerMetrics()
        self.metrics.watch(self._levels)
        link_shape = parse_link_shape(config.link_shape) if config.link_shape else None
        if link_shape is not None:
            log.warning("link shaping is on (for testing and benchmarks): every byte this peer sends to peers "
                        "travels a modelled %s link (%s)", link_shape.label, link_shape.spec)
        self.transport = Transport(self.identity, link_shape=link_shape)
        self.served: ServedModel | None = None
        self.model_error = ""  # why the configured model is not offered at all (it could not be read)
        if config.model is not None:
            try:
                self.served = self._served_model(config)
            except MeshError as exc:
                self.model_error = str(exc)
                log.error("the model at %s is not offered: %s", config.model, exc)
        self.reachability = Reachability(config, self.transport, self.identity, advertised=lambda: self.bound.advertise,
                                         on_change=self._republish, membership=self._membership_bytes)
        self.hops = HopService(self.peer_id, self.transport, self.served.host if self.served else None,
                               self.served.info if self.served else None,
                               AdmissionLimits(max_sessions=config.max_sessions, max_queue=config.max_queue,
                                               opens_per_s=config.session_opens_per_s),
                               compression=config.compression, stream_window=self.transport.config.stream_window,
                               metrics=self.metrics)
        self.control = ControlPlane(self.identity, config, self.transport, card=self._card,
                                    directly_reachable=lambda: bool(self.reachability.direct_addresses()),
                                    metrics=self.metrics, last_received=self.transport.last_received)
        if self.membership.gate is not None:
            self.control.gossip.admit_with(self.membership.gate)
        # a class this peer measured gives way to the one the longest-serving peer computes in
        self.adoption = (NumericsAdoption(self._class_held, lambda: self.control.view.cards().values(),
                                          self._class_info, self._adopt_class, self._may_change_class)
                         if self.served is not None and not config.numerics
                         and self.served.info.numerics.backend == "torch" else None)
        self.audits = AuditBook(self.peer_id)
        self.control.gossip.accusations = self.audits.accusations
        self.tier_store = TierStore(config.kv_tier) if config.kv_tier else None  # the memory this peer lends
        self.tier = TierClient(self.transport, self.control.view,
                               idle=lambda: self.hops.active_sessions == 0 and self.hops.queued == 0)
        self.hops.on_kept = self._publish_prefix
        self.speed = SpeedChecks(self.control.view, self.transport,
                                 on_verdict=lambda verdict: self.metrics.speed_checks.labels(verdict).inc())
        self.routes = RouteClient(self.control.view, self.transport, self.control.tracker, self.control.duties,
                                  excluded=self.audits.excluded, avoided=self.speed.avoided,
                                  on_route=self.speed.on_route)
        self.auditor: Auditor | None = None  # once running: it needs the sessions nursery
        self.capture = CaptureRecorder(config.data_dir, config.capture,
                                       Retention(config.capture_max_records, config.capture_max_bytes,
                                                 config.capture_max_age_s), self.peer_id)
        self.replayer: Replayer | None = None  # once running, like the auditor
        self.files = ModelFilesCache(config.data_dir, self.served.info if self.served else None, self.transport)
        self.weights = WeightsSource()
        if self.served is not None:
            self.weights.offer(self.served.info)
        # a model named without files: fetched from the peers that serve it, a range at a time
        self.joining = (ModelJoin(config.model_id, self.control.view, self.files, self.transport,
                                  resolve_device(config.device))
                        if config.model is None and config.model_id else None)
        self.rpc = RpcRouter(admit=self._admit_request, on_refused=self._count_refusal)
        self.rpc.register("join", self._on_join)
        self.rpc.register("gossip", self.control.on_gossip)
        self.rpc.register("route", self.control.on_route)
        self.rpc.register("placement", self._on_placement)
        self.rpc.register("model_files", self.files.serve)
        self.rpc.register("dialback", self.reachability.serve_dialback)
        self.rpc.register("manifest", self.weights.serve_manifest)
        self.rpc.register("chunk", self.weights.serve_chunk)
        self.rpc.register("speed_check", self._on_speed_check)
        self.trace = TraceService(lambda: self.served)  # trace parity: this peer's hidden states, asked for
        self.rpc.register("trace", self.trace.serve)
        self.rpc.register("prefix_probe", self._on_prefix_probe)
        self.rpc.register("kv_put", self._on_kv_put)
        self.rpc.register("kv_get", self._on_kv_get)
        self._streams: dict[str, StreamHandler] = {
            seam.SEAM_PATH: self.hops.handle_seam,
            seam.RESULTS_PATH: self.hops.handle_results,
            RPC_PATH: self.rpc.serve,
        }
        self.entry: EntrySessions | None = None  # once running: it needs the sessions nursery
        self.leaving = False
        self.ready = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._card_checked = 0.0

    def _served_model(self, config: PeerConfig) -> ServedModel:
        assert config.model is not None
        model_dir, model_id = model_directory(config.model, config.data_dir / "cache")
        compute = ComputeThread()  # every torch op of the peer runs on it, measuring the numerics too
        turn = CpuTurn() if config.cpu_turn else None
        try:
            choice = compute.call(choose_numerics, model_dir, config.dtype, config.device,
                                  min(128, config.chunk_tokens), config.backend, config.numerics, turn)
        finally:
            if turn is not None:
                turn.close()
        log.info("numerics: %s (measured ms: %s)", choice.numerics.name, choice.measured_ms or "none")
        info = describe_model(model_dir, config.model_id or model_id, numerics=choice.numerics,
                              cache_dir=config.data_dir / "cache" / "manifests", say=log.info)
        host = self._shard_host(info, compute)
        return ServedModel(info, host, pinned=config.layers, on_change=self._republish,
                           measured_ms=choice.measured_ms, prefill_only=config.prefill_only)

    def _shard_host(self, info: ModelInfo, compute: ComputeThread) -> ShardHost:
        cfg = self.config
        return ShardHost(info.model_dir, numerics=info.numerics, manifest=info.manifest,
                         max_chunk_tokens=max(512, cfg.chunk_tokens), kv_budget_bytes=cfg.kv_budget,
                         prefix_kv_bytes=cfg.prefix_kv,
                         batch_hold=cfg.batch_hold, batch_latency_ms=cfg.batch_latency_ms, compute=compute,
                         cpu_turn=CpuTurn() if cfg.cpu_turn and info.numerics.device_kind == "cpu" else None)

    async def _join_model(self, joining: ModelJoin) -> None:
        """Serve the model named by ``--model-id`` from fetched files; a failure is said by the status."""
        cfg = self.config
        try:
            info = await joining.describe()
        except (MeshError, OSError) as exc:
            self.model_error = str(exc)
            joining.state = "failed"
            log.error("%s is not offered: %s", joining.model_id, exc)
            return
        host = self._shard_host(info, ComputeThread())

        async def fetch(start: int, end: int) -> None:
            await joining.fetch_range(start, end)
            self.weights.offer(info)  # hand out the tensors just fetched too

        served = ServedModel(info, host, pinned=cfg.layers, on_change=self._republish, prepare=fetch,
                             prefill_only=cfg.prefill_only)
        self._serve(served)
        while cfg.layers is not None and served.range is None and not served.error:
            await served.load(*cfg.layers)  # pinned: nobody orders it again, so retry here
            if served.range is None and not served.error:
                await trio.sleep(PINNED_RETRY_S)

    def _serve(self, served: ServedModel) -> None:
        """Make ``served`` the model every plane of this peer serves, and say so in the card."""
        self.served = served
        self.hops.host, self.hops.model = served.host, served.info
        self.files.local = served.info
        self.weights.offer(served.info)
        self._republish()

    # -- one numerics class with the peers serving the same model (meshd.daemon.numerics_adoption) ---

    def _class_held(self) -> ClassHolder | None:
        served = self.served
        if served is None:
            return None
        info = served.info
        return ClassHolder(self.peer_id, info.model_id, info.numerics.name, info.compat_key, served.class_since_ms)

    def _may_change_class(self) -> bool:
        """Neither loading a range nor holding sessions: nothing is lost when the shard is rebuilt."""
        loading = self.served is not None and self.served.loading
        return not loading and self.hops.active_sessions == 0 and self.hops.queued == 0

    async def _class_info(self, holder: ClassHolder) -> ModelInfo:
        """This peer's model described in ``holder``'s class, once checked to compute here as it does there."""
        assert self.served is not None
        info = self.served.info
        numerics = await self.served.host.run_sync(class_here, info.model_dir, holder.numerics, info.numerics)
        adopted = await trio.to_thread.run_sync(functools.partial(
            describe_model, info.model_dir, info.model_id, numerics=numerics,
            cache_dir=self.config.data_dir / "cache" / "manifests"))
        if adopted.compat_key != holder.compat_key:
            raise ModelFormatError(f"its compat key differs from this peer's in that class ({holder.compat_key[:12]} "
                                   f"against {adopted.compat_key[:12]}): other files under the name {info.model_id}")
        return adopted

    async def _adopt_class(self, info: ModelInfo, holder: ClassHolder) -> None:
        """Serve the model in ``info``'s class from now on: a new shard host, its range loaded again."""
        old, cfg = self.served, self.config
        assert old is not None
        served = ServedModel(info, self._shard_host(info, ComputeThread()), pinned=cfg.layers,
                             on_change=self._republish, measured_ms=old.measured_ms, prefill_only=cfg.prefill_only)
        served.class_from = holder.peer_id
        self._serve(served)
        old.host.close()
        if cfg.layers is not None and self._nursery is not None:
            served.load_started = True  # to load, as a pinned range is: nothing else starts it meanwhile
            self._nursery.start_soon(served.load, *cfg.layers)

    async def _load(self, served: ServedModel, layers: tuple[int, int]) -> None:
        """Load ``layers`` of ``served``, pinned or placed; a peer whose class was measured and that joins a
        mesh first looks at the classes the peers serving the model compute in, so that its range loads
        once: in the class it takes, if it takes one (a pinned range then loads as that class is taken, and
        the tracker places the peer anew in its new compat key)."""
        if self.adoption is not None and self.config.bootstrap:
            await self.adoption.first_look(lambda: len(self.control.view.cards()) > 1)
        if self.served is served and not served.loading and served.range is None:
            await served.load(*layers)

    # -- the card ----------------------------------------------------------------------------------

    @functools.cached_property
    def _hardware(self) -> cpb.Hardware:
        """What the card says of the machine; read once, as it does not change while we run."""
        device = self.served.info.numerics.device if self.served is not None else resolve_device(self.config.device)
        return cpb.Hardware(ram_bytes=psutil.virtual_memory().total, device=device, cpu_count=os.cpu_count() or 1,
                            device_memory_bytes=device_memory_bytes(device))

    def _card(self) -> cpb.CapabilityCard:
        cfg = self.config
        direct = self.reachability.direct_addresses()
        card = cpb.CapabilityCard(
            name=cfg.name or self.peer_id[:8], addresses=direct, relay_addresses=self.reachability.relay_addresses(),
            api_address=self.bound.api, hardware=self._hardware, tracker_eligible=cfg.tracker_eligible and bool(direct),
            software_version=__version__,
            membership=self.membership.gate.own if self.membership.gate is not None else None,
            # placement sizes ranges by what the device can hold, within what the operator allows
            memory_budget_bytes=min(cfg.memory_budget, self._hardware.device_memory_bytes),
        )
        if self.served is not None:
            card.models.append(self.served.card_entry())
            card.load.CopyFrom(cpb.Load(active_sessions=self.hops.active_sessions, queued=self.hops.queued))
            card.kv_free_bytes = self.served.host.kv_free_bytes
        card.kv_tier_bytes = self.config.kv_tier
        return card

    def _republish(self) -> None:
        self.control.republish_card()

    def _on_tick(self) -> None:
        now = time.monotonic()
        if self.served is not None and now - self._card_checked > CARD_REFRESH_S:
            self._card_checked = now
            own = self.control.gossip.store.get(self.peer_id)
            fresh = self._card()
            if own is None or (own.card.load, list(own.card.models)) != (fresh.load, list(fresh.models)):
                self._republish()

    # -- incoming ----------------------------------------------------------------------------------

    async def handle_stream(self, stream: MessageStream) -> None:
        handler = self._streams.get(stream.path)
        if handler is None:
            await stream.reset()
            return
        gate = self.membership.gate
        # a member already, or a stream showing a valid credential (which makes it one)
        member = gate is None or gate.admit_stream(stream.peer_id,
                                                   (getattr(stream, "headers", None) or {}).get(MEMBERSHIP_HEADER))
        if stream.path == RPC_PATH:  # the router asks per kind (joining is for anyone); outsiders send little
            stream.limit_messages(MAX_REQUEST_BYTES if member else MAX_OUTSIDER_REQUEST_BYTES)
        elif not member and gate is not None:  # a session stream: members only
            try:
                gate.require(stream.peer_id, stream.path)
            except NotMember as exc:
                log.warning("%s stream refused: %s", stream.path, exc)
            self._count_refusal(stream.path, "not_member")
            await stream.reset()
            return
        await handler(stream)

    def _admit_request(self, sender: str, kind: str) -> None:
        """Raise unless ``sender`` may make this request: in a private mesh only members may (the
        stream's credential was checked when it opened), except to join it with an invite."""
        gate = self.membership.gate
        if gate is not None and kind != "join":
            gate.require(sender, kind)

    def _count_refusal(self, kind: str, code: str) -> None:
        self.metrics.peer_refusals.labels(kind, code).inc()

    async def _on_join(self, sender: str, request: apb.JoinRequest) -> apb.JoinReply:
        return self.membership.redeem(sender, request)

    async def _on_placement(self, sender: str, order: rpb.PlacementOrder) -> rpb.Accepted:
        self.control.check_tracker(sender)
        if self.served is None:
            raise PlacementRefused("this peer offers no model")
        layers = self.served.accept(order)
        if layers is not None and self._nursery is not None:
            log.info("tracker %s placed layers [%d, %d) here", sender[:12], *layers)
            self._nursery.start_soon(self._load, self.served, layers)
        return rpb.Accepted()

    async def _on_speed_check(self, sender: str, check: rpb.SpeedCheck) -> rpb.SpeedChecked:
        if self.served is None:
            raise CheckRefused("this peer offers no model")
        return await self.served.serve_speed_check(sender, check)

    async def _on_prefix_probe(self, sender: str, probe: rpb.PrefixProbe) -> rpb.PrefixHeld:
        if self.served is None:
            raise CheckRefused("this peer offers no model")
        return await self.served.serve_prefix_probe(sender, probe, self._import_prefix, own_id=self.peer_id)

    def _prefill_worker_view(self) -> tuple[list[ShardOffer], LinkTable, dict[str, str]]:
        """What the entry chooses prefill workers from: offers, links, and the addresses of live peers."""
        view = self.control.view
        addresses = {peer: address for peer in view.cards() if (address := view.address_of(peer)) is not None}
        return view.offers(), view.links(), addresses

    def _serving_alike(self, compat_key: str, start: int, end: int) -> frozenset[str]:
        """This peer and every peer whose card serves exactly layers ``[start, end)`` in ``compat_key``."""
        return frozenset({self.peer_id} | {
            peer for peer, card in self.control.view.cards().items()
            if any(m.compat_key == compat_key and (m.range_start, m.range_end) == (start, end) for m in card.models)})

    async def _import_prefix(self, expected: Expected, source: str) -> PrefixSnapshot | None:
        """A prefix snapshot of this peer's range computed by a peer serving exactly these layers in this
        numerics class (this one included): from ``source``, the prefill worker that keeps it, or with
        ``source`` empty from the KV tier."""
        trusted = self._serving_alike(expected.compat_key, expected.range_start, expected.range_end)
        if source:
            if source not in trusted:
                log.warning("prefix probe names %s as a prefill worker, which does not serve these layers", source[:12])
                return None
            return await self.tier.fetch_from_worker(source, expected, trusted)
        if not self.tier.tier_peers():
            return None
        return await self.tier.fetch(expected, trusted)

    def _publish_prefix(self, key: bytes) -> None:
        """A prefix this hop just kept goes to the KV tier too (in the background)."""
        if self.served is not None:
            self.tier.publish_soon(functools.partial(self.served.encoded_for_tier, key, self.identity))

    async def _on_kv_put(self, sender: str, put: kvpb.KVPut) -> rpb.Accepted:
        if self.tier_store is None:
            raise TierRefused("this peer lends no memory to the KV tier")
        self.tier_store.put(sender, put)
        return rpb.Accepted()

    async def _on_kv_get(self, sender: str, get: kvpb.KVGet) -> kvpb.KVChunk | kvpb.KVMissing:
        """A chunk of a snapshot this peer holds for the tier, or of a prefix it keeps as a prefill worker
        (only for a peer serving the same layers in the same compat key, which is who can use it)."""
        found = self.tier_store.get(get) if self.tier_store is not None else None
        if found is not None:
            return found
        if self.served is not None and sender in self._serving_alike(get.compat_key, get.range_start, get.range_end):
            kept = await trio.to_thread.run_sync(self.served.kept_chunk, get, self.identity)
            if kept is not None:
                return kept
        if self.tier_store is None and self.served is None:
            raise TierRefused("this peer lends no memory to the KV tier")
        return kvpb.KVMissing()

    async def _draft_model(self) -> DraftModel | None:
        """The draft model speculative decoding guesses with, loaded off the event loop; None when not
        configured (or when speculation is off)."""
        cfg = self.config
        if cfg.draft_model is None or cfg.speculative == "off":
            return None
        try:
            model = await trio.to_thread.run_sync(DraftModel, cfg.draft_model)
        except Exception as exc:  # whatever transformers raises for a directory that is not a model
            raise ModelFormatError(f"the draft model {cfg.draft_model} cannot be loaded: {exc}") from None
        log.info("draft model %s loaded for speculative decoding", cfg.draft_model)
        return model

    async def _codec_for(self, model_id: str, compat_key: str) -> TextCodec:
        return await self.files.codec_for(model_id, compat_key, self.control.view.sources_of)

    def _membership_bytes(self) -> bytes:
        gate = self.membership.gate
        return gate.own.SerializeToString() if gate is not None and gate.own is not None else b""

    def invite_addresses(self) -> list[str]:
        """Where a joiner redeems an invite made here: this peer's direct addresses."""
        return self.reachability.direct_addresses() or [self.bound.advertise]

    def known_peer(self, prefix: str) -> str:
        """The one peer id known here that starts with ``prefix`` (a full id need not be known, but must
        be one: a typo must not sign a lasting revocation of nobody)."""
        if len(prefix) == 32:
            if not is_peer_id(prefix):
                raise ValueError(f"{prefix!r} is not a peer id (32 characters of a-z and 2-7)")
            return prefix
        known = set(self.control.gossip.members()) | set(self.control.gossip.store.cards())
        matches = sorted(p for p in known if prefix and p.startswith(prefix))
        if len(matches) != 1:
            raise ValueError(f"{prefix!r} names {len(matches)} known peers; give more of the peer id")
        return matches[0]

    def _dialback_helpers(self) -> list[tuple[str, str]]:
        view = self.control.view
        return [(p, a) for p in view.alive_members() if (a := view.address_of(p)) is not None]

    # -- leaving -----------------------------------------------------------------------------------

    async def leave(self) -> None:
        """Graceful leave: announce it, refuse new sessions, let running ones finish (bounded)."""
        if self.leaving:
            return
        self.leaving = True
        self.hops.leaving = True
        entry_sessions = self.entry.running if self.entry else 0
        log.info("leaving the mesh: draining %d hop and %d entry sessions (at most %.0fs)",
                 self.hops.active_sessions, entry_sessions, self.config.drain_timeout_s)
        await self.control.leave()
        with trio.move_on_after(self.config.drain_timeout_s) as scope:
            while self.hops.active_sessions or (self.entry is not None and self.entry.running):
                await trio.sleep(0.05)
        if scope.cancelled_caught:
            log.warning("drain timeout: %d hop and %d entry sessions still running; their entries will repair",
                        self.hops.active_sessions, self.entry.running if self.entry else 0)
        else:
            log.info("drained")

    def _levels(self) -> Levels:
        """What the metrics endpoint reports as levels, read when it is scraped."""
        now = time.time()
        host = self.served.host if self.served is not None else None
        shard = host.shard if host is not None else None
        members = Counter(s.name.lower() for s in self.control.gossip.members().values())
        cards = self.control.view.cards()
        links = Counter(self.transport.connection_route(p) for p in cards if p != self.peer_id)
        return Levels(
            hop_sessions=self.hops.active_sessions, entry_sessions=self.entry.running if self.entry else 0,
            queued_steps=self.hops.queued, kv_bytes=shard.kv.used_bytes if shard is not None else 0,
            kv_budget_bytes=self.config.kv_budget,
            decode_tok_s=self.served.decode_tok_s if self.served is not None else 0.0,
            cards=len(cards), members=dict(members),
            election_term=self.control.election.term(now) or 0,
            is_tracker=self.control.election.tracker(now) == self.peer_id,
            links={route: links[route] for route in ("direct", "relay")},
            relays_registered=sum(1 for r in self.reachability.registrations if r.registered),
            decode_batches=dict(host.batcher.stats.batch_sizes) if host is not None else {},
            rejected_cards={str(k): v for k, v in self.control.gossip.rejected_cards.items()},
            transport_refusals=dict(self.transport.refusals))

    # -- run ---------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Peer] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        try:
            async with self.transport, trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.membership.pending is not None:
                    await self.membership.join(self.transport)
                    self._republish()  # the card shows the membership from now on
                if self.membership.gate is not None:
                    self.transport.stream_headers.update(self.membership.gate.header())
                listen = Address.parse(cfg.listen)
                port = await start_listener(nursery, "the peer transport", listen, self.transport.serve, listen,
                                             self.handle_stream)
                self.bound.listen = str(listen.with_port(port))
                if not cfg.advertise:
                    self.bound.advertise = self.bound.listen
                async with trio.open_nursery() as sessions:
                    entry = EntryConfig(chunk_tokens=cfg.chunk_tokens, step_timeout_s=cfg.step_timeout_s,
                                        request_timeout_s=cfg.request_timeout_s,
                                        repair=RepairConfig(attempts=cfg.repair_attempts, budget_s=cfg.repair_budget_s),
                                        speculative=cfg.speculative, max_draft_tokens=cfg.max_draft_tokens,
                                        draft_model=await self._draft_model(), prefix_reuse=cfg.prefix_reuse,
                                        prefix_secret=self.prefix_secret, prefill_workers=cfg.prefill_workers)
                    self.entry = EntrySessions(self.peer_id, self.transport, self.routes, entry, sessions,
                                               metrics=self.metrics, workers=self._prefill_worker_view)
                    # audit replays run on exactly the route they are given: no repair
                    replays = EntrySessions(self.peer_id, self.transport, self.routes,
                                            replace(entry, repair=RepairConfig(attempts=0)), sessions)
                    self.auditor = Auditor(self.identity, replays, self.routes, self.audits, self._codec_for, sessions,
                                           rate=cfg.audit_rate, tokens=cfg.audit_tokens)
                    self.control.on_accusation = self.auditor.on_accusation
                    backend = MeshBackend(self.control.view, self.routes, self.entry, self.files,
                                          leaving=lambda: self.leaving, after_request=self.auditor.after_request,
                                          capture=self.capture)
                    # replays, like audits, run on exactly the route they are given
                    self.replayer = Replayer(self.peer_id, backend, replays, self.routes, self._codec_for,
                                             cfg.data_dir)
                    await nursery.start(self.capture.run)
                    api = Address.parse(cfg.api)
                    api_port = await start_listener(nursery, "the OpenAI API", api, serve_asgi, build_app(backend),
                                                     api, "meshd.api.http")
                    self.bound.api = str(api.with_port(api_port))
                    control = Address.parse(cfg.control)
                    control_port = await start_listener(nursery, "the control API", control, serve_asgi,
                                                         build_control_app(self), control, "meshd.control.http")
                    self.bound.control = str(control.with_port(control_port))
                    if cfg.metrics:
                        metrics = Address.parse(cfg.metrics)
                        metrics_port = await start_listener(nursery, "metrics", metrics, serve_asgi,
                                                             metrics_app(self.metrics.registry), metrics,
                                                             "meshd.metrics.http")
                        self.bound.metrics = str(metrics.with_port(metrics_port))
                    self._republish()
                    if self.served is not None and cfg.layers is not None:
                        nursery.start_soon(self._load, self.served, cfg.layers)
                    if self.joining is not None:
                        nursery.start_soon(self._join_model, self.joining)
                    await nursery.start(self.control.run, self._on_tick)
                    if self.adoption is not None:
                        await nursery.start(self.adoption.run)
                    await nursery.start(self.hops.run)
                    await nursery.start(self.speed.run)
                    await nursery.start(self.tier.run)
                    nursery.start_soon(self.reachability.run, self.handle_stream, self._dialback_helpers)
                    log.info("peer %s listening on %s, API on %s, control on %s, metrics on %s", self.peer_id,
                             self.bound.advertise, self.bound.api, self.bound.control, self.bound.metrics or "-")
                    self.ready.set()
                    if cfg.ready_file is not None:
                        write_atomically(cfg.ready_file, json.dumps(peer_status(self)))
                    task_status.started(self)
                    await trio.sleep_forever()
        finally:
            if self.served is not None:
                self.served.host.close()  # its compute thread, with the OpenMP team it holds

