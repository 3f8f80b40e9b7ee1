"""What this peer's audits found, without IO: verdicts per peer, who is excluded, accusations heard.

A peer is excluded from this peer's routes once :data:`GUILTY_TO_EXCLUDE` audits of its own, each
with a prompt of its own, found it guilty; an accusation from another peer counts for nothing until
an audit here confirms it. Everything is bounded: peers tracked, accusations kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshd.audit.verdict import Outcome, Verdict
from meshd.limits import remember
from meshd.wire import audit_pb2 as pb

GUILTY_TO_EXCLUDE = 2
MAX_TRACKED = 10_000
MAX_ACCUSATIONS = 256
ACCUSATIONS_GOSSIPED = 32


@dataclass
class PeerRecord:
    passed: int = 0
    guilty: int = 0
    excluded_at: float | None = None
    accused_by: set[str] = field(default_factory=set)  # accusers heard; believed only when an audit agrees
    unconfirmed: int = 0                                # accusations an audit here did not bear out

    def as_json(self) -> dict:
        state = "excluded" if self.excluded_at is not None else "suspect" if self.guilty else (
            "accused" if self.accused_by else "passed" if self.passed else "unaudited")
        return {"state": state, "passed": self.passed, "guilty": self.guilty,
                "accused_by": sorted(self.accused_by), "unconfirmed_accusations": self.unconfirmed}


@dataclass
class AuditBook:
    self_id: str
    audits: dict[str, int] = field(default_factory=lambda: {o.value: 0 for o in Outcome})
    _peers: dict[str, PeerRecord] = field(default_factory=dict)
    _accusations: dict[tuple[str, str], pb.SignedAccusation] = field(default_factory=dict)  # (accuser, accused)

    def _record(self, peer_id: str) -> PeerRecord:
        return remember(self._peers, peer_id, self._peers.get(peer_id) or PeerRecord(), MAX_TRACKED)

    def record(self, verdict: Verdict, now: float) -> str | None:
        """Take an audit's verdict; the peer it newly excludes, if any."""
        self.audits[verdict.outcome.value] += 1
        for peer_id in verdict.cleared:
            if peer_id != self.self_id:
                self._record(peer_id).passed += 1
        if verdict.outcome != Outcome.GUILTY or verdict.culprit is None:
            return None
        record = self._record(verdict.culprit)
        record.guilty += 1
        if record.excluded_at is None and record.guilty >= GUILTY_TO_EXCLUDE:
            record.excluded_at = now
            return verdict.culprit
        return None

    def heard(self, accuser: str, accused: str, signed: pb.SignedAccusation) -> bool:
        """Keep an accusation (to gossip on, and to check); False if it was known already."""
        key = (accuser, accused)
        if key in self._accusations or accused == self.self_id:
            return False
        if len(self._accusations) >= MAX_ACCUSATIONS:  # the oldest goes, and its accuser with it
            old_accuser, old_accused = next(iter(self._accusations))
            old = self._peers.get(old_accused)
            if old is not None:
                old.accused_by.discard(old_accuser)
        remember(self._accusations, key, signed, MAX_ACCUSATIONS)
        self._record(accused).accused_by.add(accuser)
        return True

    def unconfirmed(self, accused: str) -> None:
        self._record(accused).unconfirmed += 1

    def is_excluded(self, peer_id: str) -> bool:
        record = self._peers.get(peer_id)
        return record is not None and record.excluded_at is not None

    def excluded(self) -> frozenset[str]:
        return frozenset(p for p, r in self._peers.items() if r.excluded_at is not None)

    def accusations(self) -> list[pb.SignedAccusation]:
        return list(self._accusations.values())[-ACCUSATIONS_GOSSIPED:]

    def of(self, peer_id: str) -> dict | None:
        record = self._peers.get(peer_id)
        return record.as_json() if record is not None else None
