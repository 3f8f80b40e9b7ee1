"""Tracker election by lease and term, as a sans-IO state machine.

Every peer keeps the leases it has heard (they arrive by gossip). The tracker is the holder of the
best *valid* lease: unexpired and well signed, highest term first, lowest peer id on equal terms.
Leases with a bad signature are dropped before they can count, so a forger cannot raise the term.

When no valid lease is known, an eligible peer waits ``candidacy_delay`` — its rank (by peer id)
among the alive eligible peers, excluding the last known holder, times ``jitter_step``, capped at
``max_jitter`` — and then claims ``term = highest term seen + 1``. The wait is deterministic per
peer, so one peer normally claims alone; if two claim anyway, the equal-term tie-break settles it
without another round. The holder renews every ``renew_interval`` with the same term.

Takeover bound. A holder that dies renewed at most ``renew_interval`` earlier, so every lease it
issued expires by ``death + lease_duration``. From then on each eligible survivor sees a vacancy at
its next tick, and the first-ranked live candidate claims after at most ``max_jitter``. Hence a new
tracker with a higher term is known everywhere within::

    lease_duration + max_jitter + tick period + one gossip delivery (+ clock skew between peers)

This does not depend on the failure detector: an undetected dead candidate only shifts ranks,
and the cap bounds that. Lease times are absolute milliseconds, so peers need loosely synced clocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshd.election.lease import MAX_TERM, Lease, LeaseRejected, sign_lease, verify_lease
from meshd.identity import Identity
from meshd.wire import card_pb2 as pb


@dataclass(frozen=True)
class ElectionConfig:
    lease_duration: float = 10.0   # seconds a lease stays valid after it is issued
    renew_interval: float = 3.0    # the holder re-issues this often; several renewals fit in one lease
    jitter_step: float = 1.0       # extra wait per rank position before claiming a vacancy
    max_jitter: float = 4.0        # cap on that wait

    def __post_init__(self) -> None:
        if not 0 < self.renew_interval < self.lease_duration:
            raise ValueError("renew_interval must be positive and shorter than lease_duration")
        if self.jitter_step < 0 or self.max_jitter < 0:
            raise ValueError("jitter must not be negative")

    def takeover_bound(self, tick_period: float, delivery: float) -> float:
        """Worst case from the holder's death to a new tracker known everywhere (same clock)."""
        return self.lease_duration + self.max_jitter + tick_period + delivery


@dataclass(frozen=True)
class BroadcastLease:
    """Gossip this lease to every peer."""

    signed: pb.SignedLease


@dataclass(frozen=True)
class TrackerChanged:
    old: str | None
    new: str | None
    term: int


Action = BroadcastLease | TrackerChanged


def _ms(now: float) -> int:
    return round(now * 1000)


class Election:
    def __init__(self, self_id: str, eligible: bool, config: ElectionConfig | None = None,
                 identity: Identity | None = None) -> None:
        if eligible and identity is None:
            raise ValueError("an eligible peer needs its identity to sign leases")
        if identity is not None and identity.peer_id != self_id:
            raise ValueError("identity does not belong to self_id")
        self.self_id = self_id
        self.eligible = eligible
        self.config = config or ElectionConfig()
        self._identity = identity
        self._leases: dict[str, Lease] = {}
        self.highest_term = 0
        self.rejected = 0
        self._vacant_since: float | None = None
        self._last_holder: str | None = None
        self._last_issued: float | None = None
        self._reported: str | None = None

    # -- inputs -------------------------------------------------------------------------------

    def on_lease(self, signed: pb.SignedLease | bytes, now: float) -> list[Action]:
        """Take a lease heard from gossip; forged or malformed ones are counted and ignored."""
        try:
            lease = verify_lease(signed)
        except LeaseRejected:
            self.rejected += 1
            return []
        if lease.dated_ahead(_ms(now)):  # its term is no claim either, until its time comes
            self.rejected += 1
            return []
        self._remember(lease)
        return self._report(now)

    def tick(self, now: float, alive_eligible_peers: Iterable[str]) -> list[Action]:
        actions: list[Action] = []
        current = self.current_lease(now)
        if current is None:
            if self.eligible:
                if self._vacant_since is None:
                    self._vacant_since = now
                if (now >= self._vacant_since + self.candidacy_delay(alive_eligible_peers)
                        and self.highest_term + 1 < MAX_TERM):  # past it no claim fits: entries route on their own
                    actions.append(self._issue(self.highest_term + 1, now))
        else:
            self._vacant_since = None
            self._last_holder = current.peer_id
            if (current.peer_id == self.self_id and self._last_issued is not None
                    and now >= self._last_issued + self.config.renew_interval):
                actions.append(self._issue(current.term, now))
        self._prune(now)
        actions.extend(self._report(now))
        return actions

    # -- queries ------------------------------------------------------------------------------

    def current_lease(self, now: float) -> Lease | None:
        now_ms = _ms(now)
        valid = [lease for lease in self._leases.values() if lease.valid_at(now_ms)]
        return min(valid, key=Lease.rank) if valid else None

    def tracker(self, now: float) -> str | None:
        current = self.current_lease(now)
        return current.peer_id if current else None

    def term(self, now: float) -> int | None:
        current = self.current_lease(now)
        return current.term if current else None

    def candidacy_delay(self, alive_eligible_peers: Iterable[str]) -> float:
        """Wait before claiming a vacancy: rank among eligible peers times the step, capped."""
        candidates = set(alive_eligible_peers) | {self.self_id}
        if self._last_holder is not None and self._last_holder != self.self_id:
            candidates.discard(self._last_holder)
        rank = sorted(candidates).index(self.self_id)
        return min(rank * self.config.jitter_step, self.config.max_jitter)

    # -- internals ----------------------------------------------------------------------------

    def _issue(self, term: int, now: float) -> BroadcastLease:
        assert self._identity is not None
        now_ms = _ms(now)
        signed = sign_lease(self._identity, term, now_ms, now_ms + _ms(self.config.lease_duration))
        self._remember(verify_lease(signed))
        self._last_issued = now
        self._vacant_since = None
        return BroadcastLease(signed)

    def _remember(self, lease: Lease) -> None:
        self.highest_term = max(self.highest_term, lease.term)
        held = self._leases.get(lease.peer_id)
        if held is None or (lease.term, lease.expires_at_ms) > (held.term, held.expires_at_ms):
            self._leases[lease.peer_id] = lease

    def _prune(self, now: float) -> None:
        now_ms = _ms(now)
        for peer_id in [p for p, lease in self._leases.items() if not lease.valid_at(now_ms)]:
            del self._leases[peer_id]

    def _report(self, now: float) -> list[Action]:
        current = self.current_lease(now)
        new = current.peer_id if current else None
        if new == self._reported:
            return []
        old, self._reported = self._reported, new
        return [TrackerChanged(old=old, new=new, term=current.term if current else self.highest_term)]
