"""Private meshes: invite tokens, membership credentials, revocations, what is kept on disk, and the
gate that cards, streams and requests pass through."""

from __future__ import annotations

import base64
import os
import time

import pytest

from meshd.admission import InviteRefused, Membership, MeshGate, NotAdmitter, NotMember, invite_token, parse_token
from meshd.admission.gate import MEMBERSHIP_HEADER
from meshd.admission.records import check_invite, sign_invite, sign_membership, sign_revocation
from meshd.cards.card import CardIssuer, CardRejected, CardStore, RejectReason
from meshd.election import sign_lease, verify_lease
from meshd.gossip import GossipConfig, GossipNode, Send
from meshd.gossip.node import LEASES_KEPT, LEASES_SENT
from meshd.identity import Identity
from meshd.wire import admission_pb2 as apb
from meshd.wire import card_pb2 as cpb


def ms() -> int:
    return int(time.time() * 1000)


def ident(n: int) -> Identity:
    return Identity.from_seed(bytes([n]) * 32)


MESH_KEY = ident(200)


def founder(tmp_path) -> Membership:
    return Membership.load(tmp_path / "founder", ident(1), open_mesh=False, founding=True)


# -- records ---------------------------------------------------------------------------------------


def test_a_token_round_trips_and_any_change_to_it_is_refused():
    signed = sign_invite(MESH_KEY, os.urandom(16), ms(), ms() + 60_000, 2, ["127.0.0.1:7700"])
    token = invite_token(signed)
    assert token.startswith("meshd-invite-") and "=" not in token
    got, invite = parse_token(token)
    assert got == signed and invite.uses == 2 and list(invite.addresses) == ["127.0.0.1:7700"]
    raw = bytearray(base64.urlsafe_b64decode(token.removeprefix("meshd-invite-") + "=="))
    raw[-70] ^= 1  # a bit of the invite (its uses, its addresses ...)
    tampered = "meshd-invite-" + base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    for bad in (tampered, "meshd-invite-%%%", "hello", "meshd-invite-" + "A" * 5000, ""):
        with pytest.raises(InviteRefused):
            parse_token(bad)


def test_an_invite_is_checked_against_the_meshs_own_key_and_its_expiry():
    now = ms()
    ours = sign_invite(MESH_KEY, os.urandom(16), now, now + 60_000, 1, ["127.0.0.1:1"])
    check_invite(ours, MESH_KEY.public_key, now)
    other = sign_invite(ident(201), os.urandom(16), now, now + 60_000, 1, ["127.0.0.1:1"])
    with pytest.raises(InviteRefused, match="is for mesh"):
        check_invite(other, MESH_KEY.public_key, now)
    forged = apb.SignedInvite(invite=other.invite.replace(ident(201).public_key, MESH_KEY.public_key),
                              signature=other.signature)
    with pytest.raises(InviteRefused, match="not signed"):
        check_invite(forged, MESH_KEY.public_key, now)
    with pytest.raises(InviteRefused, match="expired"):
        check_invite(ours, MESH_KEY.public_key, now + 60_000)


# -- the gate --------------------------------------------------------------------------------------


def member_card(identity: Identity, membership: apb.SignedMembership | None, sequence: int = 1) -> cpb.SignedCard:
    issuer = CardIssuer(identity, cpb.CapabilityCard(membership=membership), sequence=sequence - 1)
    return issuer.issue(ms())


def test_cards_enter_only_with_a_credential_for_their_own_peer_and_not_after_a_revocation():
    gate = MeshGate(MESH_KEY.public_key, ident(1).peer_id)
    store = CardStore(admit=gate.check_card)
    alice, bob = ident(2), ident(3)
    with pytest.raises(CardRejected) as refused:
        store.accept(member_card(alice, None), ms())
    assert refused.value.reason == RejectReason.NOT_MEMBER
    with pytest.raises(CardRejected) as borrowed:  # bob's credential on alice's card
        store.accept(member_card(alice, sign_membership(MESH_KEY, bob.peer_id, ms())), ms())
    assert borrowed.value.reason == RejectReason.NOT_MEMBER
    with pytest.raises(CardRejected):  # a credential from another mesh's key
        store.accept(member_card(alice, sign_membership(ident(201), alice.peer_id, ms())), ms())
    assert len(store) == 0 and not gate.admits(alice.peer_id)
    assert store.accept(member_card(alice, sign_membership(MESH_KEY, alice.peer_id, ms())), ms())
    assert gate.admits(alice.peer_id)
    assert gate.revoke(sign_revocation(ident(201), alice.peer_id, ms())) is None  # not the mesh's key
    assert gate.revoke(sign_revocation(MESH_KEY, alice.peer_id, ms(), "lost laptop")) == alice.peer_id
    assert gate.revoke(sign_revocation(MESH_KEY, alice.peer_id, ms())) is None  # known already
    assert not gate.admits(alice.peer_id)
    with pytest.raises(CardRejected) as revoked:
        store.accept(member_card(alice, sign_membership(MESH_KEY, alice.peer_id, ms()), sequence=2), ms())
    assert revoked.value.reason == RejectReason.REVOKED


def test_a_stream_shows_its_credential_in_a_header():
    gate = MeshGate(MESH_KEY.public_key, ident(1).peer_id)
    alice = ident(2)
    header = MeshGate(b"", alice.peer_id, own=sign_membership(MESH_KEY, alice.peer_id, ms())).header()
    assert not gate.admit_stream(alice.peer_id, None)
    assert not gate.admit_stream(alice.peer_id, "not base64 !")
    assert not gate.admit_stream(ident(3).peer_id, header[MEMBERSHIP_HEADER])  # alice's credential, bob's stream
    with pytest.raises(NotMember, match="has shown no membership"):
        gate.require(alice.peer_id, "route")
    assert gate.refused == {"route": 1}
    assert gate.admit_stream(alice.peer_id, header[MEMBERSHIP_HEADER])
    gate.require(alice.peer_id, "route")
    gate.revoke(sign_revocation(MESH_KEY, alice.peer_id, ms()))
    assert not gate.admit_stream(alice.peer_id, header[MEMBERSHIP_HEADER])
    with pytest.raises(NotMember, match="was revoked"):
        gate.require(alice.peer_id, "route")


def test_a_revocation_spreads_by_push_pull_and_drops_the_peer_everywhere():
    alice, bob, carol = ident(2), ident(3), ident(4)
    nodes = {}
    for who in (alice, bob, carol):
        node = GossipNode.with_identity(who, cpb.CapabilityCard(membership=sign_membership(MESH_KEY, who.peer_id,
                                                                                            ms())),
                                        config=GossipConfig())
        node.admit_with(MeshGate(MESH_KEY.public_key, who.peer_id))
        node.republish(time.time())
        nodes[who.peer_id] = node
    a, b, c = (nodes[x.peer_id] for x in (alice, bob, carol))
    now = time.time()
    for sender, receiver in ((b, a), (c, a), (a, c)):
        receiver.on_card(sender.store.get(sender.self_id).signed, now)
    assert bob.peer_id in a.live_cards() and bob.peer_id not in c.live_cards()
    a.revoke(sign_revocation(MESH_KEY, bob.peer_id, int(now * 1000)), now)
    assert bob.peer_id not in a.live_cards()
    request = a._push_pull_request()
    assert not request.push_pull.revocations  # the request carries their hash; c's differs, so
    replies = [x.message for x in c.on_message(alice.peer_id, request, now) if isinstance(x, Send)]
    finish = [x.message for x in a.on_message(carol.peer_id, replies[0], now) if isinstance(x, Send)]
    assert [len(m.push_pull.revocations) for m in finish] == [1]  # a sends its own once it knows
    c.on_message(alice.peer_id, finish[0], now)
    assert c.gate is not None and c.gate.is_revoked(bob.peer_id)
    agreed = [x.message for x in c.on_message(alice.peer_id, a._push_pull_request(), now) if isinstance(x, Send)]
    assert not agreed[0].push_pull.revocations  # now they agree: nothing more moves
    c.on_card(b.store.get(b.self_id).signed, now)  # bob's card, still circulating: refused
    assert bob.peer_id not in c.live_cards()
    assert c.rejected_cards[RejectReason.REVOKED] == 1


def test_a_private_mesh_takes_tracker_leases_from_members_only_and_keeps_a_few():
    alice, bob = ident(2), ident(3)
    node = GossipNode.with_identity(alice, cpb.CapabilityCard(membership=sign_membership(MESH_KEY, alice.peer_id,
                                                                                        ms())), config=GossipConfig())
    node.admit_with(MeshGate(MESH_KEY.public_key, alice.peer_id))
    now = time.time()
    now_ms = int(now * 1000)
    stranger = Identity.generate()
    node.on_message(bob.peer_id, cpb.GossipMessage(leases=[sign_lease(stranger, 9, now_ms, now_ms + 3000)]), now)
    assert node.leases() == []  # not a member: it cannot be tracker here
    bobs = GossipNode.with_identity(bob, cpb.CapabilityCard(membership=sign_membership(MESH_KEY, bob.peer_id, ms())),
                                    config=GossipConfig())
    bobs.republish(now)
    node.on_card(bobs.store.get(bob.peer_id).signed, now)
    node.on_message(bob.peer_id, cpb.GossipMessage(leases=[sign_lease(bob, 9, now_ms, now_ms + 3000)]), now)
    assert [verify_lease(s).peer_id for s in node.leases()] == [bob.peer_id]


def test_tracker_leases_of_throwaway_identities_do_not_grow_a_peer_or_its_messages():
    alice = ident(2)
    node = GossipNode.with_identity(alice, cpb.CapabilityCard(), config=GossipConfig())  # an open mesh
    now = time.time()
    now_ms = int(now * 1000)
    many = [sign_lease(Identity.generate(), 1 + i % 50, now_ms, now_ms + 3000) for i in range(300)]
    node.on_message(ident(3).peer_id, cpb.GossipMessage(leases=many), now)
    assert len(node._leases) == LEASES_KEPT
    best = max(verify_lease(s).term for s in many)
    sent = node._push_pull_request().push_pull.leases
    assert len(sent) == LEASES_SENT and verify_lease(sent[0]).term == best


# -- this peer's membership on disk ----------------------------------------------------------------


def test_a_peer_without_bootstrap_founds_a_private_mesh_and_keeps_it(tmp_path):
    first = founder(tmp_path)
    assert first.key is not None and first.gate is not None and first.gate.own is not None
    key_file = tmp_path / "founder" / "admission.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    again = Membership.load(tmp_path / "founder", ident(1), open_mesh=False, founding=True)
    assert again.mesh == first.mesh and again.key is not None
    key = first.gate.mesh_key.hex()  # type: ignore[union-attr]
    assert again.describe() == {"mesh": first.mesh, "mesh_key": key, "private": True, "admits": True, "member": True,
                                "revoked_peers": 0, "refused": {}}


def test_a_peer_with_bootstrap_but_no_membership_is_told_how_to_join(tmp_path):
    with pytest.raises(NotMember, match="meshd join TOKEN"):
        Membership.load(tmp_path / "lost", ident(5), open_mesh=False, founding=False)
    assert Membership.load(tmp_path / "open", ident(5), open_mesh=True).gate is None


def test_invites_are_used_up_even_across_restarts_and_revoked_peers_cannot_redeem(tmp_path):
    first = founder(tmp_path)
    token, _ = first.issue_invite(60, 2, ["127.0.0.1:7700"])
    request = apb.JoinRequest(invite=parse_token(token)[0])
    alice, bob, carol = ident(2), ident(3), ident(4)
    reply = first.redeem(alice.peer_id, request)
    assert first.gate is not None and first.gate.admits(alice.peer_id)
    first.redeem(alice.peer_id, request)  # the same peer again: its membership again, not another use
    restarted = Membership.load(tmp_path / "founder", ident(1), open_mesh=False, founding=True)
    restarted.redeem(bob.peer_id, request)
    with pytest.raises(InviteRefused, match="used up"):
        restarted.redeem(carol.peer_id, request)
    revocation = restarted.revoke(alice.peer_id, "left the team")
    assert restarted.gate is not None and restarted.gate.revoke(revocation) == alice.peer_id
    token2, _ = restarted.issue_invite(60, 5, ["127.0.0.1:7700"])
    with pytest.raises(InviteRefused, match="revoked"):
        restarted.redeem(alice.peer_id, apb.JoinRequest(invite=parse_token(token2)[0]))
    again = Membership.load(tmp_path / "founder", ident(1), open_mesh=False, founding=True)
    assert again.gate is not None and again.gate.is_revoked(alice.peer_id)  # revocations are kept
    assert reply.membership.membership


def test_only_the_holder_of_the_admission_key_admits(tmp_path):
    first = founder(tmp_path)
    token, _ = first.issue_invite(60, 1, ["127.0.0.1:7700"])
    joiner = Membership.load(tmp_path / "joiner", ident(2), open_mesh=False, invite=token)
    assert joiner.pending is not None and joiner.addresses == ["127.0.0.1:7700"]
    assert joiner.gate is not None and joiner.gate.mesh_key == first.gate.mesh_key  # type: ignore[union-attr]
    with pytest.raises(NotAdmitter):
        joiner.issue_invite(60, 1, ["127.0.0.1:7701"])
    with pytest.raises(NotAdmitter):
        joiner.redeem(ident(3).peer_id, apb.JoinRequest(invite=parse_token(token)[0]))
    with pytest.raises(ValueError):
        first.issue_invite(0, 1, ["127.0.0.1:7700"])
    with pytest.raises(ValueError):
        first.issue_invite(60, 0, ["127.0.0.1:7700"])
    expired = invite_token(sign_invite(first.key, os.urandom(16), ms() - 10_000, ms() - 1, 1,  # type: ignore[arg-type]
                                       ["127.0.0.1:7700"]))
    with pytest.raises(InviteRefused, match="expired"):
        Membership.load(tmp_path / "late", ident(4), open_mesh=False, invite=expired)
    with pytest.raises(InviteRefused, match="expired"):
        first.redeem(ident(4).peer_id, apb.JoinRequest(invite=parse_token(expired)[0]))
