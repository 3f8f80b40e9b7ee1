"""Capability cards: signing, the five rejection reasons, and a store that rejections never touch."""

from __future__ import annotations

import pytest

from meshd.cards import (
    CardIssuer,
    CardRejected,
    CardStore,
    RejectReason,
    sign_card,
    verify_card,
)
from meshd.identity import Identity, peer_id_from_public_key
from meshd.wire import card_pb2 as pb

NOW = 1_000_000


def make_card(key: Identity, sequence: int = 1, **overrides) -> pb.CapabilityCard:
    public = key.public_key
    card = pb.CapabilityCard(
        peer_id=peer_id_from_public_key(public), public_key=public, name="gpu-box", sequence=sequence,
        issued_at_ms=NOW - 1000, expires_at_ms=NOW + 60_000, addresses=["10.0.0.2:7400"],
        api_address="10.0.0.2:8080", tracker_eligible=True, software_version="0.1.0",
        hardware=pb.Hardware(ram_bytes=64 << 30, device="cuda:0", cpu_count=16),
        models=[pb.ModelServed(model_id="tiny", compat_key="abc", n_layers=8, range_start=0, range_end=4,
                               decode_tok_s=42.5)],
        load=pb.Load(active_sessions=1), kv_free_bytes=1 << 30, memory_budget_bytes=32 << 30,
    )
    for name, value in overrides.items():
        setattr(card, name, value)
    return card


@pytest.fixture
def key() -> Identity:
    return Identity.generate()


def snapshot(store: CardStore) -> dict[str, bytes]:
    return {peer_id: card.signed.SerializeToString() for peer_id, card in store.cards().items()}


def test_peer_id_derivation_is_stable():
    assert peer_id_from_public_key(bytes(32)) == peer_id_from_public_key(bytes(32))
    pid = peer_id_from_public_key(bytes(range(32)))
    assert len(pid) == 32 and pid == pid.lower() and "=" not in pid


def test_valid_card_is_accepted_and_round_trips(key):
    store = CardStore()
    signed = sign_card(make_card(key), key)
    assert store.accept(signed.SerializeToString(), NOW)
    held = store.get(peer_id_from_public_key(key.public_key))
    assert held is not None and held.sequence == 1
    assert held.card.models[0].range_end == 4 and held.card.hardware.device == "cuda:0"
    assert store.accept(signed, NOW) is False  # an exact duplicate is a gossip echo, not news
    assert store.accept(sign_card(make_card(key, sequence=2), key), NOW)
    assert store.get(held.peer_id).sequence == 2


def test_issuer_increments_sequence(key):
    issuer = CardIssuer(key, pb.CapabilityCard(name="n"), ttl_ms=5000)
    first = verify_card(issuer.issue(NOW), NOW)
    second = verify_card(issuer.issue(NOW + 1, at_least=10), NOW, known_sequence=first.sequence)
    assert (first.sequence, second.sequence) == (1, 11)
    assert second.card.name == "n" and second.expires_at_ms == NOW + 1 + 5000


def tampered(key: Identity) -> pb.SignedCard:
    signed = sign_card(make_card(key), key)
    card = pb.CapabilityCard.FromString(signed.card)
    card.kv_free_bytes = 1 << 40
    return pb.SignedCard(card=card.SerializeToString(), signature=signed.signature)


def signed_by_other(key: Identity) -> pb.SignedCard:
    return sign_card(make_card(key), Identity.generate())


def key_not_matching(key: Identity) -> pb.SignedCard:
    other = Identity.generate()
    return sign_card(make_card(key, public_key=other.public_key), other)


def expired(key: Identity) -> pb.SignedCard:
    return sign_card(make_card(key, issued_at_ms=NOW - 10_000, expires_at_ms=NOW), key)


def no_signature(key: Identity) -> pb.SignedCard:
    return pb.SignedCard(card=make_card(key).SerializeToString())


@pytest.mark.parametrize(("build", "reason"), [
    (tampered, RejectReason.BAD_SIGNATURE),
    (signed_by_other, RejectReason.BAD_SIGNATURE),
    (key_not_matching, RejectReason.KEY_MISMATCH),
    (expired, RejectReason.EXPIRED),
    (no_signature, RejectReason.MALFORMED),
])
def test_bad_cards_are_rejected_with_reason_and_leave_store_unchanged(key, build, reason):
    store = CardStore()
    other = Identity.generate()
    store.accept(sign_card(make_card(other), other), NOW)
    before = snapshot(store)
    with pytest.raises(CardRejected) as info:
        store.accept(build(key), NOW)
    assert info.value.reason == reason
    assert info.value.code == "card_rejected"
    assert snapshot(store) == before


@pytest.mark.parametrize("older", [True, False])
def test_replayed_sequence_is_rejected(key, older):
    store = CardStore()
    store.accept(sign_card(make_card(key, sequence=5), key), NOW)
    before = snapshot(store)
    replay = make_card(key, sequence=4 if older else 5, name="different")
    with pytest.raises(CardRejected) as info:
        store.accept(sign_card(replay, key), NOW)
    assert info.value.reason == RejectReason.REPLAYED
    assert snapshot(store) == before


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff", b"\x0a\x05abc", bytes(range(256))])
def test_garbage_bytes_are_malformed(garbage):
    store = CardStore()
    with pytest.raises(CardRejected) as info:
        store.accept(garbage, NOW)
    assert info.value.reason == RejectReason.MALFORMED
    with pytest.raises(CardRejected):
        store.accept(pb.SignedCard(card=garbage, signature=bytes(64)), NOW)
    assert len(store) == 0


def test_sweep_drops_expired_and_floor_blocks_resurrection(key):
    store = CardStore()
    signed = sign_card(make_card(key, sequence=3), key)
    store.accept(signed, NOW)
    assert store.sweep(NOW + 30_000) == []
    peer_id = peer_id_from_public_key(key.public_key)
    assert store.sweep(NOW + 60_000) == [peer_id]
    assert peer_id not in store
    assert store.known_sequence(peer_id) == 3
    with pytest.raises(CardRejected) as info:
        store.accept(sign_card(make_card(key, sequence=3, expires_at_ms=NOW + 120_000), key), NOW + 60_000)
    assert info.value.reason == RejectReason.REPLAYED


def test_a_flood_of_new_identities_fills_the_store_only_to_its_capacity():
    """Identities cost nothing to make: a card flood must not grow memory without bound, and peers
    already held keep updating their cards."""
    store = CardStore(capacity=3)
    keys = [Identity.generate() for _ in range(5)]
    for k in keys[:3]:
        assert store.accept(sign_card(make_card(k), k), NOW)
    with pytest.raises(CardRejected) as info:
        store.accept(sign_card(make_card(keys[3]), keys[3]), NOW)
    assert info.value.reason == RejectReason.FULL and len(store) == 3
    assert store.accept(sign_card(make_card(keys[0], sequence=2), keys[0]), NOW), "a held peer still updates"
    store.remove(peer_id_from_public_key(keys[1].public_key))
    assert store.accept(sign_card(make_card(keys[3]), keys[3]), NOW), "room again once a card went"
    for k in keys:  # floors (of removed cards) are bounded as well
        store.remove(peer_id_from_public_key(k.public_key))
    assert len(store._floor) <= 3
