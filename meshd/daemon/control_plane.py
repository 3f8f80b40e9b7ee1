"""The control plane on Trio: gossip, the tracker election and the tracker's duties, on a clock tick.

The state machines (:class:`~meshd.gossip.node.GossipNode`, :class:`~meshd.election.election.Election`,
:class:`~meshd.tracker.duties.TrackerDuties`) decide everything; this adapter feeds them the time
and the gossip that arrives over peer RPC, and performs what they return: gossip messages to send,
leases to spread, placement orders to deliver.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import trio

from meshd.address import Address
from meshd.daemon.config import PeerConfig
from meshd.election import BroadcastLease, Election, ElectionConfig, TrackerChanged
from meshd.election.election import Action as ElectionAction
from meshd.errors import ErrorCode, MeshError
from meshd.gossip import AccusationHeard, GossipConfig, GossipNode, LeaseReceived, MemberChanged, MemberState, Send
from meshd.gossip.events import Action as GossipAction
from meshd.identity import Identity
from meshd.metrics import PeerMetrics
from meshd.rpc import RpcFailed, call
from meshd.tracker.duties import Order, TrackerDuties
from meshd.tracker.links import drifted
from meshd.tracker.view import MeshView
from meshd.transport.streams import StreamOpener
from meshd.wire import admission_pb2 as apb
from meshd.wire import audit_pb2 as aupb
from meshd.wire import card_pb2 as cpb
from meshd.wire import rpc_pb2 as pb

log = logging.getLogger("meshd.peer")

TICK_S = 0.25
LINKS_REFRESH_S = 2.0  # how often the card's link measures are brought up to date
PLACEMENT_SEND_TIMEOUT_S = 5.0


class NotTracker(MeshError):
    """A tracker's request (a placement order) from a peer that does not hold the tracker lease."""

    code = ErrorCode.NOT_TRACKER


def gossip_config(config: PeerConfig) -> GossipConfig:
    return GossipConfig(probe_interval=config.probe_interval_s, probe_timeout=config.probe_timeout_s,
                        suspect_timeout=config.suspect_timeout_s, pushpull_interval=config.pushpull_interval_s,
                        card_budget=config.card_budget)


def election_config(config: PeerConfig) -> ElectionConfig:
    lease = config.lease_duration_s
    return ElectionConfig(lease_duration=lease, renew_interval=lease / 3, jitter_step=lease / 6, max_jitter=lease / 2)


@dataclass
class JoinGate:
    """A peer started with bootstrap addresses claims nothing until it has met the mesh (or given up
    waiting), so that it does not elect itself and place its own layers in isolation."""

    config: PeerConfig
    started_at: float
    met_mesh_at: float | None = None

    def joined(self, now: float, members: Mapping[str, MemberState]) -> bool:
        if not self.config.bootstrap:
            return True
        if self.met_mesh_at is None and any(s == MemberState.ALIVE for s in members.values()):
            self.met_mesh_at = now
        if self.met_mesh_at is not None:
            # give the current tracker's lease one gossip round to arrive before competing with it
            return now - self.met_mesh_at > 2 * self.config.pushpull_interval_s
        return now - self.started_at > 2 * self.config.lease_duration_s


Outward = Send | TrackerChanged | MemberChanged | AccusationHeard  # what the core leaves to whoever runs it


@dataclass
class ControlCore:
    """One peer's gossip and election wired together, without IO: leases heard by gossip go to the
    election, leases it issues go out by gossip, and what is left (messages to send, changes to
    report) is returned. The daemon performs it over the transport; the simulation over its network."""

    gossip: GossipNode
    election: Election
    gate: JoinGate

    def settle(self, actions: Iterable[GossipAction | ElectionAction], now: float) -> list[Outward]:
        out: list[Outward] = []
        for action in actions:
            if isinstance(action, LeaseReceived):
                out += self.settle(self.election.on_lease(action.signed, now), now)
            elif isinstance(action, BroadcastLease):
                out += self.settle(self.gossip.publish_lease(action.signed, now), now)
            else:
                out.append(action)
        return out

    def on_message(self, sender: str, message: cpb.GossipMessage, now: float) -> list[Outward]:
        return self.settle(self.gossip.on_message(sender, message, now), now)

    def tick(self, now: float, may_claim: bool) -> list[Outward]:
        """Tick gossip, then the election; ``may_claim``: whether this peer may take the tracker role
        now (the join gate is applied on top)."""
        out = self.settle(self.gossip.tick(now), now)
        alive_eligible = [p for p, c in self.gossip.live_cards().items() if c.card.tracker_eligible]
        self.election.eligible = may_claim and self.gate.joined(now, self.gossip.members())
        return out + self.settle(self.election.tick(now, alive_eligible), now)


class ControlPlane:
    def __init__(self, identity: Identity, config: PeerConfig, opener: StreamOpener,
                 card: Callable[[], cpb.CapabilityCard], directly_reachable: Callable[[], bool],
                 metrics: PeerMetrics | None = None,
                 last_received: Callable[[], Mapping[str, float]] | None = None) -> None:
        """``last_received``: per peer, when (``time.monotonic()``) the transport last got bytes from
        it (:meth:`~meshd.transport.transport.Transport.last_received`); gossip takes that as proof
        of life and spares those peers its probes."""
        self.identity = identity
        self.metrics = metrics or PeerMetrics()
        self.config = config
        self.opener = opener
        self.card = card
        self.directly_reachable = directly_reachable
        self.last_received = last_received
        self.gossip = GossipNode.with_identity(identity, card(), gossip_config(config), rng=random.Random(),
                                               card_ttl_ms=int(config.card_ttl_s * 1000))
        for address in config.bootstrap:
            self.gossip.add_seed(address)
        self.election = Election(identity.peer_id, config.tracker_eligible, election_config(config), identity=identity)
        self.duties = TrackerDuties()
        self.view = MeshView(self.gossip, clock=time.monotonic)
        self.leaving = False
        self.started_at = time.time()
        self.core = ControlCore(self.gossip, self.election, JoinGate(config, self.started_at))
        self._nursery: trio.Nursery | None = None
        self._links_checked = 0.0
        self.on_accusation: Callable[[aupb.SignedAccusation], None] | None = None  # the audits' to judge

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def tracker(self) -> str | None:
        return self.election.tracker(time.time())

    def takeover_bound_s(self) -> float:
        """Longest a mesh goes without a tracker after the tracker dies (see meshd.election)."""
        delivery = 2 * max(self.config.probe_interval_s, self.config.pushpull_interval_s)
        return round(self.election.config.takeover_bound(TICK_S, delivery), 3)

    def revoke(self, signed: apb.SignedRevocation) -> None:
        """Spread a revocation this peer signed; the revoked peer is dropped here at once."""
        self.perform(self.core.settle(self.gossip.revoke(signed, time.time()), time.time()))

    def own_card(self) -> cpb.CapabilityCard:
        """What this peer's card says now: the host's part, and the links this peer measured."""
        card = self.card()
        card.links.extend(self.view.published_links())
        return card

    def republish_card(self) -> None:
        assert self.gossip.issuer is not None
        self.gossip.issuer.template = self.own_card()
        self.gossip.republish(time.time())

    def refresh_links(self) -> None:
        """Issue a card when the measured links moved (see :func:`meshd.tracker.links.drifted`);
        otherwise the latest figures only wait in the template for the next card issued anyway."""
        assert self.gossip.issuer is not None
        held = self.gossip.store.get(self.peer_id)
        fresh = self.own_card()
        if held is not None and drifted(held.card.links, fresh.links):
            self.republish_card()
        else:
            self.gossip.issuer.template = fresh

    # -- running ---------------------------------------------------------------------------------

    async def run(self, on_tick: Callable[[], None], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick gossip and the election until cancelled; ``on_tick`` runs after every tick."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await self.tick(time.time())
                on_tick()
                await trio.sleep(TICK_S)

    async def tick(self, now: float) -> None:
        # the tracker must be directly reachable: every peer asks it for routes
        may_claim = self.config.tracker_eligible and not self.leaving and self.directly_reachable()
        if self.last_received is not None:
            ago = time.monotonic()
            for peer_id, at in self.last_received().items():
                self.gossip.heard_from(peer_id, now - (ago - at))
        self.perform(self.core.tick(now, may_claim))
        if not self.leaving and now - self._links_checked >= LINKS_REFRESH_S:
            self._links_checked = now
            self.refresh_links()
        if self.election.tracker(now) == self.peer_id:
            for order in self.duties.placement_orders(self.view.offers(), now):
                self._start(self._send_placement, order)

    async def leave(self) -> None:
        """Say goodbye by gossip; from now on this peer claims nothing."""
        self.leaving = True
        self.perform(self.core.settle(self.gossip.leave(time.time()), time.time()))

    def _start(self, fn: Callable[..., object], *args: object) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)  # type: ignore[arg-type]

    def perform(self, actions: Iterable[Outward]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._start(self._deliver, action)
            elif isinstance(action, TrackerChanged):
                self.metrics.tracker_changes.inc()
                log.info("tracker is now %s (term %d)", str(action.new)[:12], action.term)
            elif isinstance(action, MemberChanged):
                log.info("peer %s: %s -> %s", action.peer_id[:12], action.old and action.old.name, action.new.name)
            elif isinstance(action, AccusationHeard) and self.on_accusation is not None:
                self.on_accusation(action.signed)

    async def _deliver(self, send: Send) -> None:
        peer_id: str | None
        address: str | None
        if isinstance(send.to, Address):
            peer_id, address = None, str(send.to)
        else:
            peer_id, address = send.to, self.view.address_of(send.to)
        if address is None:
            return
        message = send.message
        if peer_id is not None:  # a seed's address names nobody whose answer could be taken from the reply
            message = cpb.GossipMessage()
            message.CopyFrom(send.message)
            message.answer_in_reply = True
        request = pb.PeerRequest(gossip=message)
        started = time.monotonic()
        self.metrics.gossip.labels("sent").inc()
        try:
            reply = await call(self.opener, peer_id, address, request,
                               timeout=max(1.0, self.config.probe_timeout_s * 2))
        except RpcFailed as exc:
            log.debug("gossip to %s failed: %s", address, exc)
            return
        if peer_id is not None:
            self.view.record_rtt(peer_id, (time.monotonic() - started) * 1000, time.time(), request.ByteSize())
            if reply.WhichOneof("body") == "gossip":
                self._received(peer_id, reply.gossip)

    async def _send_placement(self, order: Order) -> None:
        address = self.view.address_of(order.peer_id)
        if address is None:
            return
        try:
            await call(self.opener, order.peer_id, address, pb.PeerRequest(placement=order.message()),
                       timeout=PLACEMENT_SEND_TIMEOUT_S)
        except RpcFailed as exc:
            log.warning("placement on %s failed: %s", order.peer_id[:12], exc)
            return
        log.info("placed layers [%d, %d) of %s on %s", *order.layers, order.model_id, order.peer_id[:12])

    # -- peer RPC handlers -----------------------------------------------------------------------

    async def on_gossip(self, sender: str, message: cpb.GossipMessage) -> pb.Accepted | cpb.GossipMessage:
        """Take one gossip message; when its sender asked for it, the first answer to it goes back in the
        RPC's reply rather than in an RPC of its own."""
        answer = self._received(sender, message, answer=message.answer_in_reply)
        return answer if answer is not None else pb.Accepted()

    def _received(self, sender: str, message: cpb.GossipMessage, answer: bool = False) -> cpb.GossipMessage | None:
        """Hand ``message`` to the core and perform what it says; with ``answer``, the first message it
        sends back to ``sender`` is not sent but returned."""
        self.metrics.gossip.labels("received").inc()
        actions = self.core.on_message(sender, message, time.time())
        answered: cpb.GossipMessage | None = None
        if answer:
            first = next((a for a in actions if isinstance(a, Send) and a.to == sender), None)
            if first is not None:
                actions.remove(first)
                answered = first.message
                self.metrics.gossip.labels("sent").inc()
        self.perform(actions)
        return answered

    async def on_route(self, sender: str, request: pb.RouteRequest) -> pb.RouteReply | pb.NoRoute:
        return self.duties.route_reply(request, self.view.offers(), self.view.links(), entry=sender)

    def check_tracker(self, sender: str) -> None:
        """Raise unless ``sender`` holds the tracker lease now."""
        tracker = self.tracker()
        if sender != tracker:
            raise NotTracker(f"placement from {sender[:12]}, but the tracker is {str(tracker)[:12]}")
