"""Gossip membership on a simulated network: many nodes, one process, a fake clock."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from meshd.address import Address
from meshd.cards import RejectReason
from meshd.gossip import GossipConfig, GossipNode, MemberChanged, MemberState, Send, dead_everywhere_bound
from meshd.identity import Identity
from meshd.wire import card_pb2 as pb

CONFIG = GossipConfig(probe_interval=0.5, probe_timeout=0.15, indirect_probes=3, suspect_timeout=2.0,
                      pushpull_interval=1.0, fanout=1)
LATENCY = 0.01
STEP = 0.05


class Network:
    """Delivers Send actions after a fixed latency; can drop messages, cut links and silence nodes."""

    def __init__(self, n: int, config: GossipConfig = CONFIG, loss: float = 0.0, seed: int = 1) -> None:
        self.rng = random.Random(seed)
        self.loss = loss
        self.now = 0.0
        self.nodes: dict[str, GossipNode] = {}
        self.by_address: dict[str, str] = {}
        for i in range(n):
            identity = Identity.from_seed(bytes([i + 1]) * 32)
            node = GossipNode.with_identity(identity, pb.CapabilityCard(addresses=[f"node{i}:7400"]), config,
                                       random.Random(seed * 1000 + i))
            self.nodes[node.self_id] = node
            self.by_address[f"node{i}:7400"] = node.self_id
        self.ids = list(self.nodes)
        self.silent: set[str] = set()
        self.cut: set[frozenset[str]] = set()
        self.events: list[tuple[float, str, MemberChanged]] = []
        self._queue: list[tuple[float, int, str, str, bytes]] = []
        self._counter = itertools.count()
        self.after_tick = None  # optional hook run once per step, after every node ticked

    def perform(self, sender: str, actions) -> None:
        for action in actions:
            if isinstance(action, Send):
                to = self.by_address[str(action.to)] if isinstance(action.to, Address) else action.to
                raw = action.message.SerializeToString()
                heapq.heappush(self._queue, (self.now + LATENCY, next(self._counter), sender, to, raw))
            elif isinstance(action, MemberChanged):
                self.events.append((self.now, sender, action))

    def dropped(self, sender: str, to: str) -> bool:
        if sender in self.silent or to in self.silent or frozenset((sender, to)) in self.cut:
            return True
        return self.loss > 0 and self.rng.random() < self.loss

    def run_until(self, until: float, done=None) -> float | None:
        """Advance the clock; return the time ``done()`` first held, if given."""
        while self.now < until:
            self.now = round(self.now + STEP, 6)
            while self._queue and self._queue[0][0] <= self.now:
                _, _, sender, to, raw = heapq.heappop(self._queue)
                if not self.dropped(sender, to):
                    self.perform(to, self.nodes[to].on_message(sender, pb.GossipMessage.FromString(raw), self.now))
            for peer_id, node in self.nodes.items():
                if peer_id not in self.silent:
                    self.perform(peer_id, node.tick(self.now))
            if self.after_tick is not None:
                self.after_tick()
            if done is not None and done():
                return self.now
        return None

    def join_all_via(self, seed_index: int = 0) -> None:
        for node in self.nodes.values():
            if node.self_id != self.ids[seed_index]:
                node.add_seed(f"node{seed_index}:7400")

    def converged(self, live: list[str] | None = None) -> bool:
        live = live or self.ids
        for peer_id in live:
            view = self.nodes[peer_id].members()
            if any(view.get(other) != MemberState.ALIVE for other in live if other != peer_id):
                return False
        return True

    def all_see(self, target: str, state: MemberState) -> bool:
        watchers = [p for p in self.ids if p != target and p not in self.silent]
        return all(self.nodes[p].members().get(target) == state for p in watchers)


def test_fifty_nodes_converge_to_full_membership_through_one_seed():
    net = Network(50)
    net.join_all_via(0)
    at = net.run_until(30.0, net.converged)
    assert at is not None, "no convergence in 30 s"
    for node in net.nodes.values():
        assert len(node.live_cards()) == 50
    # and it stays converged: no false suspicions on a lossless network
    net.run_until(at + 10.0)
    assert net.converged()
    assert not [e for e in net.events if e[2].new != MemberState.ALIVE]


def test_converges_with_message_loss():
    net = Network(20, loss=0.1, seed=3)
    net.join_all_via(0)
    assert net.run_until(40.0, net.converged) is not None


def test_silent_node_becomes_suspect_then_dead_everywhere_within_bound():
    net = Network(20)
    net.join_all_via(0)
    start = net.run_until(30.0, net.converged)
    assert start is not None
    victim = net.ids[7]
    net.silent.add(victim)
    bound = dead_everywhere_bound(CONFIG, len(net.ids))
    at = net.run_until(start + bound + 1, lambda: net.all_see(victim, MemberState.DEAD))
    assert at is not None, f"victim not DEAD everywhere within {bound:.1f} s"
    assert at - start <= bound
    transitions = [(e.old, e.new) for _, _, e in net.events if e.peer_id == victim]
    assert (MemberState.ALIVE, MemberState.SUSPECT) in transitions
    for peer_id in net.ids:
        if peer_id != victim:
            assert victim not in net.nodes[peer_id].live_cards()
    # nobody else was harmed
    others = [p for p in net.ids if p != victim]
    assert all(net.nodes[p].members()[q] == MemberState.ALIVE for p in others for q in others if p != q)


def test_indirect_probes_prevent_false_suspicion_over_one_broken_link():
    net = Network(10)
    net.join_all_via(0)
    start = net.run_until(20.0, net.converged)
    assert start is not None
    a, b = net.ids[2], net.ids[5]
    net.cut.add(frozenset((a, b)))
    net.run_until(start + 30.0)
    suspicions = [e for _, _, e in net.events if e.new != MemberState.ALIVE]
    assert suspicions == []
    assert net.converged()


def test_without_indirect_probes_a_broken_link_causes_suspicion():
    """The control for the test above: the same cut with k = 0 does raise a suspicion."""
    config = GossipConfig(probe_interval=0.5, probe_timeout=0.15, indirect_probes=0, suspect_timeout=2.0,
                          pushpull_interval=1.0)
    net = Network(10, config=config)
    net.join_all_via(0)
    start = net.run_until(20.0, net.converged)
    assert start is not None
    net.cut.add(frozenset((net.ids[2], net.ids[5])))
    net.run_until(start + 30.0)
    assert any(e.new == MemberState.SUSPECT for _, _, e in net.events)
    # the suspected peer refutes with a newer card, so the cut never escalates to DEAD
    assert not any(e.new == MemberState.DEAD for _, _, e in net.events)


def test_leave_is_seen_as_left_everywhere():
    net = Network(15)
    net.join_all_via(0)
    start = net.run_until(20.0, net.converged)
    assert start is not None
    leaver = net.ids[4]
    net.perform(leaver, net.nodes[leaver].leave(net.now))
    at = net.run_until(start + 10.0, lambda: net.all_see(leaver, MemberState.LEFT))
    assert at is not None
    assert not any(e.new == MemberState.DEAD for _, _, e in net.events if e.peer_id == leaver)
    assert all(leaver not in net.nodes[p].live_cards() for p in net.ids if p != leaver)


def test_restarted_dead_peer_rejoins_with_newer_card():
    net = Network(8)
    net.join_all_via(0)
    start = net.run_until(20.0, net.converged)
    victim = net.ids[3]
    net.silent.add(victim)
    assert net.run_until(start + 30.0, lambda: net.all_see(victim, MemberState.DEAD)) is not None
    net.silent.discard(victim)
    # the victim hears it is dead, signs a newer card, and everyone takes it back
    assert net.run_until(net.now + 20.0, net.converged) is not None


def test_forged_card_does_not_enter_membership():
    net = Network(3)
    net.join_all_via(0)
    net.run_until(10.0, net.converged)
    a, b = net.ids[0], net.ids[1]
    honest = net.nodes[b].store.get(b)
    forged = pb.CapabilityCard.FromString(honest.signed.card)
    forged.sequence += 100
    bad = pb.SignedCard(card=forged.SerializeToString(), signature=honest.signed.signature)
    message = pb.GossipMessage(cards=[bad])
    net.nodes[a].on_message(net.ids[2], message, net.now)
    assert net.nodes[a].store.get(b).sequence == honest.sequence
    assert net.nodes[a].rejected_cards[RejectReason.BAD_SIGNATURE] == 1


def test_own_card_echoes_do_not_make_a_node_reissue():
    net = Network(5)
    net.join_all_via(0)
    at = net.run_until(20.0, net.converged)
    assert at is not None
    sequences = {p: n.issuer.sequence for p, n in net.nodes.items()}
    net.run_until(at + 10.0)
    # cards live 10 minutes by default: ten quiet seconds of gossip must not re-sign any of them
    assert {p: n.issuer.sequence for p, n in net.nodes.items()} == sequences


def test_a_lease_seen_before_is_not_checked_again_but_a_forged_copy_is(monkeypatch):
    import meshd.gossip.node as node_module
    from meshd.election import sign_lease, verify_lease

    checks = []

    def counting(signed):
        checks.append(signed)
        return verify_lease(signed)

    monkeypatch.setattr(node_module, "verify_lease", counting)
    net = Network(2)
    a = net.nodes[net.ids[0]]
    genuine = sign_lease(Identity.from_seed(bytes([9]) * 32), 3, 0, 60_000)
    for _ in range(5):
        a.on_message(net.ids[1], pb.GossipMessage(leases=[genuine]), 1.0)
    assert len(checks) == 1 and [s.signature for s in a.leases()] == [genuine.signature]
    # the same signature over other terms is checked again, and refused
    body = pb.TrackerLease.FromString(genuine.lease)
    body.term = 7
    forged = pb.SignedLease(lease=body.SerializeToString(), signature=genuine.signature)
    a.on_message(net.ids[1], pb.GossipMessage(leases=[forged]), 1.0)
    assert len(checks) == 2
    assert [pb.TrackerLease.FromString(s.lease).term for s in a.leases()] == [3]


def test_a_card_with_a_bad_address_does_not_crash_peers_that_declare_it_dead():
    net = Network(6)
    net.join_all_via(0)
    start = net.run_until(20.0, net.converged)
    assert start is not None
    liar = net.nodes[net.ids[4]]
    liar.issuer.template = pb.CapabilityCard(addresses=["not an address"])
    liar.republish(net.now)
    net.run_until(start + 3.0)
    net.silent.add(net.ids[4])
    at = net.run_until(start + 40.0, lambda: net.all_see(net.ids[4], MemberState.DEAD))
    assert at is not None
    net.run_until(at + 10.0)  # reconnect attempts come every few seconds: none may raise
    assert net.converged([p for p in net.ids if p != net.ids[4]])


def test_a_claim_about_our_sequence_beyond_what_a_card_carries_is_ignored():
    net = Network(3)
    net.join_all_via(0)
    assert net.run_until(20.0, net.converged) is not None
    node = net.nodes[net.ids[1]]
    before = node.issuer.sequence
    msg = pb.GossipMessage(ping=pb.Ping(seq=1, from_peer=net.ids[0]),
                           updates=[pb.MemberDigest(peer_id=net.ids[1], sequence=2**64 - 1, state=pb.SUSPECT)])
    node.on_message(net.ids[0], msg, net.now)
    node.republish(net.now + 1)  # would raise if the sequence had been pushed past a uint64
    assert node.issuer.sequence <= before + 2


@pytest.mark.parametrize("state", [pb.DEAD, pb.SUSPECT, pb.LEFT])
def test_a_claim_about_another_peer_beyond_what_it_could_refute_is_ignored(state):
    """An unsigned claim that a peer is gone, at a sequence past what its cards may reach, would set a
    replay floor no card of that peer could beat: it would be shut out for good."""
    net = Network(4)
    net.join_all_via(0)
    assert net.run_until(20.0, net.converged) is not None
    forger, victim, hearer = net.ids[3], net.ids[1], net.ids[2]
    msg = pb.GossipMessage(ping=pb.Ping(seq=1, from_peer=forger),
                           updates=[pb.MemberDigest(peer_id=victim, sequence=2**63, state=state)])
    net.perform(hearer, net.nodes[hearer].on_message(forger, msg, net.now))
    assert net.nodes[hearer].members()[victim] == MemberState.ALIVE
    assert net.nodes[hearer].store.known_sequence(victim) < 2**62
    net.silent.add(forger)
    net.run_until(net.now + 120.0)
    for pid in (net.ids[0], hearer):
        assert net.nodes[pid].members().get(victim) == MemberState.ALIVE


def test_a_claim_just_below_the_bound_is_refuted():
    net = Network(4)
    net.join_all_via(0)
    assert net.run_until(20.0, net.converged) is not None
    forger, victim, hearer = net.ids[3], net.ids[1], net.ids[2]
    msg = pb.GossipMessage(ping=pb.Ping(seq=1, from_peer=forger),
                           updates=[pb.MemberDigest(peer_id=victim, sequence=2**62 - 1, state=pb.DEAD)])
    net.perform(hearer, net.nodes[hearer].on_message(forger, msg, net.now))
    assert net.nodes[hearer].members()[victim] == MemberState.DEAD
    net.silent.add(forger)
    assert net.run_until(net.now + 60.0, lambda: all(
        net.nodes[p].members().get(victim) == MemberState.ALIVE for p in (net.ids[0], hearer))) is not None
    assert net.nodes[victim].issuer.sequence >= 2**62


def test_dead_claims_about_made_up_peers_are_bounded():
    net = Network(3)
    net.join_all_via(0)
    assert net.run_until(20.0, net.converged) is not None
    node = net.nodes[net.ids[1]]
    node.store.capacity = 50
    fake = [pb.MemberDigest(peer_id=f"made-up-{i}", sequence=1, state=pb.DEAD) for i in range(500)]
    node.on_message(net.ids[0], pb.GossipMessage(ping=pb.Ping(seq=1, from_peer=net.ids[0]), updates=fake), net.now)
    assert len(node.members()) <= 50
    net.run_until(net.now + 5.0)
    assert net.converged()


def test_a_peer_that_restarted_and_forgot_its_sequence_is_told_its_floor_and_comes_back():
    from meshd.address import Address
    from meshd.gossip import GossipConfig, GossipNode, MemberState, Send
    from meshd.identity import Identity
    from meshd.wire import card_pb2 as cpb

    a_id, b_id = Identity.from_seed(b"\x01" * 32), Identity.from_seed(b"\x02" * 32)
    template = cpb.CapabilityCard(addresses=["10.0.0.2:7700"])
    a = GossipNode.with_identity(a_id, cpb.CapabilityCard(addresses=["10.0.0.1:7700"]), GossipConfig())
    b = GossipNode.with_identity(b_id, template, GossipConfig())
    now = 1_800_000_000.0
    for _ in range(3):
        b.republish(now)
    a.on_message(b_id.peer_id, b._push_pull_request(), now)
    assert b.issuer is not None
    a.on_message(b_id.peer_id, cpb.GossipMessage(leave=cpb.Leave(from_peer=b_id.peer_id, sequence=b.issuer.sequence)),
                 now)
    assert a.members()[b_id.peer_id] == MemberState.LEFT
    restarted = GossipNode.with_identity(b_id, template, GossipConfig())  # its sequence starts again
    restarted.republish(now + 1)
    actions = a.on_message(b_id.peer_id, restarted._push_pull_request(), now + 1)
    told = [x for x in actions if isinstance(x, Send) and x.to == Address.coerce("10.0.0.2:7700")]
    assert len(told) == 1 and told[0].message.updates[0].peer_id == b_id.peer_id
    restarted.on_message(a_id.peer_id, told[0].message, now + 1)
    a.on_message(b_id.peer_id, restarted._push_pull_request(), now + 1.5)
    assert a.members()[b_id.peer_id] == MemberState.ALIVE and b_id.peer_id in a.live_cards()


def _count_pings(net: Network) -> list[tuple[float, str, str]]:
    """Record every ping the nodes send from now on, as (time, sender, target)."""
    pings: list[tuple[float, str, str]] = []
    perform = net.perform

    def recording(sender: str, actions) -> None:
        actions = list(actions)
        for action in actions:
            if isinstance(action, Send) and action.message.WhichOneof("body") == "ping":
                pings.append((net.now, sender, str(action.to)))
        perform(sender, actions)

    net.perform = recording  # type: ignore[method-assign]
    return pings


def test_a_member_heard_from_is_not_pinged_until_it_goes_quiet_and_then_dies_within_the_bound():
    net = Network(3)
    net.join_all_via(0)
    start = net.run_until(20.0, net.converged)
    assert start is not None
    a, b, c = net.ids
    pings = _count_pings(net)
    net.run_until(start + 10.0)
    baseline = sum(1 for _, sender, to in pings if sender == a and to == b)
    assert baseline >= 5  # the control: without other traffic a pings b every few slots

    pings.clear()
    net.after_tick = lambda: net.nodes[a].heard_from(b, net.now)  # b's traffic seen by a's host
    quiet_from = net.run_until(start + 20.0) or net.now
    assert [p for p in pings if p[1] == a and p[2] == b] == []
    assert sum(1 for _, sender, to in pings if sender == a and to == c) >= 5  # c is still probed

    net.after_tick = None
    net.silent.add(b)
    bound = dead_everywhere_bound(CONFIG, len(net.ids))
    at = net.run_until(quiet_from + bound + 1, lambda: net.all_see(b, MemberState.DEAD))
    assert at is not None and at - quiet_from <= bound
    first_ping = min(t for t, sender, to in pings if sender == a and to == b)
    assert first_ping - quiet_from <= 2 * CONFIG.probe_interval + STEP


def test_a_member_that_joins_while_the_others_are_heard_from_is_still_probed():
    net = Network(3)
    a, b, c = net.ids
    net.silent.add(c)
    net.nodes[b].add_seed("node0:7400")
    start = net.run_until(20.0, lambda: net.converged([a, b]))
    assert start is not None
    net.after_tick = lambda: net.nodes[a].heard_from(b, net.now)
    net.run_until(start + 3.0)  # a's round now holds only b, passed over every slot
    pings = _count_pings(net)
    net.silent.discard(c)
    net.nodes[c].add_seed("node0:7400")
    joined = net.run_until(start + 20.0, net.converged)
    assert joined is not None
    net.run_until(joined + 5.0)
    assert any(sender == a and to == c for _, sender, to in pings)
    assert not any(sender == a and to == b for _, sender, to in pings)
