"""What a :class:`~meshd.gossip.node.GossipNode` asks its host to do, and what it reports."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import cast

from meshd.address import Address
from meshd.wire import audit_pb2 as apb
from meshd.wire import card_pb2 as pb


class MemberState(enum.IntEnum):
    ALIVE = pb.ALIVE
    SUSPECT = pb.SUSPECT
    DEAD = pb.DEAD
    LEFT = pb.LEFT

    @property
    def wire(self) -> pb.MemberState:
        """The same state as the protobuf enum value."""
        return cast(pb.MemberState, int(self))


@dataclass(frozen=True)
class Send:
    """Deliver ``message`` to a peer (by id; the host resolves it from the peer's card) or to a seed's
    address, when no peer id is known there yet."""

    to: str | Address
    message: pb.GossipMessage


@dataclass(frozen=True)
class MemberChanged:
    peer_id: str
    old: MemberState | None
    new: MemberState


@dataclass(frozen=True)
class LeaseReceived:
    """A new, well-signed tracker lease arrived; hand it to the election."""

    signed: pb.SignedLease


@dataclass(frozen=True)
class AccusationHeard:
    """An accusation that arrived by gossip, unchecked: the host's audits decide what it is worth."""

    signed: apb.SignedAccusation


Action = Send | MemberChanged | LeaseReceived | AccusationHeard
