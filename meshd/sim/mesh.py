"""N simulated peers: each a real :class:`~meshd.gossip.node.GossipNode` and
:class:`~meshd.election.election.Election`, configured as a daemon configures them, wired by the same
:class:`~meshd.daemon.control_plane.ControlCore` as in the daemon, exchanging serialized messages
over a simulated network.

The network delivers every message after a one-way latency plus jitter, loses each with a given
probability, and drops every message between two sides of a partition. Time is a fake clock that
advances in fixed steps; each step delivers what is due, then ticks every peer. Everything is drawn
from one seeded random generator, so a run is reproducible. The network counts the bytes each peer
sends and receives, and keeps every membership verdict and tracker change with its time.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from meshd.address import Address
from meshd.daemon.config import PeerConfig
from meshd.daemon.control_plane import TICK_S, ControlCore, JoinGate, Outward, election_config, gossip_config
from meshd.election import Election, TrackerChanged
from meshd.gossip import GossipNode, MemberChanged, MemberState, Send
from meshd.identity import Identity
from meshd.wire import card_pb2 as pb

STEP_S = TICK_S


@dataclass
class LinkModel:
    latency_s: float = 0.01   # one way
    jitter_s: float = 0.005   # uniform in [0, jitter) on top
    loss: float = 0.0         # probability that a message is lost


@dataclass
class SimPeer:
    peer_id: str
    address: str
    core: ControlCore
    sent_bytes: int = 0
    received_bytes: int = 0

    @property
    def gossip(self) -> GossipNode:
        return self.core.gossip

    @property
    def election(self) -> Election:
        return self.core.election


@dataclass(frozen=True)
class Verdict:
    at: float
    observer: str
    peer_id: str
    old: MemberState | None
    new: MemberState


@dataclass(frozen=True)
class Change:
    at: float
    observer: str
    tracker: str | None
    term: int


@dataclass
class SimMesh:
    """``n`` peers, the first the seed every other joins through."""

    n: int
    link: LinkModel = field(default_factory=LinkModel)
    seed: int = 1
    config: PeerConfig = field(default_factory=PeerConfig)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.now = 1_800_000_000.0  # wall-clock seconds: cards and leases carry absolute times
        self.started_at = self.now
        self.peers: dict[str, SimPeer] = {}
        self._by_address: dict[str, str] = {}
        seed_address = "sim0:7700"
        joining = replace(self.config, bootstrap=[seed_address])
        for i in range(self.n):
            identity = Identity.from_seed(hashlib.sha256(f"meshd-sim {self.seed} {i}".encode()).digest())
            address = f"sim{i}:7700"
            card = pb.CapabilityCard(addresses=[address], tracker_eligible=True)
            gossip = GossipNode.with_identity(identity, card, gossip_config(self.config),
                                              random.Random(self.rng.getrandbits(64)),
                                              card_ttl_ms=int(self.config.card_ttl_s * 1000))
            config = self.config if i == 0 else joining
            if i:
                gossip.add_seed(seed_address)
            election = Election(identity.peer_id, True, election_config(config), identity=identity)
            peer = SimPeer(identity.peer_id, address, ControlCore(gossip, election, JoinGate(config, self.now)))
            self.peers[peer.peer_id] = peer
            self._by_address[address] = peer.peer_id
        self.ids = list(self.peers)
        self.sides: dict[str, int] = {}  # peer -> side of a partition; empty: no partition
        self.verdicts: list[Verdict] = []
        self.changes: list[Change] = []
        self._queue: list[tuple[float, int, str, str, bytes]] = []
        self._order = itertools.count()

    @property
    def elapsed(self) -> float:
        return self.now - self.started_at

    # -- the network -----------------------------------------------------------------------------

    def partition(self, sides: dict[str, int]) -> None:
        self.sides = dict(sides)

    def heal(self) -> None:
        self.sides = {}

    def _lost(self, sender: str, to: str) -> bool:
        if self.sides and self.sides.get(sender) != self.sides.get(to):
            return True
        return self.link.loss > 0 and self.rng.random() < self.link.loss

    def _perform(self, peer: SimPeer, actions: Sequence[Outward]) -> None:
        for action in actions:
            if isinstance(action, Send):
                to = self._by_address[str(action.to)] if isinstance(action.to, Address) else action.to
                raw = action.message.SerializeToString()
                peer.sent_bytes += len(raw)
                delay = self.link.latency_s + self.rng.random() * self.link.jitter_s
                heapq.heappush(self._queue, (self.now + delay, next(self._order), peer.peer_id, to, raw))
            elif isinstance(action, TrackerChanged):
                self.changes.append(Change(self.elapsed, peer.peer_id, action.new, action.term))
            elif isinstance(action, MemberChanged):
                self.verdicts.append(Verdict(self.elapsed, peer.peer_id, action.peer_id, action.old, action.new))

    def step(self) -> None:
        """Advance one tick: deliver each message due before it at its own time (a daemon handles a
        message when it arrives, not at its next tick), then tick every peer's gossip and election."""
        tick_at = round(self.now + STEP_S, 6)
        while self._queue and self._queue[0][0] <= tick_at:
            at, _, sender, to, raw = heapq.heappop(self._queue)
            self.now = max(self.now, at)
            if self._lost(sender, to):
                continue
            target = self.peers[to]
            target.received_bytes += len(raw)
            self._perform(target, target.core.on_message(sender, pb.GossipMessage.FromString(raw), self.now))
        self.now = tick_at
        for peer in self.peers.values():
            self._perform(peer, peer.core.tick(self.now, may_claim=True))

    def run(self, seconds: float, until: Callable[[], bool] | None = None) -> float | None:
        """Run ``seconds`` of simulated time, or until ``until()`` holds; the elapsed time it first held."""
        end = self.elapsed + seconds
        while self.elapsed < end - 1e-9:
            self.step()
            if until is not None and until():
                return self.elapsed
        return None

    # -- what the peers think --------------------------------------------------------------------

    def trackers(self, among: list[str] | None = None) -> set[str | None]:
        return {self.peers[p].election.tracker(self.now) for p in (among or self.ids)}

    def converged(self, among: list[str] | None = None) -> bool:
        """Every peer (of ``among``) sees every other as alive, and all name the same tracker."""
        group = among or self.ids
        for p in group:
            members = self.peers[p].gossip.members()
            if any(members.get(q) != MemberState.ALIVE for q in group if q != p):
                return False
        trackers = self.trackers(group)
        return len(trackers) == 1 and None not in trackers

    def bytes_per_peer(self) -> list[int]:
        return [p.sent_bytes + p.received_bytes for p in self.peers.values()]
