"""One meshd peer: identity, transport, gossip, election, tracker duties, shard, sessions and APIs.

``Peer.run`` is the root of the daemon's nursery tree. The sans-IO state machines (gossip node,
election) are driven here by a clock tick and by messages from the transport; their actions become
transport requests. Everything a peer knows about others comes from verified capability cards.
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
import logging
import os
import random
import tempfile
import time
from collections import deque
from pathlib import Path

import psutil
import trio

from meshd import __version__
from meshd.address import Address
from meshd.api.openai_server import build_app, serve_asgi
from meshd.daemon.backend import MeshBackend
from meshd.daemon.config import PeerConfig
from meshd.daemon.control import build_control_app
from meshd.daemon.reachability import DIALBACK_PATH, Reachability, dial_address, relayed_through
from meshd.election import BroadcastLease, Election, ElectionConfig, TrackerChanged
from meshd.files import write_atomically
from meshd.gossip import GossipConfig, GossipNode, LeaseReceived, MemberChanged, MemberState, Send
from meshd.identity import Identity
from meshd.runtime.host import ShardHost
from meshd.runtime.model_info import ModelInfo, compat_key_of, describe_model, read_small_files, tokenizer_digest_of
from meshd.session import messages as seam
from meshd.session.hop import AdmissionLimits, HopService
from meshd.tracker.placement import place
from meshd.tracker.routing import NoRouteError, plan_route
from meshd.tracker.view import Route, ShardOffer
from meshd.transport import Transport
from meshd.wire import card_pb2 as cpb

log = logging.getLogger("meshd.peer")

TICK_S = 0.25
GOSSIP_PATH = "/meshd/gossip"
ROUTE_PATH = "/meshd/route"
PLACE_PATH = "/meshd/place"
TOKENIZER_PATH = "/meshd/tokenizer"
ROUTE_ASK_TIMEOUT_S = 2.0
PLACEMENT_RETRY_S = 30.0
UNREACHABLE_FOR_S = 10.0


class Peer:
    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.identity = Identity.load_or_create(config.data_dir)
        self.peer_id = self.identity.peer_id
        self.started_at = time.time()
        self.model: ModelInfo | None = None
        self.host: ShardHost | None = None
        if config.model is not None:
            self.model = describe_model(config.model, config.model_id or None)
            self.host = ShardHost(config.model, max_chunk_tokens=max(512, config.chunk_tokens),
                                  kv_budget_bytes=config.kv_budget, batch_hold=config.batch_hold)
        self.decode_tok_s = 0.0
        self.transport = Transport(self.identity)
        self.reachability = Reachability(config, self.transport, self.identity, on_change=lambda: self.republish_card())
        self.hops = HopService(self.peer_id, self.transport, self.host,
                               self.model.model_id if self.model else None,
                               self.model.compat_key if self.model else None,
                               AdmissionLimits(max_sessions=config.max_sessions, max_queue=config.max_queue),
                               compression=config.compression)
        self.gossip = GossipNode.with_identity(
            self.identity, self._card_template(),
            GossipConfig(probe_interval=config.probe_interval_s, probe_timeout=config.probe_timeout_s,
                         suspect_timeout=config.suspect_timeout_s, pushpull_interval=config.pushpull_interval_s),
            rng=random.Random(),
            card_ttl_ms=int(config.card_ttl_s * 1000),
        )
        for address in config.bootstrap:
            self.gossip.add_seed(address)
        lease = config.lease_duration_s
        self.election = Election(
            self.peer_id, config.tracker_eligible,
            ElectionConfig(lease_duration=lease, renew_interval=lease / 3, jitter_step=lease / 6,
                           max_jitter=lease / 2),
            identity=self.identity,
        )
        self.leaving = False
        self.entry_sessions = 0
        self._met_mesh_at: float | None = None
        self.repair_ms: dict[str, deque[float]] = {}  # by the lost hop's position in the route
        self.rtt_ms: dict[str, float] = {}
        self.last_seen: dict[str, float] = {}
        self.api_port: int | None = None
        self.control_port: int | None = None
        self.listen_port: int | None = None
        self._tokenizers: dict[str, object] = {}  # by compat key
        self._placement_orders: dict[str, tuple[tuple[int, int], float]] = {}
        self._unreachable: dict[str, float] = {}
        self._epochs = itertools.count(1)
        self._load_started = False
        self.sessions_nursery: trio.Nursery | None = None
        self.ready = trio.Event()

    # -- card --------------------------------------------------------------------------------------

    @functools.cached_property
    def _hardware(self) -> cpb.Hardware:
        """What the card says of the machine; read once, as it does not change while we run."""
        return cpb.Hardware(ram_bytes=psutil.virtual_memory().total, device="cpu", cpu_count=os.cpu_count() or 1)

    def _card_template(self) -> cpb.CapabilityCard:
        cfg = self.config
        card = cpb.CapabilityCard(
            name=cfg.name or self.peer_id[:8],
            addresses=self.reachability.direct_addresses(),
            relay_addresses=self.reachability.relay_addresses(),
            api_address=cfg.api,
            hardware=self._hardware,
            tracker_eligible=cfg.tracker_eligible and bool(self.reachability.direct_addresses()),
            software_version=__version__,
            memory_budget_bytes=cfg.memory_budget,
        )
        if self.model is not None:
            start, end = (self.host.range if self.host and self.host.range else (cfg.layers or (0, 0)))
            card.models.append(cpb.ModelServed(
                model_id=self.model.model_id, compat_key=self.model.compat_key, n_layers=self.model.n_layers,
                range_start=start, range_end=end if self.host and self.host.range else 0,
                decode_tok_s=self.decode_tok_s, pinned=cfg.layers is not None,
                layer_bytes=self.model.layer_bytes, edge_bytes=self.model.edge_bytes,
                context_length=self.model.context_length,
            ))
        if self.host is not None:
            card.load.CopyFrom(cpb.Load(active_sessions=self.hops.active_sessions, queued=self.hops.queued))
            card.kv_free_bytes = self.host.kv_free_bytes
        return card

    def republish_card(self) -> None:
        self.gossip.issuer.template = self._card_template()
        self.gossip.republish(time.time())

    # -- views -------------------------------------------------------------------------------------

    def offers(self) -> list[ShardOffer]:
        """Every model offer in the live view (including this peer's), for placement and routing."""
        out = []
        for peer_id, card in self.gossip.live_cards().items():
            c = card.card
            relayed = not c.addresses
            for m in c.models:
                placed = m.range_end > m.range_start
                layers = (m.range_end - m.range_start) if placed else m.n_layers
                ms_per_layer = 1000.0 / (m.decode_tok_s * layers) if m.decode_tok_s > 0 and layers else 1.0
                out.append(ShardOffer(
                    peer_id=peer_id, model_id=m.model_id, compat_key=m.compat_key, n_layers=m.n_layers,
                    layer_bytes=m.layer_bytes, edge_bytes=m.edge_bytes,
                    memory_budget_bytes=c.memory_budget_bytes,
                    range=(m.range_start, m.range_end) if placed else None,
                    ms_per_layer=ms_per_layer, active_sessions=c.load.active_sessions, queued=c.load.queued,
                    relayed=relayed, pinned=m.pinned,
                ))
        return out

    def known_models(self) -> set[str]:
        return {o.model_id for o in self.offers()}

    def covered_models(self) -> list[str]:
        covered = []
        for model_id in sorted(self.known_models()):
            try:
                plan_route(model_id, self.offers(), self._rtt_of)
            except NoRouteError:
                continue
            covered.append(model_id)
        return covered

    def context_length(self, model_id: str) -> int:
        for card in self.gossip.live_cards().values():
            for m in card.card.models:
                if m.model_id == model_id and m.context_length:
                    return m.context_length
        return 2048

    def _rtt_of(self, peer_id: str) -> float:
        return 0.0 if peer_id == self.peer_id else self.rtt_ms.get(peer_id)

    def _dialback_helpers(self) -> list[tuple[str, str]]:
        alive = {p for p, state in self.gossip.members().items() if state == MemberState.ALIVE}
        return [(p, a) for p in sorted(alive) if (a := self._address_of(p)) is not None]

    def _address_of(self, peer_id: str) -> str | None:
        card = self.gossip.live_cards().get(peer_id)
        return None if card is None else dial_address(card.card)

    # -- routes ------------------------------------------------------------------------------------

    def is_alive(self, peer_id: str) -> bool:
        """Gossip's verdict, for sessions in flight: only a peer declared dead fails them (a leaving
        peer is still draining its running sessions)."""
        if peer_id == self.peer_id:
            return True
        member = self.gossip.member(peer_id)
        return member is None or member.state != MemberState.DEAD

    async def leave(self) -> None:
        """Graceful leave: announce it, refuse new sessions, let running ones finish (bounded)."""
        if self.leaving:
            return
        self.leaving = True
        self.hops.leaving = True
        log.info("leaving the mesh: draining %d hop and %d entry sessions (at most %.0fs)",
                 self.hops.active_sessions, self.entry_sessions, self.config.drain_timeout_s)
        await self._perform(self.gossip.leave(time.time()))
        with trio.move_on_after(self.config.drain_timeout_s) as scope:
            while self.hops.active_sessions or self.entry_sessions:
                await trio.sleep(0.05)
        if scope.cancelled_caught:
            log.warning("drain timeout: %d hop and %d entry sessions still running; their entries will repair",
                        self.hops.active_sessions, self.entry_sessions)
        else:
            log.info("drained")

    def mark_unreachable(self, peer_id: str) -> None:
        """Keep routes away from a peer that just failed to answer, until gossip decides about it."""
        self._unreachable[peer_id] = time.monotonic() + UNREACHABLE_FOR_S

    def _avoided(self) -> frozenset[str]:
        now = time.monotonic()
        recent = {p for p, until in self._unreachable.items() if until > now}
        suspects = {p for p, state in self.gossip.members().items() if state != MemberState.ALIVE}
        return frozenset(recent | suspects)

    async def route_for(self, model_id: str, exclude: frozenset[str] = frozenset(),
                        keep: frozenset[str] = frozenset()) -> tuple[Route, dict, str]:
        """A route avoiding suspected peers when possible (and favouring ``keep``, the peers that hold
        a session being repaired): from the tracker, or planned locally when no tracker answers in time."""
        avoid = exclude | self._avoided()
        if avoid != exclude:
            try:
                return await self._route_for(model_id, avoid, keep)
            except NoRouteError:
                pass
        return await self._route_for(model_id, exclude, keep)

    async def _route_for(self, model_id: str, exclude: frozenset[str],
                         keep: frozenset[str] = frozenset()) -> tuple[Route, dict, str]:
        now = time.time()
        tracker = self.election.tracker(now)
        route = None
        source = "local"
        if tracker is not None and tracker != self.peer_id and self._address_of(tracker):
            body = json.dumps({"model": model_id, "exclude": sorted(exclude), "keep": sorted(keep)}).encode()
            try:
                with trio.fail_after(ROUTE_ASK_TIMEOUT_S):
                    reply = await self.transport.request(tracker, self._address_of(tracker),
                                                         ROUTE_PATH, body)
                route = _route_from_json(json.loads(reply))
                source = f"tracker {tracker[:12]}"
            except NoRouteError:
                raise
            except Exception as exc:
                log.info("tracker %s gave no route (%s); planning locally", tracker[:12], exc)
        elif tracker == self.peer_id:
            source = "tracker (self)"
        if route is None:
            route = plan_route(model_id, self.offers(), self._rtt_of, epoch=next(self._epochs), exclude=exclude,
                               keep=keep)
        addresses = {}
        for hop in route.hops:
            address = self._address_of(hop.peer_id)
            if address is None:
                raise NoRouteError(model_id, [(hop.start, hop.end)])
            addresses[hop.peer_id] = address
        return route, addresses, source

    # -- tokenizers --------------------------------------------------------------------------------

    async def tokenizer_for(self, model_id: str, compat_key: str):
        tok = self._tokenizers.get(compat_key)
        if tok is not None:
            return tok
        from transformers import AutoTokenizer

        if self.model is not None and self.model.compat_key == compat_key:
            tok = await trio.to_thread.run_sync(lambda: AutoTokenizer.from_pretrained(self.model.model_dir))
        else:
            tok = await self._fetch_tokenizer(model_id, compat_key)
        self._tokenizers[compat_key] = tok
        return tok

    async def _fetch_tokenizer(self, model_id: str, compat_key: str):
        from transformers import AutoTokenizer

        servers = [o.peer_id for o in self.offers() if o.compat_key == compat_key and o.peer_id != self.peer_id]
        last_error: Exception | None = None
        for peer_id in servers:
            address = self._address_of(peer_id)
            if address is None:
                continue
            try:
                with trio.fail_after(10):
                    reply = json.loads(await self.transport.request(
                        peer_id, address, TOKENIZER_PATH,
                        json.dumps({"model": model_id}).encode()))
                files = {name: base64.b64decode(data) for name, data in reply["files"].items()}
                got = compat_key_of(reply["architecture"], tokenizer_digest_of(files), reply["weights_digest"])
                if got != compat_key:
                    raise ValueError(f"files from {peer_id[:12]} hash to compat key {got}, expected {compat_key}")
                target = Path(tempfile.mkdtemp(prefix=f"tokenizer-{compat_key[:8]}-", dir=self.config.data_dir))
                for name, data in files.items():
                    (target / name).write_bytes(data)
                log.info("fetched tokenizer of %s from %s (compat key verified)", model_id, peer_id[:12])
                return await trio.to_thread.run_sync(lambda t=target: AutoTokenizer.from_pretrained(t))
            except Exception as exc:
                last_error = exc
                log.warning("tokenizer fetch from %s failed: %s", peer_id[:12], exc)
        raise NoRouteError(model_id, []) from last_error

    # -- incoming streams --------------------------------------------------------------------------

    async def handle_stream(self, stream) -> None:
        path = stream.path
        if path == seam.SEAM_PATH:
            await self.hops.handle_seam(stream)
        elif path == seam.RESULTS_PATH:
            await self.hops.handle_results(stream)
        elif path in (GOSSIP_PATH, ROUTE_PATH, PLACE_PATH, TOKENIZER_PATH, DIALBACK_PATH):
            await self._handle_unary(stream)
        else:
            await stream.reset()

    async def _handle_unary(self, stream) -> None:
        with trio.move_on_after(10):
            body = await stream.receive_message()
            # The requester ends its side right after its one message; wait for that before replying,
            # so that finishing this handler never has to reset a stream the peer is still closing.
            extra = await stream.receive_message() if body is not None else None
        if body is None or extra is not None:
            await stream.reset()
            return
        path, sender = stream.path, stream.peer_id
        self.last_seen[sender] = time.time()
        reply = b""
        try:
            if path == GOSSIP_PATH:
                msg = cpb.GossipMessage()
                msg.ParseFromString(body)
                await self._perform(self.gossip.on_message(sender, msg, time.time()))
            elif path == ROUTE_PATH:
                reply = self._serve_route(json.loads(body))
            elif path == PLACE_PATH:
                reply = await self._accept_placement(sender, json.loads(body))
            elif path == TOKENIZER_PATH:
                reply = self._serve_tokenizer(json.loads(body))
            elif path == DIALBACK_PATH:
                reply = await self.reachability.serve_dialback(sender, json.loads(body))
        except Exception as exc:
            log.warning("%s from %s rejected: %s", path, sender[:12], exc)
            reply = json.dumps({"error": str(exc)}).encode()
        await stream.send_message(reply)
        await stream.end()

    def _serve_route(self, req: dict) -> bytes:
        model_id = str(req["model"])
        try:
            route = plan_route(model_id, self.offers(), self._rtt_of, epoch=next(self._epochs),
                               exclude=frozenset(req.get("exclude", [])), keep=frozenset(req.get("keep", [])))
        except NoRouteError as exc:
            return json.dumps({"error": str(exc), "missing": exc.missing}).encode()
        return json.dumps(_route_to_json(route)).encode()

    def _serve_tokenizer(self, req: dict) -> bytes:
        if self.model is None or req.get("model") != self.model.model_id:
            raise ValueError(f"this peer does not serve {req.get('model')!r}")
        files = read_small_files(self.model.model_dir)
        return json.dumps({
            "files": {n: base64.b64encode(d).decode() for n, d in files.items()},
            "architecture": self.model.architecture, "weights_digest": self.model.weights_digest,
        }).encode()

    async def _accept_placement(self, sender: str, order: dict) -> bytes:
        tracker = self.election.tracker(time.time())
        if sender != tracker:
            raise PermissionError(f"placement from {sender[:12]}, but the tracker is {str(tracker)[:12]}")
        if self.model is None or order.get("model") != self.model.model_id:
            raise ValueError("placement for a model this peer does not offer")
        if order.get("compat_key") != self.model.compat_key:
            raise ValueError("placement for another compat key")
        start, end = int(order["start"]), int(order["end"])
        if not 0 <= start < end <= self.model.n_layers:
            raise ValueError(f"placement range [{start}, {end}) is outside the model")
        if not self._load_started:
            self._load_started = True
            log.info("tracker %s placed layers [%d, %d) here", sender[:12], start, end)
            self._nursery.start_soon(self._load, start, end)
        return json.dumps({"ok": True}).encode()

    async def _load(self, start: int, end: int) -> None:
        await self.host.load(start, end)
        self.decode_tok_s = await self.host.run_sync(_measure_decode, self.host)
        self.republish_card()

    # -- gossip I/O --------------------------------------------------------------------------------

    async def _perform(self, actions) -> None:
        now = time.time()
        for action in actions:
            if isinstance(action, Send):
                self._nursery.start_soon(self._deliver, action)
            elif isinstance(action, LeaseReceived):
                await self._perform(self.election.on_lease(action.signed, now))
            elif isinstance(action, BroadcastLease):
                self.gossip.publish_lease(action.signed, now)
            elif isinstance(action, TrackerChanged):
                log.info("tracker is now %s (term %d)", str(action.new)[:12], action.term)
            elif isinstance(action, MemberChanged):
                log.info("peer %s: %s -> %s", action.peer_id[:12], action.old and action.old.name, action.new.name)

    async def _deliver(self, send: Send) -> None:
        if isinstance(send.to, Address):
            peer_id, address = None, str(send.to)
        else:
            peer_id, address = send.to, self._address_of(send.to)
        if address is None:
            return
        started = time.monotonic()
        try:
            with trio.fail_after(max(1.0, self.config.probe_timeout_s * 2)):
                await self.transport.request(peer_id, address, GOSSIP_PATH,
                                             send.message.SerializeToString())
        except Exception as exc:
            log.debug("gossip to %s failed: %s", address, exc)
            return
        if peer_id is not None:
            elapsed = (time.monotonic() - started) * 1000
            prev = self.rtt_ms.get(peer_id)
            self.rtt_ms[peer_id] = elapsed if prev is None else 0.8 * prev + 0.2 * elapsed
            self.last_seen[peer_id] = time.time()

    async def _tick_loop(self) -> None:
        last_card = 0.0
        while True:
            now = time.time()
            await self._perform(self.gossip.tick(now))
            self.hops.purge_retained()
            alive_eligible = [p for p, c in self.gossip.live_cards().items() if c.card.tracker_eligible]
            # the tracker must be directly reachable: every peer asks it for routes
            self.election.eligible = (self.config.tracker_eligible and not self.leaving and self._joined(now)
                                      and bool(self.reachability.direct_addresses()))
            await self._perform(self.election.tick(now, alive_eligible))
            if self.election.tracker(now) == self.peer_id:
                self._tracker_duties(now)
            if self.host is not None and now - last_card > 2.0:
                last_card = now
                if self._card_changed():
                    self.republish_card()
            await trio.sleep(TICK_S)

    def _joined(self, now: float) -> bool:
        """A peer started with bootstrap addresses claims nothing until it has met the mesh (or given up
        waiting), so that it does not elect itself and place its own layers in isolation."""
        if not self.config.bootstrap:
            return True
        if self._met_mesh_at is None and any(s == MemberState.ALIVE for s in self.gossip.members().values()):
            self._met_mesh_at = now
        if self._met_mesh_at is not None:
            # give the current tracker's lease one gossip round to arrive before competing with it
            return now - self._met_mesh_at > 2 * self.config.pushpull_interval_s
        return now - self.started_at > 2 * self.config.lease_duration_s

    def _card_changed(self) -> bool:
        own = self.gossip.store.get(self.peer_id)
        if own is None:
            return True
        fresh = self._card_template()
        return (own.card.load.active_sessions != fresh.load.active_sessions
                or own.card.load.queued != fresh.load.queued
                or list(own.card.models) != list(fresh.models))

    def _tracker_duties(self, now: float) -> None:
        by_model: dict[tuple[str, str], list[ShardOffer]] = {}
        for offer in self.offers():
            by_model.setdefault((offer.model_id, offer.compat_key), []).append(offer)
        for (model_id, compat_key), offers in by_model.items():
            waiting = [o for o in offers if o.range is None and not self._recently_ordered(o.peer_id, now)]
            if not waiting:
                continue
            pending = {p: r for p, (r, _t) in self._placement_orders.items()}
            view = [o if o.range is not None or o.peer_id not in pending else
                    ShardOffer(**{**o.__dict__, "range": pending[o.peer_id]}) for o in offers]
            for peer_id, (start, end) in place(view).items():
                self._placement_orders[peer_id] = ((start, end), now)
                self._nursery.start_soon(self._send_placement, peer_id, model_id, compat_key, start, end)

    def _recently_ordered(self, peer_id: str, now: float) -> bool:
        order = self._placement_orders.get(peer_id)
        return order is not None and now - order[1] < PLACEMENT_RETRY_S

    async def _send_placement(self, peer_id: str, model_id: str, compat_key: str, start: int, end: int) -> None:
        address = self._address_of(peer_id)
        if address is None:
            return
        body = json.dumps({"model": model_id, "compat_key": compat_key, "start": start, "end": end}).encode()
        try:
            with trio.fail_after(5):
                reply = json.loads(await self.transport.request(peer_id, address, PLACE_PATH,
                                                                body))
            if "error" in reply:
                raise RuntimeError(reply["error"])
            log.info("placed layers [%d, %d) of %s on %s", start, end, model_id, peer_id[:12])
        except Exception as exc:
            log.warning("placement on %s failed: %s", peer_id[:12], exc)

    # -- status for meshctl ------------------------------------------------------------------------

    def status(self) -> dict:
        now = time.time()
        tracker = self.election.tracker(now)
        return {
            "peer_id": self.peer_id, "name": self.config.name or self.peer_id[:8], "version": __version__,
            "listen": self.config.advertised, "api": f"{_host(self.config.api)}:{self.api_port}",
            "control": f"{_host(self.config.control)}:{self.control_port}",
            "tracker": tracker, "tracker_term": self.election.term(now), "is_tracker": tracker == self.peer_id,
            "lease_duration_s": self.config.lease_duration_s, "takeover_bound_s": self.takeover_bound_s(),
            "model": self.model.model_id if self.model else None,
            "compat_key": self.model.compat_key if self.model else None,
            "range": list(self.host.range) if self.host and self.host.range else None,
            "active_sessions": self.host.active_sessions if self.host else 0,
            "decode_tok_s": round(self.decode_tok_s, 2),
            "members": {p: s.name for p, s in self.gossip.members().items()},
            "models_covered": self.covered_models(),
            "rejected_cards": {str(k): v for k, v in self.gossip.rejected_cards.items()},
            "uptime_s": round(now - self.started_at, 1),
            "reachability": self.reachability.status(),
        }

    def takeover_bound_s(self) -> float:
        """Longest a mesh goes without a tracker after the tracker dies (see meshd.election)."""
        delivery = 2 * max(self.config.probe_interval_s, self.config.pushpull_interval_s)
        return round(self.election.config.takeover_bound(TICK_S, delivery), 3)

    def peers_table(self) -> list[dict]:
        now = time.time()
        tracker = self.election.tracker(now)
        members = self.gossip.members()
        rows = []
        for peer_id, card in sorted(self.gossip.live_cards().items()):
            c = card.card
            rows.append({
                "peer_id": peer_id, "self": peer_id == self.peer_id, "name": c.name,
                "addresses": list(c.addresses), "relays": list(c.relay_addresses), "api": c.api_address,
                "relayed_via": relayed_through(c), "link": self.transport.connection_route(peer_id),
                "tracker": peer_id == tracker,
                "state": "self" if peer_id == self.peer_id else members.get(peer_id, MemberState.ALIVE).name,
                "models": [{"model_id": m.model_id, "start": m.range_start, "end": m.range_end,
                            "n_layers": m.n_layers, "compat_key": m.compat_key,
                            "decode_tok_s": round(m.decode_tok_s, 2)} for m in c.models],
                "active_sessions": c.load.active_sessions, "queued": c.load.queued,
                "rtt_ms": None if peer_id == self.peer_id else self.rtt_ms.get(peer_id),
                "last_seen_s": None if peer_id not in self.last_seen else round(now - self.last_seen[peer_id], 2),
                "card_age_s": round(now - c.issued_at_ms / 1000, 2), "sequence": c.sequence,
            })
        return rows

    # -- run ---------------------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            cfg = self.config
            async with self.transport, trio.open_nursery() as nursery:
                self._nursery = nursery
                self.listen_port = await nursery.start(self.transport.serve, cfg.listen, self.handle_stream)
                if Address.parse(cfg.listen).port == 0:
                    cfg.advertise = f"{_host(cfg.advertised)}:{self.listen_port}"
                async with trio.open_nursery() as sessions:
                    self.sessions_nursery = sessions
                    self.api_port = await nursery.start(serve_asgi, build_app(MeshBackend(self)), cfg.api,
                                                        "meshd.api.http")
                    cfg.api = str(Address.parse(cfg.api).with_port(self.api_port))
                    self.control_port = await nursery.start(serve_asgi, build_control_app(self), cfg.control,
                                                            "meshd.control.http")
                    self.republish_card()
                    if self.host is not None and cfg.layers is not None:
                        self._load_started = True
                        nursery.start_soon(self._load, *cfg.layers)
                    nursery.start_soon(self._tick_loop)
                    nursery.start_soon(self.reachability.run, self.handle_stream, self._dialback_helpers)
                    log.info("peer %s listening on %s, API on %s, control on %s", self.peer_id, cfg.advertised,
                             cfg.api, Address.parse(cfg.control).with_port(self.control_port))
                    self.ready.set()
                    if cfg.ready_file is not None:
                        write_atomically(cfg.ready_file, json.dumps(self.status()))
                    task_status.started(self)
                    await trio.sleep_forever()
        finally:
            if self.host is not None:
                self.host.close()  # its compute thread, with the OpenMP team it holds


def _write_atomically(path: Path, text: str) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _host(address: str) -> str:
    return Address.parse(address).host_text


def _route_to_json(route: Route) -> dict:
    return {"model": route.model_id, "compat_key": route.compat_key, "epoch": route.epoch,
            "cost_ms": route.cost_ms, "hops": [[h.peer_id, h.start, h.end] for h in route.hops],
            "terms": list(route.terms)}


def _route_from_json(doc: dict) -> Route:
    from meshd.tracker.view import Hop

    if "error" in doc:
        raise NoRouteError(doc.get("model", ""), [tuple(r) for r in doc.get("missing", [])])
    return Route(model_id=doc["model"], compat_key=doc["compat_key"], epoch=int(doc["epoch"]),
                 cost_ms=float(doc["cost_ms"]), hops=tuple(Hop(p, int(s), int(e)) for p, s, e in doc["hops"]),
                 terms=tuple(doc.get("terms", [])))


def _measure_decode(host: ShardHost) -> float:
    """Decode tokens/s of this shard alone, from a few steps of a throw-away session."""
    import torch

    from meshd.runtime.shard import HIDDEN_STATES, INPUT_IDS
    from meshd.wire.bundle import HiddenStateBundle, Phase

    shard = host.shard
    spec = shard.spec
    session = f"speed-probe-{os.getpid()}"
    steps = 8

    def bundle(pos: int, n: int) -> HiddenStateBundle:
        tensors = ({INPUT_IDS: torch.zeros(n, dtype=torch.long)} if spec.is_head
                   else {HIDDEN_STATES: torch.zeros(n, spec.hidden_size)})
        return HiddenStateBundle(session_id=session, epoch=0, phase=Phase.PREFILL if pos == 0 else Phase.DECODE,
                                 start_position=pos, token_count=n, tensors=tensors, range_start=spec.start,
                                 range_end=spec.end, sample=True)

    try:
        shard.forward(bundle(0, 8))
        for i in range(2):
            shard.forward(bundle(8 + i, 1))
        timings = []
        for i in range(steps):
            started = time.perf_counter()
            shard.forward(bundle(10 + i, 1))
            timings.append(time.perf_counter() - started)
        elapsed = sorted(timings)[len(timings) // 2] * steps
    finally:
        shard.release(session, 0)
    return steps / elapsed if elapsed > 0 else 0.0
