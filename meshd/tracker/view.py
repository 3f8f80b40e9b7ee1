"""The mesh as this peer sees it, and the slice of it that placement and routing look at.

Everything a peer knows about others comes from verified capability cards (gossip), the membership
verdicts of failure detection, and the links it measured itself. :class:`MeshView` turns that
into :class:`ShardOffer` records and a :class:`~meshd.tracker.links.LinkTable` for placement and
routing, and answers the questions the other planes ask: where to dial a peer, whether it is alive,
which models the mesh covers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from meshd.gossip.events import MemberState
from meshd.tracker.links import LinkMeter, LinkTable
from meshd.wire import card_pb2 as cpb

if TYPE_CHECKING:
    from meshd.gossip.node import GossipNode

log = logging.getLogger("meshd.tracker")

DEFAULT_CONTEXT_LENGTH = 2048
MAX_LAYERS = 1024  # more than any model has; placement and routing work per layer, so a card may not claim more
UNREACHABLE_FOR_S = 10.0  # how long routes keep away from a peer that failed to answer, unless nothing else covers


@dataclass(frozen=True)
class ShardOffer:
    """One peer's offer of one model, as its capability card states it."""

    peer_id: str
    model_id: str
    compat_key: str
    n_layers: int
    layer_bytes: int             # weight bytes of one decoder layer
    edge_bytes: int              # extra bytes of the embedding (head) or final norm + LM head (tail)
    memory_budget_bytes: int     # what the peer may spend on weights for this model
    range: tuple[int, int] | None  # loaded (or pinned) range; None while waiting to be placed
    ms_per_layer: float = 1.0    # measured decode time of one layer for one token
    active_sessions: int = 0
    queued: int = 0
    relayed: bool = False
    pinned: bool = False         # the operator fixed the range; placement never assigns one
    prefill_ms_per_token: float = 0.0  # measured prefill time of one token on the whole range (0: unmeasured)
    kv_token_bytes: int = 0      # KV bytes one token takes on the range
    prefill_only: bool = False   # a prefill worker only: never planned into a route

    def placed(self, layers: tuple[int, int]) -> ShardOffer:
        return replace(self, range=layers)


@dataclass(frozen=True)
class Crossing:
    """One link a decode token crosses, as the planner estimated it: half the round trip, plus the
    bytes it carries over the link's rate (milliseconds). ``rtt_ms`` and ``rate_bps`` are what was
    used, measured or the defaults; ``relayed``: an end is reached through a relay."""

    from_peer: str
    to_peer: str
    rtt_ms: float
    rate_bps: float
    bytes: int
    latency_ms: float
    transfer_ms: float
    rtt_measured: bool
    rate_measured: bool
    relayed: bool

    @property
    def cost_ms(self) -> float:
        return self.latency_ms + self.transfer_ms


@dataclass(frozen=True)
class HopTerms:
    """What the planner estimated for one hop of a route, in milliseconds per decode token.

    ``seam_ms`` is the cost of ``crossing``, the link into this hop (from the entry, for the head).
    """

    peer_id: str
    start: int
    end: int
    compute_ms: float
    seam_ms: float
    hop_ms: float
    load_factor: float
    crossing: Crossing | None = None


@dataclass(frozen=True)
class Hop:
    peer_id: str
    start: int
    end: int


@dataclass(frozen=True)
class Route:
    model_id: str
    compat_key: str
    hops: tuple[Hop, ...]
    epoch: int
    cost_ms: float
    terms: tuple[HopTerms, ...] = ()
    entry: str = ""                 # the peer it was planned for ("" when the planner did not know)
    back: Crossing | None = None    # the tail's token back to the entry

    def describe(self) -> str:
        return " -> ".join(f"{h.peer_id[:8]}[{h.start},{h.end})" for h in self.hops)

    def position_of(self, peer_id: str) -> str:
        """``head``, ``middle`` or ``tail`` for a peer of this route (``unknown`` otherwise)."""
        ids = [h.peer_id for h in self.hops]
        if peer_id not in ids:
            return "unknown"
        index = ids.index(peer_id)
        return "head" if index == 0 else "tail" if index == len(ids) - 1 else "middle"


def dial_address(card: cpb.CapabilityCard) -> str | None:
    """The address to dial a peer at: its first direct address, else its first relay address."""
    if card.addresses:
        return card.addresses[0]
    if card.relay_addresses:
        return card.relay_addresses[0]
    return None


def relayed_through(card: cpb.CapabilityCard) -> list[str]:
    """The relays a peer is reached through, empty when it is directly dialable."""
    return [] if card.addresses else list(card.relay_addresses)


def offers_of(card: cpb.CapabilityCard) -> list[ShardOffer]:
    """The models a card offers, one :class:`ShardOffer` each."""
    out = []
    for m in card.models:
        if m.shard_error:  # its shard failed its checks: neither placed nor routed
            continue
        if not m.model_id or not m.compat_key or not 0 < m.n_layers <= MAX_LAYERS or m.range_end > m.n_layers:
            continue  # a signed card may still say nonsense about a model: it offers nothing then
        placed = m.range_end > m.range_start
        layers = (m.range_end - m.range_start) if placed else m.n_layers
        ms_per_layer = 1000.0 / (m.decode_tok_s * layers) if m.decode_tok_s > 0 and layers else 1.0
        out.append(ShardOffer(
            peer_id=card.peer_id, model_id=m.model_id, compat_key=m.compat_key, n_layers=m.n_layers,
            layer_bytes=m.layer_bytes, edge_bytes=m.edge_bytes, memory_budget_bytes=card.memory_budget_bytes,
            range=(m.range_start, m.range_end) if placed else None, ms_per_layer=ms_per_layer,
            active_sessions=card.load.active_sessions, queued=card.load.queued, relayed=not card.addresses,
            pinned=m.pinned, prefill_ms_per_token=1000.0 / m.prefill_tok_s if m.prefill_tok_s > 0 else 0.0,
            kv_token_bytes=m.kv_token_bytes, prefill_only=m.prefill_only,
        ))
    return out


@dataclass
class MeshView:
    """Cards, membership and measured links, as one view for the planes that need them.

    ``clock`` is the monotonic clock that times unreachability marks and link measurements (a fake
    one in tests).
    """

    gossip: GossipNode
    clock: Callable[[], float]
    meter: LinkMeter = field(default_factory=LinkMeter)
    _unreachable: dict[str, float] = field(default_factory=dict)
    _demoted: dict[str, tuple[int, str]] = field(default_factory=dict)  # peer -> (card sequence, why)

    @property
    def self_id(self) -> str:
        return self.gossip.self_id

    def cards(self) -> dict[str, cpb.CapabilityCard]:
        return {peer_id: card.card for peer_id, card in self.gossip.live_cards().items()}

    def offers(self) -> list[ShardOffer]:
        """Every model offer in the live view (including this peer's), for placement and routing."""
        return [offer for card in self.cards().values() for offer in offers_of(card)]

    def known_models(self) -> set[str]:
        return {o.model_id for o in self.offers()}

    def covered_models(self) -> list[str]:
        from meshd.tracker.routing import NoRouteError, plan_route

        offers = self.offers()
        covered = []
        for model_id in sorted({o.model_id for o in offers}):
            try:
                plan_route(model_id, offers, self.links())
            except NoRouteError:
                continue
            covered.append(model_id)
        return covered

    def context_length(self, model_id: str) -> int:
        for card in self.cards().values():
            for m in card.models:
                if m.model_id == model_id and m.context_length:
                    return m.context_length
        return DEFAULT_CONTEXT_LENGTH

    def address_of(self, peer_id: str) -> str | None:
        card = self.gossip.live_card(peer_id)
        return None if card is None else dial_address(card.card)

    def sources_of(self, compat_key: str) -> list[tuple[str, str]]:
        """(peer id, address) of the other live peers that offer ``compat_key``: who can hand out its
        files and weights."""
        out = []
        for offer in sorted(self.offers(), key=lambda o: o.peer_id):
            address = self.address_of(offer.peer_id)
            if offer.compat_key == compat_key and offer.peer_id != self.self_id and address is not None:
                out.append((offer.peer_id, address))
        return out

    def links(self) -> LinkTable:
        """Every link this peer knows of, for planning routes: its own measurements and the cards'."""
        def card_of(peer_id: str) -> cpb.CapabilityCard | None:
            card = self.gossip.live_card(peer_id)
            return None if card is None else card.card

        return LinkTable(self.self_id, self.meter.estimate, card_of)

    @property
    def rtt_of(self) -> LinkTable:
        """The link table; called with a peer id it is this peer's round trip to it (0 to itself), so
        a planner given it as its round trips gets every link the cards publish too."""
        return self.links()

    def record_rtt(self, peer_id: str, elapsed_ms: float, wall_now: float, nbytes: int = 0) -> None:
        """A request of ``nbytes`` to the peer answered after ``elapsed_ms``."""
        self.meter.record_rtt(peer_id, elapsed_ms, self.clock(), nbytes)
        self.gossip.heard_from(peer_id, wall_now)

    def record_transfer(self, peer_id: str, nbytes: int, started: float, ended: float) -> None:
        """A bulk transfer with the peer, timed on :attr:`clock`: what measures a link's rate."""
        self.meter.record_transfer(peer_id, nbytes, started, ended)

    def published_links(self) -> list[cpb.LinkMeasure]:
        """The link measures for this peer's card: those to peers serving layers first, and of those the
        ones its card holds already."""
        serving = {o.peer_id for o in self.offers() if o.range is not None}
        own = self.gossip.store.get(self.self_id)
        held = {m.peer_id for m in own.card.links} if own is not None else set()
        return self.meter.published(self.clock(), serving.__contains__, held)

    def last_seen(self, peer_id: str) -> float | None:
        """When (wall clock) the peer last proved itself alive here: gossip's record, which every
        message it sent and every byte the transport received from it update."""
        member = self.gossip.member(peer_id)
        return None if member is None or member.heard == -math.inf else member.heard

    def alive_members(self) -> list[str]:
        return sorted(p for p, state in self.gossip.members().items() if state == MemberState.ALIVE)

    def is_alive(self, peer_id: str) -> bool:
        """Gossip's verdict, for sessions in flight: only a peer declared dead fails them (a leaving
        peer is still draining its running sessions)."""
        if peer_id == self.self_id:
            return True
        member = self.gossip.member(peer_id)
        return member is None or member.state != MemberState.DEAD

    def mark_unreachable(self, peer_id: str) -> None:
        """Keep routes away from a peer that just failed to answer, until gossip decides about it."""
        self._unreachable[peer_id] = self.clock() + UNREACHABLE_FOR_S

    def demote(self, peer_id: str, why: str) -> None:
        """A peer's card claimed what it does not do (a range it does not hold): keep it out of routes
        until it issues a new card, a new claim to try."""
        card = self.gossip.store.get(peer_id)
        if card is not None and peer_id != self.self_id:
            self._demoted[peer_id] = (card.sequence, why)
            log.warning("demoted %s: its card claims what it does not do (%s)", peer_id[:12], why)

    def demoted(self) -> dict[str, str]:
        """Peers demoted for their current card, with why."""
        out = {}
        for peer_id, (sequence, why) in list(self._demoted.items()):
            card = self.gossip.store.get(peer_id)
            if card is None or card.sequence != sequence:
                del self._demoted[peer_id]  # gone, or a new card: a new claim
            else:
                out[peer_id] = why
        return out

    def avoided(self) -> frozenset[str]:
        """Peers routes should avoid when they can: recently unreachable, or not known to be alive."""
        now = self.clock()
        for peer_id in [p for p, until in self._unreachable.items() if until <= now]:
            del self._unreachable[peer_id]
        suspects = {p for p, state in self.gossip.members().items() if state != MemberState.ALIVE}
        return frozenset(set(self._unreachable) | suspects)
