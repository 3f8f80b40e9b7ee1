"""Capability cards: what each peer signs and gossips about itself, and how receivers check it."""

from meshd.cards.card import Card, CardIssuer, CardRejected, CardStore, RejectReason, sign_card, verify_card

__all__ = [
    "Card",
    "CardIssuer",
    "CardRejected",
    "CardStore",
    "RejectReason",
    "sign_card",
    "verify_card",
]
