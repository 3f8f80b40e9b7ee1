"""Who belongs to a private mesh, as one peer knows it: the mesh key, the members it has checked, the
members the admission key revoked.

Without IO: the card store asks it about every new card, the daemon asks it about every request and
stream from another peer, gossip hands it the revocations it hears. A peer is admitted once it has
shown a credential the mesh key signed for its own peer id (in its card, or in the header of a
stream it opens: :data:`MEMBERSHIP_HEADER`), and stays admitted until a revocation of it arrives.
An open mesh has no gate.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from meshd.admission.records import NotMember, check_membership, check_revocation, mesh_id
from meshd.cards.card import STORE_CAPACITY, CardRejected, RejectReason
from meshd.errors import MeshError
from meshd.limits import remember
from meshd.wire import admission_pb2 as apb
from meshd.wire import card_pb2 as cpb

log = logging.getLogger("meshd.admission")

MEMBERSHIP_HEADER = "meshd-membership"  # base64 of the SignedMembership, on every stream a member opens
MAX_REVOCATIONS = 10_000  # only the admission key signs them; bounded all the same


@dataclass
class MeshGate:
    mesh_key: bytes
    self_id: str
    own: apb.SignedMembership | None = None  # this peer's credential (None while its invite is redeemed)
    on_revoked: Callable[[str], None] | None = None  # called with each newly revoked peer
    _members: dict[str, None] = field(default_factory=dict)  # checked, in order of last check
    _revoked: dict[str, apb.SignedRevocation] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)  # requests and streams refused, by kind

    @property
    def mesh_id(self) -> str:
        return mesh_id(self.mesh_key)

    def is_revoked(self, peer_id: str) -> bool:
        return peer_id in self._revoked

    def check_credential(self, peer_id: str, signed: apb.SignedMembership) -> None:
        """Admit ``peer_id`` on ``signed``, or raise :class:`NotMember`."""
        if peer_id in self._revoked:
            raise NotMember(f"{peer_id[:12]} was revoked from mesh {self.mesh_id}")
        check_membership(signed, self.mesh_key, peer_id)
        remember(self._members, peer_id, None, STORE_CAPACITY)

    def header(self) -> dict[str, str]:
        """The stream header that shows this peer's credential (none while it has none)."""
        if self.own is None:
            return {}
        return {MEMBERSHIP_HEADER: base64.b64encode(self.own.SerializeToString()).decode("ascii")}

    def check_card(self, card: cpb.CapabilityCard) -> None:
        """For the card store: a card enters only with its peer's valid, unrevoked credential."""
        if card.peer_id in self._revoked:
            raise CardRejected(RejectReason.REVOKED, card.peer_id)
        try:
            self.check_credential(card.peer_id, card.membership)
        except MeshError as exc:
            raise CardRejected(RejectReason.NOT_MEMBER, str(exc)) from None

    def admits(self, peer_id: str) -> bool:
        return peer_id == self.self_id or (peer_id in self._members and peer_id not in self._revoked)

    def require(self, peer_id: str, kind: str) -> None:
        """Raise :class:`NotMember` (and count it) unless ``peer_id`` is a member."""
        if not self.admits(peer_id):
            self.refused[kind] = self.refused.get(kind, 0) + 1
            why = "was revoked from" if peer_id in self._revoked else "has shown no membership of"
            raise NotMember(f"{peer_id[:12]} {why} mesh {self.mesh_id}")

    def admit_stream(self, peer_id: str, credential: str | None) -> bool:
        """Whether a stream from ``peer_id`` may be served: it is a member already, or the stream
        shows a valid credential (the ``meshd-membership`` header every member sends)."""
        if self.admits(peer_id):
            return True
        if not credential or peer_id in self._revoked:
            return False
        signed = apb.SignedMembership()
        try:
            signed.ParseFromString(base64.b64decode(credential, validate=True))
            self.check_credential(peer_id, signed)
        except (ValueError, DecodeError, MeshError):
            return False
        return True

    # -- revocations -------------------------------------------------------------------------------

    def revoke(self, signed: apb.SignedRevocation) -> str | None:
        """Take a revocation; the peer it newly revokes, or None (known already, or not valid)."""
        try:
            record = check_revocation(signed, self.mesh_key)
        except MeshError as exc:
            log.warning("revocation ignored: %s", exc)
            return None
        if record.peer_id in self._revoked or len(self._revoked) >= MAX_REVOCATIONS:
            return None
        self._revoked[record.peer_id] = signed
        self._members.pop(record.peer_id, None)
        if record.peer_id == self.self_id:
            log.error("this peer was revoked from mesh %s: %s", self.mesh_id, record.reason or "no reason given")
        else:
            log.warning("peer %s revoked from mesh %s: %s", record.peer_id[:12], self.mesh_id,
                        record.reason or "no reason given")
        if self.on_revoked is not None:
            self.on_revoked(record.peer_id)
        return record.peer_id

    def revoke_all(self, signed: Iterable[apb.SignedRevocation]) -> list[str]:
        return [p for s in signed if (p := self.revoke(s)) is not None]

    def revocations(self, latest: int | None = None) -> list[apb.SignedRevocation]:
        held = list(self._revoked.values())
        return held if latest is None else held[-latest:]
