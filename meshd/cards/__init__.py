"""Capability cards: what each peer signs and gossips about itself, and how receivers check it."""

from meshd.cards.card import Card, CardIssuer, CardRejected, CardStore, RejectReason, sign_card, verify_card
from meshd.cards.keys import peer_id_from_public_key, peer_id_of

__all__ = [
    "Card",
    "CardIssuer",
    "CardRejected",
    "CardStore",
    "RejectReason",
    "peer_id_from_public_key",
    "peer_id_of",
    "sign_card",
    "verify_card",
]
