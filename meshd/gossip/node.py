"""SWIM-style membership, failure detection and card dissemination, as a sans-IO state machine.

The node never touches a socket or a clock: the host feeds it messages and the current time and
performs the :mod:`~meshd.gossip.events` actions it returns.

Failure detection. Every ``probe_interval`` the node pings the next member of a shuffled
round-robin. Without an Ack within ``probe_timeout`` it asks ``indirect_probes`` other members to
ping the target for it (so one bad link does not condemn a healthy peer). Without any Ack by the
end of the interval the target becomes SUSPECT; a suspicion not refuted within ``suspect_timeout``
makes it DEAD. A member that proved itself alive within the last ``probe_interval`` (its own gossip,
or whatever else the host saw it send: :meth:`GossipNode.heard_from`) keeps its place in the
round-robin unprobed, as a ping would only learn what the node knows already; it is probed in the
first slot after it has been quiet for an interval, so a peer that falls silent waits at most one
interval longer for its first probe. Peers that talk anyway (a route's hops under load) pay no probes.
A peer refutes by issuing a card with a higher sequence: the card sequence is the SWIM incarnation,
and since only the peer can sign its card, nobody else can refute for it.

Dissemination. State changes and new cards ride on every outgoing message ("piggyback"), each
about ``retransmit_mult * ceil(log10(n + 1))`` times; every ``pushpull_interval`` the node also
compares bucket summaries of its digest with ``fanout`` random members (:mod:`~meshd.gossip.summary`)
and sends each side the cards the other lacks in the buckets that differ (anti-entropy), which
repairs whatever piggybacking missed. A peer issues its own card at most every :meth:`card_gap`,
which grows with the mesh, so the bytes a peer sends and receives per second stay bounded
however many peers there are. Leases travel the same way; in a
private mesh the latest revocations ride on push-pulls (between peers whose latest differ: see the
PushPull message), and a revoked peer is dropped as if it had
left (its cards are refused from then on by the :class:`~meshd.admission.gate.MeshGate`).

Time to DEAD everywhere. Each period a live target is probed by every other member in turn, so
with ``n`` members a silent peer goes undetected for ``p`` periods with probability about
``exp(-p)``. With high probability it is DEAD at every member within :func:`dead_everywhere_bound`::

    (ceil(ln n) + 3) * probe_interval              first suspicion (one interval of it: the deferral)
  + suspect_timeout                                 unrefuted suspicion
  + (ceil(log2 n) + 2) * min(probe_interval, pushpull_interval)   spread of the verdict
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshd.address import Address, AddressError
from meshd.cards.card import Card, CardIssuer, CardRejected, CardStore, RejectReason, peek_peer_id, verify_card
from meshd.election.lease import Lease, LeaseRejected, verify_lease
from meshd.gossip import summary
from meshd.gossip.events import AccusationHeard, Action, LeaseReceived, MemberChanged, MemberState, Send
from meshd.gossip.summary import SummaryCache, bucket_count_for
from meshd.identity import Identity
from meshd.limits import TokenBucket, remember
from meshd.wire import admission_pb2 as apb
from meshd.wire import audit_pb2 as aupb
from meshd.wire import card_pb2 as pb

if TYPE_CHECKING:
    from meshd.admission.gate import MeshGate

log = logging.getLogger("meshd.gossip")
REVOCATIONS_GOSSIPED = 64  # the latest ones ride on each push-pull; a join hands over all of them
ACCUSATIONS_TAKEN = 32  # from one push-pull (the host decides what they are worth)
ACCUSATIONS_REMEMBERED = 4096  # seen already: not reported again


@dataclass(frozen=True)
class GossipConfig:
    probe_interval: float = 1.0
    probe_timeout: float = 0.3
    indirect_probes: int = 3
    suspect_timeout: float = 5.0
    pushpull_interval: float = 2.0
    fanout: int = 1
    retransmit_mult: int = 4
    max_piggyback: int = 8
    push_fanout: int = 2  # members news (a lease, a death, a refutation) is passed on to at once
    card_budget: float = 2048.0  # bytes per second of new cards from the whole mesh (see card_gap)
    seed_retry_interval: float = 2.0
    tombstone_retention: float = 300.0  # how long DEAD/LEFT peers stay in the digest
    reconnect_interval: float = 5.0  # between push-pulls with a peer declared dead: heals partitions

    def __post_init__(self) -> None:
        if not 0 < self.probe_timeout < self.probe_interval:
            raise ValueError("probe_timeout must be positive and shorter than probe_interval")
        if self.card_budget <= 0:
            raise ValueError("card_budget must be positive")
        if self.indirect_probes < 0 or self.fanout < 1 or self.max_piggyback < 0:
            raise ValueError("indirect_probes >= 0, fanout >= 1 and max_piggyback >= 0 required")


def dead_everywhere_bound(config: GossipConfig, n_members: int) -> float:
    """High-probability bound from a peer going silent to DEAD at every member (see module doc)."""
    detect = (math.ceil(math.log(max(n_members, 2))) + 3) * config.probe_interval
    spread = (math.ceil(math.log2(max(n_members, 2))) + 2) * min(config.probe_interval, config.pushpull_interval)
    return detect + config.suspect_timeout + spread


@dataclass
class Member:
    peer_id: str
    state: MemberState
    incarnation: int  # the card sequence this state refers to
    since: float      # when this node saw the state begin
    heard: float = -math.inf  # when it last proved itself alive to this node (see heard_from)


@dataclass
class _Probe:
    target: str
    seq: int
    started: float
    indirect_sent_at: float | None = None

    @property
    def indirect_sent(self) -> bool:
        return self.indirect_sent_at is not None


@dataclass
class _Relay:
    requester: str
    seq: int
    target: str
    started: float


@dataclass
class _Broadcast:
    remaining: int
    digest: pb.MemberDigest | None = None
    card: pb.SignedCard | None = None


_GONE = (MemberState.DEAD, MemberState.LEFT)
VERIFIED_LEASES_KEPT = 64
MAX_SEQUENCE = 2**62  # claims of a sequence above this are ignored, about anyone: a card's sequence is a uint64
LEASES_SENT = 3  # the best leases held ride on every message (one, unless several peers claim at once)
LEASES_KEPT = 16  # the best leases held, at most: only the best decides, and only the best few are passed on
CARD_BURST = 4  # own cards that may go out in a row before the gap paces them
_STATE_VALUES = frozenset(int(s) for s in MemberState)


def _ms(now: float) -> int:
    return round(now * 1000)


class GossipNode:
    def __init__(self, self_id: str, config: GossipConfig | None = None, rng: random.Random | None = None,
                 issuer: CardIssuer | None = None) -> None:
        if issuer is not None and issuer.peer_id != self_id:
            raise ValueError("card issuer belongs to another peer")
        self.self_id = self_id
        self.config = config or GossipConfig()
        self.rng = rng or random.Random()
        self.issuer = issuer
        self.store = CardStore(owner=self_id)
        self.rejected_cards: Counter[RejectReason] = Counter()  # stale echoes count as REPLAYED
        self._members: dict[str, Member] = {}
        self._timed: set[str] = set()  # members with a deadline: suspects (to declare dead), tombstones (to forget)
        self._seeds: list[Address] = []
        self._left = False
        self._seq = 0
        self._probe: _Probe | None = None
        self._probe_order: list[str] = []
        self._relays: dict[int, _Relay] = {}
        self._next_probe_at = 0.0
        self._next_pushpull_at = 0.0
        self._next_seed_at = 0.0
        self._next_reconnect_at = 0.0
        self._last_address: dict[str, Address] = {}  # where dead members were last seen, to try them again
        self._queue: dict[str, _Broadcast] = {}
        self._leases: dict[str, Lease] = {}
        # Every message carries the tracker's lease: the same signed bytes arrive many times a second,
        # and checking an Ed25519 signature is most of what merging one costs. Remember what checked out.
        self._verified_leases: dict[bytes, Lease] = {}
        self.gate: MeshGate | None = None  # a private mesh's admission; None: an open mesh
        # the accusations this peer's audits stand behind or heard, to ride on push-pulls (the host's)
        self.accusations: Callable[[], list[aupb.SignedAccusation]] = list
        self._accusations_seen: dict[bytes, None] = {}
        self._floor_told: dict[str, float] = {}  # peers told their floor, until when not again
        self._summaries = SummaryCache()
        self._issued_at = 0.0  # when this peer last issued its own card
        self._changed = False  # the template changed since: a card is due once the gap has passed
        self._own_size = 0
        self._card_pace = TokenBucket(1.0, CARD_BURST, 0.0, 0.0)  # own cards of its own accord, one per gap

    def admit_with(self, gate: MeshGate) -> None:
        """Make this a private mesh's node: cards enter only with a valid credential."""
        self.gate = gate
        self.store.admit = gate.check_card

    @classmethod
    def with_identity(cls, identity: Identity, template: pb.CapabilityCard | None = None,
                 config: GossipConfig | None = None, rng: random.Random | None = None,
                 card_ttl_ms: int = 10 * 60 * 1000) -> GossipNode:
        issuer = CardIssuer(identity, template, ttl_ms=card_ttl_ms)
        return cls(issuer.peer_id, config, rng, issuer)

    # -- views --------------------------------------------------------------------------------

    def members(self) -> dict[str, MemberState]:
        """Every other peer this node knows, with its state (DEAD/LEFT until the tombstone ages out)."""
        return {peer_id: m.state for peer_id, m in self._members.items()}

    def member(self, peer_id: str) -> Member | None:
        return self._members.get(peer_id)

    def live_cards(self) -> dict[str, Card]:
        """Cards that routing may use: ALIVE and SUSPECT peers, and this peer; never DEAD or LEFT."""
        out: dict[str, Card] = {}
        for peer_id, card in self.store.cards().items():
            m = self._members.get(peer_id)
            if peer_id == self.self_id or (m is not None and m.state not in _GONE):
                out[peer_id] = card
        return out

    def live_card(self, peer_id: str) -> Card | None:
        """One peer's card, if :meth:`live_cards` would include it (without building them all)."""
        card = self.store.get(peer_id)
        if card is None or peer_id == self.self_id:
            return card
        m = self._members.get(peer_id)
        return card if m is not None and m.state not in _GONE else None

    def leases(self) -> list[pb.SignedLease]:
        """The best leases held (one, unless several peers claim at once): only the best decides."""
        return [lease.signed for lease in sorted(self._leases.values(), key=Lease.rank)[:LEASES_SENT]]

    # -- inputs -------------------------------------------------------------------------------

    def add_seed(self, address: Address | str) -> None:
        """Dial this address with a push-pull while the node knows no live member."""
        address = Address.coerce(address)
        if address not in self._seeds:
            self._seeds.append(address)

    def on_card(self, signed: pb.SignedCard, now: float) -> list[Action]:
        """A card from outside gossip (an invite, a direct handshake); verified like any other."""
        actions: list[Action] = []
        self._merge_card(signed, now, actions)
        return actions

    def republish(self, now: float) -> None:
        """Issue a fresh own card after the host changed ``issuer.template`` (ranges, load, addresses):
        at once, or when :meth:`card_gap` has passed since the last one."""
        if self.issuer is not None and not self._left:
            self._changed = True
            self._refresh_own_card(now)

    def publish_lease(self, signed: pb.SignedLease, now: float) -> list[Action]:
        """Spread a lease issued by this peer's election."""
        actions: list[Action] = []
        self._merge_lease(signed, now, actions, report=False)
        return actions

    def revoke(self, signed: apb.SignedRevocation, now: float) -> list[Action]:
        """A revocation signed by the mesh's admission key: the peer it names is dropped as left."""
        actions: list[Action] = []
        self._merge_revocations([signed], now, actions)
        return actions

    def _merge_revocations(self, revocations: Iterable[apb.SignedRevocation], now: float,
                           actions: list[Action]) -> None:
        if self.gate is None:
            return
        for peer_id in self.gate.revoke_all(revocations):
            if peer_id == self.self_id:
                continue
            held = self._members.get(peer_id)
            known = self.store.known_sequence(peer_id) or 0
            self._set_state(peer_id, MemberState.LEFT, max(known, held.incarnation if held else 0), now, actions)

    def _revocations(self) -> list[apb.SignedRevocation]:
        return self.gate.revocations(REVOCATIONS_GOSSIPED) if self.gate is not None else []

    def leave(self, now: float) -> list[Action]:
        """Announce a graceful departure; after this the node only answers pings."""
        self._left = True
        sequence = self.issuer.sequence if self.issuer else 0
        message = pb.GossipMessage(leave=pb.Leave(from_peer=self.self_id, sequence=sequence))
        targets = self._probeable()
        self.rng.shuffle(targets)
        count = self.config.fanout + self.config.indirect_probes
        return [self._send(peer_id, message) for peer_id in targets[:count]]

    def heard_from(self, peer_id: str, at: float) -> None:
        """``peer_id`` was seen sending something at ``at`` (over a connection that proved who sent
        it): evidence that it is alive, which spares it a probe (see the module doc)."""
        m = self._members.get(peer_id)
        if m is not None and at > m.heard:
            m.heard = at

    def on_message(self, sender: str, msg: pb.GossipMessage, now: float) -> list[Action]:
        """Handle one message; ``sender`` is the peer id the transport authenticated."""
        actions: list[Action] = []
        self.heard_from(sender, now)
        body = msg.WhichOneof("body")
        if body == "push_pull":  # before any card: a revoked peer's card is refused, not taken and dropped
            self._merge_revocations(msg.push_pull.revocations, now, actions)
        self._merge_all(msg.cards, msg.updates, msg.leases, now, actions, sender)
        if body == "ping":
            ack = pb.Ack(seq=msg.ping.seq, from_peer=self.self_id)
            actions.append(self._send(sender, pb.GossipMessage(ack=ack)))
        elif body == "ack":
            self._on_ack(msg.ack, actions)
        elif body == "ping_req" and not self._left and msg.ping_req.target_peer not in ("", self.self_id):
            seq = self._next_seq()
            self._relays[seq] = _Relay(sender, msg.ping_req.seq, msg.ping_req.target_peer, now)
            ping = pb.Ping(seq=seq, from_peer=self.self_id)
            actions.append(self._send(msg.ping_req.target_peer, pb.GossipMessage(ping=ping)))
        elif body == "push_pull":
            self._on_push_pull(sender, msg.push_pull, now, actions)
        elif body == "leave" and msg.leave.from_peer == sender:
            held = self._members.get(sender)
            incarnation = max(msg.leave.sequence, held.incarnation if held else 0)
            self._set_state(sender, MemberState.LEFT, incarnation, now, actions)
        return actions

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        if self._left:
            return actions
        self._refresh_own_card(now)
        for peer_id in self.store.sweep(_ms(now)):
            held = self._members.get(peer_id)
            if peer_id != self.self_id and held is not None and held.state not in _GONE:
                self._set_state(peer_id, MemberState.DEAD, held.incarnation, now, actions)
        self._run_probe(now, actions)
        forgotten = False
        for peer_id in list(self._timed):
            m = self._members[peer_id]
            if m.state == MemberState.SUSPECT and now >= m.since + self.config.suspect_timeout:
                self._set_state(peer_id, MemberState.DEAD, m.incarnation, now, actions)
            elif m.state in _GONE and now >= m.since + self.config.tombstone_retention:
                del self._members[peer_id]
                self._timed.discard(peer_id)
                self._last_address.pop(peer_id, None)
                forgotten = True
        if forgotten:
            self._summaries.forget([self.self_id, *self._members])
        for seq in [s for s, r in self._relays.items() if now >= r.started + self.config.probe_interval]:
            del self._relays[seq]
        now_ms = _ms(now)
        for peer_id in [p for p, lease in self._leases.items() if not lease.valid_at(now_ms)]:
            del self._leases[peer_id]
        if now >= self._next_pushpull_at:
            self._next_pushpull_at = now + self.config.pushpull_interval
            targets = self._probeable()
            for peer_id in self.rng.sample(targets, min(self.config.fanout, len(targets))):
                actions.append(self._send(peer_id, self._push_pull_request()))
        if now >= self._next_reconnect_at:
            self._next_reconnect_at = now + self.config.reconnect_interval
            self._reconnect(actions)
        if self._seeds and now >= self._next_seed_at and not self._probeable():
            self._next_seed_at = now + self.config.seed_retry_interval
            for address in self._seeds:
                actions.append(self._send(address, self._push_pull_request()))
        return actions

    def _reconnect(self, actions: list[Action]) -> None:
        """One push-pull with a random dead member's last address: when a partition heals, the two
        sides would otherwise never speak again, each having declared the other dead. (Not a seed: every
        peer asking the seed every few seconds would load it with the whole mesh's digests.)"""
        dead = [self._last_address[p] for p, m in self._members.items()
                if m.state == MemberState.DEAD and p in self._last_address]
        if dead:
            actions.append(self._send(self.rng.choice(dead), self._push_pull_request()))

    # -- failure detection ---------------------------------------------------------------------

    def _probeable(self) -> list[str]:
        return [p for p, m in self._members.items() if m.state not in _GONE and p in self.store]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _run_probe(self, now: float, actions: list[Action]) -> None:
        probe = self._probe
        if probe is not None:
            if not probe.indirect_sent and now >= probe.started + self.config.probe_timeout:
                probe.indirect_sent_at = now
                helpers = [p for p in self._probeable() if p != probe.target]
                req = pb.PingReq(seq=probe.seq, target_peer=probe.target, from_peer=self.self_id)
                for helper in self.rng.sample(helpers, min(self.config.indirect_probes, len(helpers))):
                    actions.append(self._send(helper, pb.GossipMessage(ping_req=req)))
            # the indirect probes get their whole window even when ticks are coarser than it: a
            # tick that sends them must not also give up on them
            window = self.config.probe_interval - self.config.probe_timeout
            if (probe.indirect_sent_at is not None and now >= probe.started + self.config.probe_interval
                    and now >= probe.indirect_sent_at + window):
                self._probe = None
                target = self._members.get(probe.target)
                if target is not None and target.state == MemberState.ALIVE:
                    self._set_state(probe.target, MemberState.SUSPECT, target.incarnation, now, actions)
                    actions.append(self._send(probe.target, pb.GossipMessage()))  # carries the suspicion
        if self._probe is None and now >= self._next_probe_at:
            target_id = self._next_target(now)
            if target_id is not None:
                self._next_probe_at = now + self.config.probe_interval
                self._probe = _Probe(target_id, self._next_seq(), now)
                ping = pb.Ping(seq=self._probe.seq, from_peer=self.self_id)
                actions.append(self._send(target_id, pb.GossipMessage(ping=ping)))

    def _next_target(self, now: float) -> str | None:
        """The next member of the round-robin to ping, passing over (and keeping in place) those heard
        from within the last interval; None when there is none to ping in this slot. Members that
        joined since the round began are added to it when all of it is passed over, so that a round
        held up by talkative members does not keep a newcomer from being probed."""
        if not self._probe_order:
            self._probe_order = self._probeable()
            self.rng.shuffle(self._probe_order)
        recent = now - self.config.probe_interval
        for _ in range(2):
            for index in range(len(self._probe_order) - 1, -1, -1):
                candidate = self._probe_order[index]
                m = self._members.get(candidate)
                if m is None or m.state in _GONE or candidate not in self.store:
                    del self._probe_order[index]
                elif not (m.state == MemberState.ALIVE and m.heard >= recent):
                    del self._probe_order[index]
                    return candidate
            waiting = set(self._probe_order)
            newcomers = [p for p in self._probeable() if p not in waiting]
            if not newcomers:
                return None
            self.rng.shuffle(newcomers)
            self._probe_order[:0] = newcomers  # after those already waiting: the list is taken from its end
        return None

    def _on_ack(self, ack: pb.Ack, actions: list[Action]) -> None:
        probe = self._probe
        if probe is not None and ack.seq == probe.seq and ack.from_peer == probe.target:
            self._probe = None
            return
        relay = self._relays.get(ack.seq)
        if relay is not None and ack.from_peer == relay.target:
            del self._relays[ack.seq]
            forward = pb.Ack(seq=relay.seq, from_peer=relay.target)
            actions.append(self._send(relay.requester, pb.GossipMessage(ack=forward)))

    # -- state merging -------------------------------------------------------------------------

    def _set_state(self, peer_id: str, state: MemberState, incarnation: int, now: float,
                   actions: list[Action]) -> None:
        m = self._members.get(peer_id)
        old = m.state if m is not None else None
        if m is None:
            m = self._members[peer_id] = Member(peer_id, state, incarnation, now)
        m.state, m.incarnation, m.since = state, max(m.incarnation, incarnation), now
        if state == MemberState.ALIVE:
            self._timed.discard(peer_id)
            self._last_address.pop(peer_id, None)
        else:
            self._timed.add(peer_id)
        if state in _GONE:
            held = self.store.get(peer_id)
            if state == MemberState.DEAD and held is not None and held.card.addresses:
                with contextlib.suppress(AddressError):  # a card's addresses are the peer's word: none kept
                    self._last_address[peer_id] = Address.coerce(held.card.addresses[0])
            elif state == MemberState.LEFT:
                self._last_address.pop(peer_id, None)
            self.store.remove(peer_id, floor=m.incarnation)
            if self._probe is not None and self._probe.target == peer_id:
                self._probe = None
        if state == MemberState.ALIVE:
            card = self.store.get(peer_id)
            if card is not None:
                self._enqueue(peer_id, card=card.signed)
        else:
            self._enqueue(peer_id, digest=pb.MemberDigest(peer_id=peer_id, sequence=m.incarnation, state=state.wire))
        if old != state:
            actions.append(MemberChanged(peer_id, old, state))
            if state in _GONE or old == MemberState.SUSPECT:
                # a death or a refutation; not a join (a mesh's worth at once would be a storm), nor a
                # suspicion: the suspect is told directly by the peer whose probe failed
                self._push_news(actions)

    def _merge_all(self, cards: Iterable[pb.SignedCard], digests: Iterable[pb.MemberDigest],
                   leases: Iterable[pb.SignedLease], now: float, actions: list[Action], sender: str = "") -> None:
        """Cards first (they prove liveness), then membership claims, then tracker leases."""
        for card in cards:
            self._merge_card(card, now, actions, sender)
        for digest in digests:
            self._merge_digest(digest, now, actions)
        for lease in leases:
            self._merge_lease(lease, now, actions)

    def _merge_card(self, signed: pb.SignedCard, now: float, actions: list[Action], sender: str = "") -> None:
        peer_id = peek_peer_id(signed)
        if peer_id == self.self_id:
            self._merge_own_card_echo(signed, now)
            return
        try:
            if not self.store.accept(signed, _ms(now)):
                return
        except CardRejected as exc:
            self.rejected_cards[exc.reason] += 1
            level = logging.INFO if exc.reason == RejectReason.REPLAYED else (
                logging.DEBUG if exc.reason == RejectReason.FULL else logging.WARNING)
            log.log(level, "card for %s rejected (%s): %s", str(peer_id)[:12], exc.reason, exc)
            if exc.reason == RejectReason.REPLAYED and peer_id is not None and peer_id == sender:
                self._tell_floor(peer_id, signed, now, actions)
            return
        assert peer_id is not None
        card = self.store.get(peer_id)
        assert card is not None
        m = self._members.get(peer_id)
        if m is None or card.sequence > m.incarnation:
            self._set_state(peer_id, MemberState.ALIVE, card.sequence, now, actions)
        else:
            self._enqueue(peer_id, card=card.signed)

    def _tell_floor(self, peer_id: str, signed: pb.SignedCard, now: float, actions: list[Action]) -> None:
        """A peer sent its own card, older than the floor held here: it restarted and forgot its
        sequence. Tell it the floor (it refutes with a newer card), at the address its card names,
        since with its card refused no address of it is known here. At most once a probe interval."""
        if now < self._floor_told.get(peer_id, 0.0):
            return
        try:
            card = verify_card(signed, _ms(now))  # its own signature: the address is the peer's word
            address = Address.coerce(card.card.addresses[0]) if card.card.addresses else None
        except (CardRejected, AddressError):
            return
        floor = self.store.known_sequence(peer_id)
        if address is None or floor is None:
            return
        remember(self._floor_told, peer_id, now + self.config.probe_interval, self.store.capacity)
        m = self._members.get(peer_id)
        state = m.state if m is not None and m.state in _GONE else MemberState.DEAD
        digest = pb.MemberDigest(peer_id=peer_id, sequence=floor, state=state.wire)
        actions.append(self._send(address, pb.GossipMessage(updates=[digest])))

    def _merge_own_card_echo(self, signed: pb.SignedCard, now: float) -> None:
        """Someone holds a card of ours newer than we remember (we restarted): jump above it."""
        if self.issuer is None or self._left:
            return
        try:
            card = verify_card(signed, _ms(now))
        except CardRejected as exc:
            self.rejected_cards[exc.reason] += 1
            return
        own = self.store.get(self.self_id)
        same_as_ours = own is not None and own.signed.card == signed.card
        if card.sequence >= MAX_SEQUENCE:
            return
        if card.sequence > self.issuer.sequence or (card.sequence == self.issuer.sequence and not same_as_ours):
            self._issue_own(now, at_least=card.sequence)

    def _merge_digest(self, digest: pb.MemberDigest, now: float, actions: list[Action]) -> None:
        state = MemberState(digest.state) if digest.state in _STATE_VALUES else None
        if state is None or state == MemberState.ALIVE:
            return  # liveness is only ever proven by a signed card
        if digest.sequence >= MAX_SEQUENCE:
            return  # a claim its subject ignores (it could never refute it) is believed by nobody either
        if digest.peer_id == self.self_id:
            if self.issuer is not None and not self._left and digest.sequence >= self.issuer.sequence:
                self._issue_own(now, at_least=digest.sequence)
                self._push_news(actions)
            return
        m = self._members.get(digest.peer_id)
        if m is None:
            if state in _GONE and len(self._members) < self.store.capacity:  # tombstones are bounded too
                self._members[digest.peer_id] = Member(digest.peer_id, state, digest.sequence, now)
                self._timed.add(digest.peer_id)
                self.store.remove(digest.peer_id, floor=digest.sequence)
                self._enqueue(digest.peer_id, digest=digest)
            return
        if digest.sequence < m.incarnation:
            return
        if state == MemberState.SUSPECT:
            if m.state == MemberState.ALIVE:
                self._set_state(digest.peer_id, state, digest.sequence, now, actions)
            elif m.state == MemberState.SUSPECT:
                m.incarnation = digest.sequence
        elif state == MemberState.DEAD:
            if m.state not in _GONE:
                self._set_state(digest.peer_id, state, digest.sequence, now, actions)
        elif m.state != MemberState.LEFT:
            self._set_state(digest.peer_id, state, digest.sequence, now, actions)

    def _merge_lease(self, signed: pb.SignedLease, now: float, actions: list[Action], report: bool = True) -> None:
        lease = self._verified_leases.get(signed.signature)
        if lease is None or lease.signed.lease != signed.lease:
            try:
                lease = verify_lease(signed)
            except LeaseRejected:
                return
            if len(self._verified_leases) >= VERIFIED_LEASES_KEPT:
                self._verified_leases.clear()
            self._verified_leases[signed.signature] = lease
        if not lease.valid_at(_ms(now)):
            return
        if self.gate is not None and not self.gate.admits(lease.peer_id):
            return  # in a private mesh only a member may be tracker, as only members' cards are held
        held = self._leases.get(lease.peer_id)
        if held is not None and (lease.term, lease.expires_at_ms) <= (held.term, held.expires_at_ms):
            return
        self._leases[lease.peer_id] = lease
        if len(self._leases) > LEASES_KEPT:  # claims of throwaway identities cannot grow the table
            worst = max(self._leases.values(), key=Lease.rank)
            del self._leases[worst.peer_id]
            if worst is lease:
                return
        self._push_news(actions)
        if report:
            actions.append(LeaseReceived(lease.signed))

    def _push_news(self, actions: list[Action]) -> None:
        """Pass news straight on to ``push_fanout`` random members, in a message of nothing but its
        piggyback (the newest broadcasts) and the leases: a lease newer than any held, a death, a
        refutation. Each peer does so once per piece of news, so it reaches a mesh of n
        peers in about log2(n) one-way latencies rather than log2(n) gossip periods. A large mesh
        needs that: a lease renewal must beat the lease it renews to every peer, and a refutation
        must beat ``suspect_timeout`` to every peer that heard the suspicion."""
        targets = self._probeable()
        for peer_id in self.rng.sample(targets, min(self.config.push_fanout, len(targets))):
            actions.append(self._send(peer_id, pb.GossipMessage()))

    # -- own card ------------------------------------------------------------------------------

    def card_gap(self) -> float:
        """Least seconds between two cards of this peer's own accord. Every peer receives every card,
        so the mesh's card bytes per second are what each peer pays: with ``n`` peers, each issuing
        one card of ``size`` bytes every ``n * size / card_budget`` seconds keeps that bounded however
        large the mesh grows. Refutations are never held back."""
        return (len(self._members) + 1) * self._own_size / self.config.card_budget

    def _refresh_own_card(self, now: float) -> None:
        """Re-issue before the card runs out (half its life), or a change held back by the gap. A
        few changes in a row go out at once (a starting peer's range, addresses and membership), as
        long as the peer has been quiet for a gap per card before them."""
        if self.issuer is None:
            return
        gap = self.card_gap()
        self._card_pace.rate = 1.0 / max(gap, 1e-9)  # the gap grows with the mesh
        own = self.store.get(self.self_id)
        if own is None:
            self._card_pace.take(1, now)
            self._issue_own(now)
            return
        lifetime_s = (own.expires_at_ms - own.card.issued_at_ms) / 1000
        due = self._issued_at + min(max(self.issuer.ttl_ms / 2000, gap), lifetime_s / 2)
        if now >= due:
            self._card_pace.take(1, now)  # counts against the pace; issued whatever is left
            self._issue_own(now)
        elif self._changed and self._card_pace.take(1, now) == 0.0:
            self._issue_own(now)

    def _issue_own(self, now: float, at_least: int = 0) -> None:
        """Sign a newer card; it refutes any suspicion about an older sequence. It lives at least
        twice the gap, so that the next refresh comes in its first half."""
        assert self.issuer is not None
        ttl_ms = max(self.issuer.ttl_ms, int(2000 * self.card_gap()))
        signed = self.issuer.issue(_ms(now), at_least=at_least, ttl_ms=ttl_ms)
        self.store.accept(signed, _ms(now))
        self._issued_at, self._changed, self._own_size = now, False, signed.ByteSize()
        self._enqueue(self.self_id, card=signed)

    # -- dissemination -------------------------------------------------------------------------

    def _retransmits(self) -> int:
        return self.config.retransmit_mult * max(1, math.ceil(math.log10(len(self._members) + 2)))

    def _enqueue(self, key: str, digest: pb.MemberDigest | None = None, card: pb.SignedCard | None = None) -> None:
        self._queue.pop(key, None)  # to the end: the newest goes first among equals
        self._queue[key] = _Broadcast(self._retransmits(), digest=digest, card=card)

    def _send(self, to: str | Address, body: pb.GossipMessage) -> Send:
        """Wrap a message with the best tracker leases held and as many pending broadcasts as fit,
        least-sent and then newest first (a refutation must not wait behind a
        backlog of old news). The leases ride on every message rather than taking turns with the
        broadcasts: a renewal must reach every peer before the lease it renews runs out, in a large
        mesh too."""
        message = pb.GossipMessage()
        message.CopyFrom(body)
        message.leases.extend(self.leases())
        chosen = sorted(reversed(self._queue.items()), key=lambda item: -item[1].remaining)[: self.config.max_piggyback]
        for key, entry in chosen:
            if entry.digest is not None:
                message.updates.append(entry.digest)
            if entry.card is not None:
                message.cards.append(entry.card)
            entry.remaining -= 1
            if entry.remaining <= 0:
                del self._queue[key]
        return Send(to, message)

    def _entries(self) -> list[tuple[str, int, int]]:
        """This node's digest: every member it knows and itself, as (peer id, sequence, state)."""
        own_state = MemberState.LEFT if self._left else MemberState.ALIVE
        own_seq = self.issuer.sequence if self.issuer else 0
        out = [(self.self_id, own_seq, int(own_state))]
        out.extend((peer_id, m.incarnation, int(m.state)) for peer_id, m in self._members.items())
        return out

    def _digest(self, buckets: set[int], count: int) -> list[pb.MemberDigest]:
        return [pb.MemberDigest(peer_id=peer_id, sequence=seq, state=MemberState(state).wire)
                for peer_id, seq, state in self._entries()
                if self._summaries.position(peer_id, count) in buckets]

    def _cards_in(self, buckets: set[int], count: int, have: dict[str, int] | None = None) -> list[pb.SignedCard]:
        """The live cards of these buckets that are newer than ``have`` (peer -> sequence held)."""
        have = have or {}
        return [card.signed for peer_id, card in self.live_cards().items()
                if self._summaries.position(peer_id, count) in buckets and have.get(peer_id, -1) < card.sequence]

    def _push_pull_request(self) -> pb.GossipMessage:
        own = self.store.get(self.self_id)
        count = bucket_count_for(len(self._members) + 1)
        request = pb.PushPull(summary=summary.encode(self._summaries.summarize(self._entries(), count)),
                              bucket_count=count, leases=self.leases(), cards=[own.signed] if own else [])
        self._add_records(request, None)
        return pb.GossipMessage(push_pull=request)

    def _add_records(self, out: pb.PushPull, theirs: pb.PushPull | None) -> bool:
        """Set this node's revocation and accusation hashes on ``out``, and add the lists whose hash
        ``theirs`` does not share; whether any was added."""
        revocations, accusations = self._revocations(), self.accusations()
        out.revocations_hash, out.accusations_hash = summary.hash_of(revocations), summary.hash_of(accusations)
        if theirs is None:
            return False
        added = False
        if theirs.revocations_hash != out.revocations_hash and revocations:
            out.revocations.extend(revocations)
            added = True
        if theirs.accusations_hash != out.accusations_hash and accusations:
            out.accusations.extend(accusations)
            added = True
        return added

    def _on_push_pull(self, sender: str, pp: pb.PushPull, now: float, actions: list[Action]) -> None:
        self._merge_all(pp.cards, pp.digest, pp.leases, now, actions, sender)
        for signed in pp.accusations[:ACCUSATIONS_TAKEN]:
            raw = signed.SerializeToString()
            if raw not in self._accusations_seen:  # the same ones come on every push-pull
                remember(self._accusations_seen, raw, None, ACCUSATIONS_REMEMBERED)
                actions.append(AccusationHeard(signed))
        count = pp.bucket_count if summary.valid_count(pp.bucket_count) else bucket_count_for(len(self._members) + 1)
        theirs = summary.decode(pp.summary) if pp.summary else None
        if theirs is not None and len(theirs) != count:
            theirs = None
        covered = {b for b in pp.buckets if b < count}
        have = {d.peer_id: d.sequence for d in pp.digest}
        if not pp.reply:
            # a request: name the buckets that differ and give their entries; where the initiator
            # holds nothing (or sent no usable summary) it lacks every card, so they go at once
            theirs = theirs or [0] * count
            ours = self._summaries.summarize(self._entries(), count)
            diff = summary.differing(ours, theirs)
            held = sorted(b for b in diff if theirs[b])  # both hold something: repair, a few at a time
            if len(held) > summary.MAX_REPAIRED:
                diff -= set(held) - set(self.rng.sample(held, summary.MAX_REPAIRED))
            reply = pb.PushPull(reply=True, summary=summary.encode(ours), bucket_count=count, buckets=sorted(diff),
                                digest=self._digest(diff, count),
                                cards=self._cards_in({b for b in diff if theirs[b] == 0}, count),
                                leases=self.leases())
            self._add_records(reply, pp)
            actions.append(self._send(sender, pb.GossipMessage(push_pull=reply)))
        elif theirs is not None:
            # the responder's answer: the cards it lacks in the buckets it covered, and this node's
            # entries where both hold something that differs, for it to send what this node lacks
            ours = self._summaries.summarize(self._entries(), count)
            mine = {b for b in summary.differing(ours, theirs) if ours[b] and theirs[b] and b in covered}
            lacking = self._cards_in(covered, count, have)
            finish = pb.PushPull(reply=True, cards=lacking, bucket_count=count, buckets=sorted(mine),
                                 digest=self._digest(mine, count))
            if self._add_records(finish, pp) or lacking or mine:
                actions.append(self._send(sender, pb.GossipMessage(push_pull=finish)))
        elif covered:
            lacking = self._cards_in(covered, count, have)
            if lacking:
                actions.append(self._send(sender, pb.GossipMessage(push_pull=pb.PushPull(reply=True, cards=lacking))))


__all__ = ["GossipConfig", "GossipNode", "Member", "dead_everywhere_bound"]
