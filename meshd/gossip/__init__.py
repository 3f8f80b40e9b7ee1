"""Gossip: SWIM-style membership and failure detection, card and lease dissemination."""

from meshd.gossip.events import AccusationHeard, Action, LeaseReceived, MemberChanged, MemberState, Send
from meshd.gossip.node import GossipConfig, GossipNode, Member, dead_everywhere_bound

__all__ = [
    "AccusationHeard",
    "Action",
    "GossipConfig",
    "GossipNode",
    "LeaseReceived",
    "Member",
    "MemberChanged",
    "MemberState",
    "Send",
    "dead_everywhere_bound",
]
