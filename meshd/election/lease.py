"""Tracker leases: a signed claim "peer P is tracker for term T until time E".

Leases carry the holder's public key, so they verify without a card lookup, exactly like cards.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from meshd.errors import ErrorCode, MeshError
from meshd.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_from_public_key, verify
from meshd.wire import card_pb2 as pb

MAX_TERM = 2**62  # a term at or past this is refused: every later claim must still fit a lease's uint64
MAX_LEASE_MS = 600_000  # no lease lasts longer; a longer one would outlive a dead holder by that much
CLOCK_SKEW_MS = 60_000  # how far ahead of ours another peer's clock may run (a lease issued later is not yet valid)


class LeaseRejected(MeshError):
    """A lease failed verification (malformed, key not matching peer id, or bad signature)."""

    code = ErrorCode.LEASE_REJECTED

    def __init__(self, reason: str) -> None:
        super().__init__(f"lease rejected: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class Lease:
    """A verified lease and the signed bytes it came from."""

    peer_id: str
    term: int
    issued_at_ms: int
    expires_at_ms: int
    signed: pb.SignedLease

    def dated_ahead(self, now_ms: int) -> bool:
        """Issued further ahead than clock skew explains: a lease dated a year ahead is no lease for now,
        and would stay valid that long."""
        return self.issued_at_ms > now_ms + CLOCK_SKEW_MS

    def valid_at(self, now_ms: int) -> bool:
        return self.expires_at_ms > now_ms and not self.dated_ahead(now_ms)

    def rank(self) -> tuple[int, str]:
        """Sort key of precedence: higher term first, then the lowest peer id."""
        return (-self.term, self.peer_id)


def sign_lease(identity: Identity, term: int, issued_at_ms: int, expires_at_ms: int) -> pb.SignedLease:
    lease = pb.TrackerLease(peer_id=identity.peer_id, term=term, issued_at_ms=issued_at_ms,
                            expires_at_ms=expires_at_ms, public_key=identity.public_key)
    payload = lease.SerializeToString(deterministic=True)
    return pb.SignedLease(lease=payload, signature=identity.sign(payload))


def verify_lease(signed: pb.SignedLease | bytes) -> Lease:
    """Check form, key and signature; expiry is the caller's business (expired leases still carry a term)."""
    if not isinstance(signed, pb.SignedLease):
        raw = signed
        signed = pb.SignedLease()
        try:
            signed.ParseFromString(bytes(raw))
        except DecodeError as exc:
            raise LeaseRejected("malformed") from exc
    lease = pb.TrackerLease()
    try:
        lease.ParseFromString(signed.lease)
    except DecodeError as exc:
        raise LeaseRejected("malformed") from exc
    if (not lease.peer_id or lease.term == 0 or len(lease.public_key) != PUBLIC_KEY_BYTES
            or len(signed.signature) != SIGNATURE_BYTES or lease.expires_at_ms <= lease.issued_at_ms):
        raise LeaseRejected("malformed")
    if lease.term >= MAX_TERM:
        raise LeaseRejected("term_too_high")
    if lease.expires_at_ms - lease.issued_at_ms > MAX_LEASE_MS:
        raise LeaseRejected("too_long")
    if peer_id_from_public_key(lease.public_key) != lease.peer_id:
        raise LeaseRejected("key_mismatch")
    if not verify(lease.public_key, signed.lease, signed.signature):
        raise LeaseRejected("bad_signature")
    return Lease(peer_id=lease.peer_id, term=lease.term, issued_at_ms=lease.issued_at_ms,
                 expires_at_ms=lease.expires_at_ms,
                 signed=pb.SignedLease(lease=signed.lease, signature=signed.signature))
