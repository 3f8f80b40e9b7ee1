"""What a peer's gossip costs as the mesh grows: bucket summaries instead of full digests, card
issues paced by the mesh's size, tracker leases passed on at once."""

from __future__ import annotations

import hashlib
import random

from meshd.daemon.config import PeerConfig
from meshd.gossip import GossipConfig, GossipNode, MemberState, Send
from meshd.gossip import summary as bucket_summary
from meshd.identity import Identity
from meshd.sim.mesh import LinkModel, SimMesh
from meshd.wire import card_pb2 as pb


def _node(i: int, config: GossipConfig | None = None) -> GossipNode:
    identity = Identity.from_seed(hashlib.sha256(f"gossip-bounds {i}".encode()).digest())
    return GossipNode.with_identity(identity, pb.CapabilityCard(addresses=[f"node{i}:7400"]), config,
                                    random.Random(i))


def _exchange(a: GossipNode, b: GossipNode, now: float) -> list[pb.PushPull]:
    """One push-pull from ``a`` to ``b``, every message delivered; the push-pulls that went."""
    sent: list[pb.PushPull] = []
    pending = [(a.self_id, b.self_id, a._push_pull_request())]
    nodes = {a.self_id: a, b.self_id: b}
    while pending:
        sender, to, message = pending.pop(0)
        if message.WhichOneof("body") == "push_pull":
            sent.append(message.push_pull)
        for action in nodes[to].on_message(sender, message, now):
            if isinstance(action, Send) and action.to == sender:
                pending.append((to, sender, action.message))
    return sent


def _entries(p: pb.PushPull) -> int:
    return len(p.digest) + len(p.cards)


def test_summaries_agree_exactly_when_the_views_do_and_a_change_touches_one_bucket():
    cache = bucket_summary.SummaryCache()
    view = [(f"peer{i}", i, 1) for i in range(100)]
    count = bucket_summary.bucket_count_for(len(view))
    assert count == 16 and bucket_summary.bucket_count_for(10**6) == bucket_summary.MAX_BUCKETS
    ours = cache.summarize(view, count)
    assert ours == bucket_summary.SummaryCache().summarize(list(reversed(view)), count)
    changed = [*view[:7], ("peer7", 8, 2), *view[8:]]
    assert len(bucket_summary.differing(ours, cache.summarize(changed, count))) == 1
    assert bucket_summary.decode(bucket_summary.encode(ours)) == ours
    for bad in (b"", b"\0" * 7, b"\0" * 24, b"\0" * 8 * (bucket_summary.MAX_BUCKETS * 2)):
        assert bucket_summary.decode(bad) is None


def _known_to_both(n: int) -> tuple[GossipNode, GossipNode, list[GossipNode]]:
    """Peers 0 and 1 holding the cards of all ``n``; nothing piggybacked, so that only the push-pull
    itself moves cards between them."""
    quiet = GossipConfig(max_piggyback=0)
    nodes = [_node(i, quiet if i < 2 else None) for i in range(n)]
    for node in nodes:
        node.tick(0.0)  # issues its card
    cards = [node.store.get(node.self_id).signed for node in nodes]
    a, b = nodes[0], nodes[1]
    for node in (a, b):
        for card in cards:
            node.on_card(card, 0.1)
    return a, b, nodes


def test_a_push_pull_between_agreeing_peers_carries_a_summary_and_nothing_per_member():
    sizes = {}
    for n in (20, 120):
        a, b, _ = _known_to_both(n)
        sent = _exchange(a, b, 0.2)
        assert len(sent) == 2 and sum(_entries(p) for p in sent) == 1  # the request carries a's own card
        sizes[n] = sum(p.ByteSize() for p in sent)
        assert all(len(p.summary) <= 8 * bucket_summary.MAX_BUCKETS for p in sent)
    assert sizes[120] < 2 * sizes[20] < 4000, sizes


def test_a_push_pull_moves_only_what_one_side_lacks():
    a, b, nodes = _known_to_both(60)
    newcomer = _node(200)
    newcomer.tick(0.0)
    b.on_card(newcomer.store.get(newcomer.self_id).signed, 0.2)  # b alone knows the newcomer
    nodes[5].republish(0.3)
    a.on_card(nodes[5].store.get(nodes[5].self_id).signed, 0.3)  # a alone knows peer 5's new card
    sent = _exchange(a, b, 0.4)
    cards_to_a = [c for p in sent[1::2] for c in p.cards]
    cards_to_b = [c for p in sent[2::2] for c in p.cards]
    assert {bytes(c.card) for c in cards_to_a} == {bytes(newcomer.store.get(newcomer.self_id).signed.card)}
    assert {bytes(c.card) for c in cards_to_b} == {bytes(nodes[5].store.get(nodes[5].self_id).signed.card)}
    assert sum(len(p.digest) for p in sent) <= 40  # the entries of the differing buckets, not 2 x 61
    assert newcomer.self_id in a.live_cards() and b.live_card(nodes[5].self_id).sequence == 2
    assert _exchange(a, b, 0.5)[1].buckets == []  # now they agree


def test_a_malformed_summary_is_answered_as_from_a_peer_that_knows_nobody():
    a, b, _ = _known_to_both(10)
    request = a._push_pull_request()
    request.push_pull.summary = b"\x01" * 9
    request.push_pull.bucket_count = 3
    replies = [x.message.push_pull for x in b.on_message(a.self_id, request, 0.2) if isinstance(x, Send)]
    assert len(replies) == 1 and len(replies[0].cards) == 10  # everything, as to a newcomer
    request.push_pull.bucket_count = 1 << 31
    request.push_pull.buckets.extend([7, 1 << 30])
    assert len([x for x in b.on_message(a.self_id, request, 0.3) if isinstance(x, Send)]) == 1


def test_card_issues_slow_down_as_the_mesh_grows_but_refutations_do_not():
    config = GossipConfig(card_budget=1000.0)
    node = _node(0, config)
    node.tick(0.0)
    size = node.store.get(node.self_id).signed.ByteSize()
    assert node.card_gap() == size / 1000.0
    for i in range(1, 200):
        other = _node(i)
        other.tick(0.0)
        node.on_card(other.store.get(other.self_id).signed, 0.0)
    gap = node.card_gap()
    assert gap == 200 * size / 1000.0 and gap > 20
    sequences = []
    for i in range(6):  # six changes in a row: a few go out at once, the rest wait for the gap
        node.republish(1.0 + i / 10)
        sequences.append(node.store.get(node.self_id).sequence)
    assert sequences == [2, 3, 4, 4, 4, 4]  # the first card and these three: CARD_BURST in a row
    node.tick(1.3 + gap / 2)
    assert node.store.get(node.self_id).sequence == 4
    last = 1.3 + gap
    node.tick(last)
    own = node.store.get(node.self_id)
    assert own.sequence == 5 and own.expires_at_ms - own.card.issued_at_ms >= 2000 * gap
    node.republish(last + 0.2)
    assert node.store.get(node.self_id).sequence == 5  # held back
    suspicion = pb.MemberDigest(peer_id=node.self_id, sequence=5, state=MemberState.SUSPECT.wire)
    node.on_message(_node(1).self_id, pb.GossipMessage(updates=[suspicion]), last + 0.3)
    assert node.store.get(node.self_id).sequence == 6  # refuted at once


def test_cards_of_a_large_mesh_are_refreshed_before_they_run_out():
    mesh = SimMesh(60, LinkModel(), seed=4, config=PeerConfig(card_budget=300))
    assert mesh.run(60.0, mesh.converged) is not None
    mesh.run(1.0)
    gaps = [p.gossip.card_gap() for p in mesh.peers.values()]
    assert min(gaps) > PeerConfig().card_ttl_s  # the pace is the gap's, not the card lifetime's
    mesh.run(3 * max(gaps))
    assert all(p.gossip.store.get(p.peer_id).sequence >= 3 for p in mesh.peers.values())
    assert all(v.new != MemberState.DEAD for v in mesh.verdicts)
    assert mesh.converged()


def test_a_lease_renewal_reaches_every_peer_of_a_large_mesh_within_a_third_of_the_lease():
    mesh = SimMesh(200, LinkModel(), seed=6)
    assert mesh.run(60.0, mesh.converged) is not None
    tracker = next(iter(mesh.trackers()))
    assert tracker is not None
    renewal = mesh.config.lease_duration_s / 3
    mesh.run(0.1)
    latest = mesh.peers[tracker].gossip._leases[tracker].expires_at_ms
    waited = 0.0
    while any(p.gossip._leases.get(tracker) is None or p.gossip._leases[tracker].expires_at_ms < latest
              for p in mesh.peers.values()):
        mesh.step()
        waited += 0.25
        assert waited < renewal, "a renewal took longer than a third of the lease to reach everyone"


def test_a_push_pull_repairs_a_bounded_number_of_differing_buckets():
    a, b, nodes = _known_to_both(300)
    for node in nodes[2:]:
        node.republish(1.0)
        b.on_card(node.store.get(node.self_id).signed, 1.0)  # b holds a newer card of every peer
    sent = _exchange(a, b, 1.5)
    count = sent[0].bucket_count
    assert count == 64 and len(sent[1].buckets) == bucket_summary.MAX_REPAIRED
    assert sum(_entries(p) for p in sent) < 300  # not the whole view's worth
    for _ in range(20):  # a few more exchanges repair the rest
        _exchange(a, b, 2.0)
    assert all(a.live_card(n.self_id).sequence == 2 for n in nodes[2:])
