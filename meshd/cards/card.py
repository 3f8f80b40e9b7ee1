"""Capability cards: sign, verify, and keep the latest verified card of every peer.

A card is accepted only when its bytes parse, its public key derives its peer id, its signature
covers exactly those bytes, it has not expired, its sequence is newer than any card already held
for that peer, and (in a private mesh) it carries the peer's valid membership. Anything else
raises :class:`CardRejected` and changes nothing, so a forged, replayed or stale card can never
displace what a peer last said about itself.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from meshd.errors import ErrorCode, MeshError
from meshd.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_from_public_key, verify
from meshd.limits import remember
from meshd.wire import card_pb2 as pb

STORE_CAPACITY = 10_000


class RejectReason(enum.StrEnum):
    BAD_SIGNATURE = "bad_signature"
    KEY_MISMATCH = "key_mismatch"
    EXPIRED = "expired"
    REPLAYED = "replayed"
    MALFORMED = "malformed"
    FULL = "store_full"
    NOT_MEMBER = "not_member"
    REVOKED = "revoked"


class CardRejected(MeshError):
    """A card failed verification; ``reason`` says which check refused it."""

    code = ErrorCode.CARD_REJECTED

    def __init__(self, reason: RejectReason, detail: str = "") -> None:
        super().__init__(f"card rejected: {reason.value}" + (f" ({detail})" if detail else ""))
        self.reason = reason


@dataclass(frozen=True)
class Card:
    """A verified card: the parsed record plus the signed bytes it came from, for re-gossip."""

    card: pb.CapabilityCard
    signed: pb.SignedCard

    @property
    def peer_id(self) -> str:
        return self.card.peer_id

    @property
    def sequence(self) -> int:
        return self.card.sequence

    @property
    def expires_at_ms(self) -> int:
        return self.card.expires_at_ms


def sign_card(card: pb.CapabilityCard, identity: Identity) -> pb.SignedCard:
    """Serialize once and sign those exact bytes; receivers verify the bytes, not a re-encoding."""
    payload = card.SerializeToString(deterministic=True)
    return pb.SignedCard(card=payload, signature=identity.sign(payload))


def _parse_signed(signed: pb.SignedCard | bytes) -> pb.SignedCard:
    if isinstance(signed, pb.SignedCard):
        return signed
    out = pb.SignedCard()
    try:
        out.ParseFromString(bytes(signed))
    except DecodeError as exc:
        raise CardRejected(RejectReason.MALFORMED, "signed card does not parse") from exc
    return out


def verify_card(signed: pb.SignedCard | bytes, now_ms: int, known_sequence: int | None = None) -> Card:
    """Verify one card; ``known_sequence`` is the sequence already held for that peer, if any."""
    signed = _parse_signed(signed)
    card = pb.CapabilityCard()
    try:
        card.ParseFromString(signed.card)
    except DecodeError as exc:
        raise CardRejected(RejectReason.MALFORMED, "card does not parse") from exc
    if not card.peer_id or len(card.public_key) != PUBLIC_KEY_BYTES or len(signed.signature) != SIGNATURE_BYTES:
        raise CardRejected(RejectReason.MALFORMED, "missing peer id, key or signature")
    if card.expires_at_ms <= card.issued_at_ms:
        raise CardRejected(RejectReason.MALFORMED, "expires before it was issued")
    if peer_id_from_public_key(card.public_key) != card.peer_id:
        raise CardRejected(RejectReason.KEY_MISMATCH, card.peer_id)
    if not verify(card.public_key, signed.card, signed.signature):
        raise CardRejected(RejectReason.BAD_SIGNATURE, card.peer_id)
    if card.expires_at_ms <= now_ms:
        raise CardRejected(RejectReason.EXPIRED, f"{card.peer_id} expired at {card.expires_at_ms}")
    if known_sequence is not None and card.sequence <= known_sequence:
        raise CardRejected(RejectReason.REPLAYED, f"{card.peer_id} sequence {card.sequence} <= {known_sequence}")
    return Card(card=card, signed=pb.SignedCard(card=signed.card, signature=signed.signature))


@dataclass
class CardStore:
    """The latest verified card per peer, plus a sequence floor for peers whose card was dropped.

    The floor outlives the card so that an old card still circulating in gossip cannot bring a dead
    or departed peer back; only a newer card from the peer itself can.
    """

    capacity: int = STORE_CAPACITY  # peers' cards held at most: new identities cost nothing to make
    owner: str = ""  # the peer whose store this is: its own card is always held (beyond the capacity, unchecked)
    # a private mesh's admission check: raises CardRejected for a card of a peer that does not belong
    admit: Callable[[pb.CapabilityCard], None] | None = None
    _cards: dict[str, Card] = field(default_factory=dict)
    _floor: dict[str, int] = field(default_factory=dict)
    _next_expiry_ms: int | None = None  # no card expires before this (it may be earlier than the truth)

    def accept(self, signed: pb.SignedCard | bytes, now_ms: int) -> bool:
        """Store the card if it verifies and is newer; False for an exact duplicate of the held card.

        Gossip delivers the same card many times; a byte-identical copy is not an attack, so it is
        answered cheaply without a signature check. Any other failure raises :class:`CardRejected`.
        """
        signed = _parse_signed(signed)
        peer_id = peek_peer_id(signed)
        held = self._cards.get(peer_id) if peer_id else None
        if held is not None and held.signed.card == signed.card and held.signed.signature == signed.signature:
            return False
        if held is None and len(self._cards) >= self.capacity and peer_id != self.owner:
            raise CardRejected(RejectReason.FULL, f"{self.capacity} cards held already")
        known = self.known_sequence(peer_id) if peer_id else None
        card = verify_card(signed, now_ms, known)
        if self.admit is not None and card.peer_id != self.owner:
            self.admit(card.card)
        self._cards[card.peer_id] = card
        if self._next_expiry_ms is None or card.expires_at_ms < self._next_expiry_ms:
            self._next_expiry_ms = card.expires_at_ms
        return True

    def known_sequence(self, peer_id: str) -> int | None:
        held = self._cards.get(peer_id)
        if held is not None:
            return held.sequence
        return self._floor.get(peer_id)

    def get(self, peer_id: str) -> Card | None:
        return self._cards.get(peer_id)

    def cards(self) -> dict[str, Card]:
        return dict(self._cards)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._cards

    def __len__(self) -> int:
        return len(self._cards)

    def remove(self, peer_id: str, floor: int | None = None) -> Card | None:
        """Drop a peer's card, remembering its sequence (or ``floor`` if higher) as the replay floor."""
        card = self._cards.pop(peer_id, None)
        marks = [s for s in (card.sequence if card else None, floor, self._floor.get(peer_id)) if s is not None]
        if marks:  # the oldest floors go first beyond the capacity (their cards have expired since)
            remember(self._floor, peer_id, max(marks), self.capacity)
        return card

    def sweep(self, now_ms: int) -> list[str]:
        """Drop every expired card; return the peers whose card went. Called on every gossip tick, so it
        looks at the cards only once the earliest expiry has come."""
        if self._next_expiry_ms is None or now_ms < self._next_expiry_ms:
            return []
        gone = [peer_id for peer_id, card in self._cards.items() if card.expires_at_ms <= now_ms]
        for peer_id in gone:
            self.remove(peer_id)
        self._next_expiry_ms = min((c.expires_at_ms for c in self._cards.values()), default=None)
        return gone


def peek_peer_id(signed: pb.SignedCard) -> str | None:
    """The peer id a card claims, unverified; used to find the held card before checking."""
    card = pb.CapabilityCard()
    try:
        card.ParseFromString(signed.card)
    except DecodeError:
        return None
    return card.peer_id or None


class CardIssuer:
    """Issues this peer's own cards with strictly increasing sequence numbers.

    ``template`` holds everything except identity, sequence and validity times, which the issuer
    fills in; callers update the template (load, models, addresses) and issue again.
    """

    def __init__(self, identity: Identity, template: pb.CapabilityCard | None = None,
                 ttl_ms: int = 10 * 60 * 1000, sequence: int = 0) -> None:
        self.identity = identity
        self.public_key = identity.public_key
        self.peer_id = identity.peer_id
        self.template = template if template is not None else pb.CapabilityCard()
        self.ttl_ms = ttl_ms
        self.sequence = sequence

    def issue(self, now_ms: int, at_least: int = 0, ttl_ms: int | None = None) -> pb.SignedCard:
        """Sign a new card whose sequence beats both our last one and ``at_least``; it lives
        ``ttl_ms`` (default: the issuer's)."""
        self.sequence = max(self.sequence, at_least) + 1
        card = pb.CapabilityCard()
        card.CopyFrom(self.template)
        card.peer_id = self.peer_id
        card.public_key = self.public_key
        card.sequence = self.sequence
        card.issued_at_ms = now_ms
        card.expires_at_ms = now_ms + (self.ttl_ms if ttl_ms is None else ttl_ms)
        return sign_card(card, self.identity)
