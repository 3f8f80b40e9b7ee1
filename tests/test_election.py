"""Tracker election on a fake clock with a broadcast network that can kill and partition peers."""

from __future__ import annotations

import heapq
import itertools

import pytest

from meshd.election import (
    BroadcastLease,
    Election,
    ElectionConfig,
    LeaseRejected,
    TrackerChanged,
    sign_lease,
    verify_lease,
)
from meshd.election.lease import CLOCK_SKEW_MS, MAX_LEASE_MS, MAX_TERM
from meshd.identity import Identity
from meshd.wire import card_pb2 as pb

CONFIG = ElectionConfig(lease_duration=3.0, renew_interval=1.0, jitter_step=0.5, max_jitter=1.5)
TICK = 0.1
LATENCY = 0.02


class Cluster:
    def __init__(self, n: int = 5, config: ElectionConfig = CONFIG) -> None:
        self.keys = [Identity.from_seed(bytes([i + 7]) * 32) for i in range(n)]
        self.nodes = {k.peer_id: Election(k.peer_id, True, config, k) for k in self.keys}
        self.ids = sorted(self.nodes)
        self.now = 0.0
        self.dead: set[str] = set()
        self.isolated: set[str] = set()  # one side of a partition; the rest is the other
        self.broadcasts: list[tuple[float, str, pb.SignedLease]] = []
        self.changes: list[tuple[float, str, TrackerChanged]] = []
        self._queue: list[tuple[float, int, str, str, bytes]] = []
        self._counter = itertools.count()

    def perform(self, sender: str, actions) -> None:
        for action in actions:
            if isinstance(action, BroadcastLease):
                self.broadcasts.append((self.now, sender, action.signed))
                for to in self.ids:
                    if to != sender:
                        raw = action.signed.SerializeToString()
                        heapq.heappush(self._queue, (self.now + LATENCY, next(self._counter), sender, to, raw))
            elif isinstance(action, TrackerChanged):
                self.changes.append((self.now, sender, action))

    def reachable(self, a: str, b: str) -> bool:
        return a not in self.dead and b not in self.dead and ((a in self.isolated) == (b in self.isolated))

    def live(self) -> list[str]:
        return [p for p in self.ids if p not in self.dead]

    def run_until(self, until: float, done=None) -> float | None:
        while self.now < until - 1e-9:
            self.now = round(self.now + TICK, 6)
            while self._queue and self._queue[0][0] <= self.now:
                _, _, sender, to, raw = heapq.heappop(self._queue)
                if self.reachable(sender, to):
                    self.perform(to, self.nodes[to].on_lease(raw, self.now))
            for peer_id in self.live():
                # the gossip view lags: a killed peer still counts as alive and eligible
                view = [p for p in self.ids if (p in self.isolated) == (peer_id in self.isolated)]
                self.perform(peer_id, self.nodes[peer_id].tick(self.now, view))
            if done is not None and done():
                return self.now
        return None

    def trackers(self, peers: list[str] | None = None) -> set[str | None]:
        return {self.nodes[p].tracker(self.now) for p in (peers or self.live())}

    def agreed(self, peers: list[str] | None = None) -> str | None:
        seen = self.trackers(peers)
        return next(iter(seen)) if len(seen) == 1 else None


def test_five_peers_elect_exactly_one_tracker():
    cluster = Cluster()
    at = cluster.run_until(5.0, lambda: cluster.agreed() is not None)
    assert at is not None
    cluster.run_until(10.0)
    tracker = cluster.agreed()
    assert tracker == cluster.ids[0]  # rank 0 claims first and nobody else needs to
    claims = {(sender, verify_lease(s).term) for _, sender, s in cluster.broadcasts}
    assert claims == {(tracker, 1)}
    assert all(node.term(cluster.now) == 1 for node in cluster.nodes.values())


def test_killed_tracker_is_replaced_with_higher_term_within_bound():
    cluster = Cluster()
    cluster.run_until(6.0)
    old = cluster.agreed()
    assert old is not None
    # kill it right after a renewal: the worst case, its last lease runs the full duration
    renewed = lambda: any(t == cluster.now and s == old for t, s, _ in cluster.broadcasts)  # noqa: E731
    assert cluster.run_until(10.0, renewed) is not None
    cluster.run_until(cluster.now + TICK)  # let the renewal arrive
    killed_at = cluster.now
    cluster.dead.add(old)
    bound = CONFIG.takeover_bound(TICK, LATENCY)
    at = cluster.run_until(killed_at + bound + 2, lambda: cluster.agreed() not in (None, old))
    assert at is not None
    assert at - killed_at <= bound + 1e-6, f"takeover took {at - killed_at:.2f} s > {bound:.2f} s"
    assert at - killed_at >= CONFIG.lease_duration - TICK  # not before the old lease ran out
    new = cluster.agreed()
    assert all(cluster.nodes[p].term(cluster.now) == 2 for p in cluster.live())
    cluster.run_until(cluster.now + 5)
    assert cluster.agreed() == new


def test_partitioned_old_tracker_yields_on_rejoin():
    cluster = Cluster()
    cluster.run_until(6.0)
    old = cluster.agreed()
    assert old is not None
    cluster.isolated = {old}
    rest = [p for p in cluster.ids if p != old]
    assert cluster.run_until(20.0, lambda: cluster.agreed(rest) not in (None, old)) is not None
    new = cluster.agreed(rest)
    assert cluster.nodes[old].tracker(cluster.now) == old  # alone, it still believes in its own lease
    assert cluster.nodes[old].term(cluster.now) == 1
    cluster.isolated = set()
    assert cluster.run_until(cluster.now + CONFIG.renew_interval + 1, lambda: cluster.agreed() == new) is not None
    assert cluster.nodes[old].term(cluster.now) == 2
    yielded = [c for _, p, c in cluster.changes if p == old and c.old == old]
    assert yielded and yielded[-1].new == new
    before = len(cluster.broadcasts)
    cluster.run_until(cluster.now + 5)
    assert all(sender != old for _, sender, _ in cluster.broadcasts[before:])  # it stopped renewing
    assert cluster.agreed() == new


def test_forged_leases_are_ignored():
    cluster = Cluster()
    cluster.run_until(5.0)
    tracker = cluster.agreed()
    victim = cluster.nodes[cluster.ids[3]]
    now_ms = round(cluster.now * 1000)
    genuine = sign_lease(cluster.keys[0], 99, now_ms, now_ms + 60_000)
    lease = pb.TrackerLease.FromString(genuine.lease)
    # 1. tampered body, original signature
    lease.term = 100
    tampered = pb.SignedLease(lease=lease.SerializeToString(), signature=genuine.signature)
    # 2. a stranger's key claiming to be the tracker's peer id
    stranger = Identity.generate()
    spoof = sign_lease(stranger, 100, now_ms, now_ms + 60_000)
    spoofed_body = pb.TrackerLease.FromString(spoof.lease)
    spoofed_body.peer_id = cluster.ids[4]
    spoof_signed = sign_lease_body(stranger, spoofed_body)
    # 3. garbage
    for forged in (tampered, spoof_signed, b"\x00garbage"):
        assert victim.on_lease(forged, cluster.now) == []
    assert victim.rejected == 3
    assert victim.tracker(cluster.now) == tracker
    assert victim.highest_term == 1


def test_leases_no_peer_could_outbid_or_outlive_are_refused():
    """A term past the bound would leave no room for the next claim (a uint64), a lease of a year
    would name a tracker long dead, and one dated ahead of every clock would stay valid as long."""
    key = Identity.generate()
    observer = Election("observer", False)
    now_ms = 1_800_000_000_000
    refused = [sign_lease(key, MAX_TERM, now_ms, now_ms + 3000), sign_lease(key, 2**64 - 1, now_ms, now_ms + 3000),
               sign_lease(key, 5, now_ms, now_ms + MAX_LEASE_MS + 1)]
    for signed in refused:
        with pytest.raises(LeaseRejected):
            verify_lease(signed)
        assert observer.on_lease(signed, now_ms / 1000) == []
    assert observer.rejected == 3 and observer.highest_term == 0
    ahead = now_ms + CLOCK_SKEW_MS + 365 * 86_400_000
    assert observer.on_lease(sign_lease(key, 7, ahead, ahead + MAX_LEASE_MS), now_ms / 1000) == []
    assert observer.tracker(now_ms / 1000) is None and observer.highest_term == 0 and observer.rejected == 4
    skewed = now_ms + CLOCK_SKEW_MS // 2
    observer.on_lease(sign_lease(key, 6, skewed, skewed + 3000), now_ms / 1000)
    assert observer.tracker(now_ms / 1000) == key.peer_id  # a clock a little ahead is fine


def test_a_peer_claims_nothing_once_no_term_is_left():
    key, rival = Identity.generate(), Identity.generate()
    node = Election(key.peer_id, True, CONFIG, key)
    node.on_lease(sign_lease(rival, MAX_TERM - 1, 0, 3000), 0.0)
    assert node.highest_term == MAX_TERM - 1
    assert [a for t in range(40, 100) for a in node.tick(t * 0.1, [key.peer_id])
            if isinstance(a, BroadcastLease)] == []  # the rival's lease expired; no claim fits, none is made


def sign_lease_body(key: Identity, lease: pb.TrackerLease) -> pb.SignedLease:
    payload = lease.SerializeToString()
    return pb.SignedLease(lease=payload, signature=key.sign(payload))


def test_equal_terms_tie_break_to_lowest_peer_id():
    keys = [Identity.from_seed(bytes([i + 40]) * 32) for i in range(2)]
    low, high = sorted(keys, key=lambda k: k.peer_id)
    observer = Election("observer", False)
    observer.on_lease(sign_lease(high, 4, 0, 5000), 0.0)
    observer.on_lease(sign_lease(low, 4, 0, 5000), 0.0)
    assert observer.tracker(1.0) == low.peer_id
    observer.on_lease(sign_lease(high, 5, 0, 5000), 1.0)
    assert observer.tracker(1.0) == high.peer_id
    assert observer.tracker(5.0) is None  # all expired
    assert observer.highest_term == 5


def test_ineligible_peer_never_claims():
    key = Identity.generate()
    node = Election(key.peer_id, False, CONFIG, key)
    assert [a for t in range(100) for a in node.tick(t * 0.1, [key.peer_id])] == []


def test_config_rejects_renewal_slower_than_lease():
    with pytest.raises(ValueError):
        ElectionConfig(lease_duration=1.0, renew_interval=2.0)


def test_election_over_gossip_survives_tracker_death():
    from meshd.gossip import LeaseReceived, MemberState
    from tests.test_gossip import Network

    net = Network(6)
    keys = {k.peer_id: k for k in (Identity.from_seed(bytes([i + 1]) * 32) for i in range(6))}
    elections = {p: Election(p, True, CONFIG, keys[p]) for p in net.ids}
    plain_perform = net.perform

    def run_election(peer_id: str, actions) -> None:
        for action in actions:
            if isinstance(action, BroadcastLease):
                net.nodes[peer_id].publish_lease(action.signed, net.now)

    def perform(sender: str, actions) -> None:
        for action in actions:
            if isinstance(action, LeaseReceived):
                run_election(sender, elections[sender].on_lease(action.signed, net.now))
        plain_perform(sender, actions)

    def after_tick() -> None:
        for peer_id, election in elections.items():
            if peer_id not in net.silent:
                view = [p for p, s in net.nodes[peer_id].members().items() if s == MemberState.ALIVE]
                run_election(peer_id, election.tick(net.now, view))

    def agreed() -> str | None:
        seen = {elections[p].tracker(net.now) for p in net.ids if p not in net.silent}
        return next(iter(seen)) if len(seen) == 1 else None

    net.perform, net.after_tick = perform, after_tick
    net.join_all_via(0)
    assert net.run_until(30.0, lambda: net.converged() and agreed() is not None) is not None
    old = agreed()
    net.silent.add(old)
    assert net.run_until(net.now + 20.0, lambda: agreed() not in (None, old)) is not None
    assert {elections[p].term(net.now) for p in net.ids if p != old} == {2}
