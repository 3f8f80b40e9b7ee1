"""Tracker election: one eligible peer holds a signed, expiring lease; a higher term always wins."""

from meshd.election.election import Action, BroadcastLease, Election, ElectionConfig, TrackerChanged
from meshd.election.lease import Lease, LeaseRejected, sign_lease, verify_lease

__all__ = [
    "Action",
    "BroadcastLease",
    "Election",
    "ElectionConfig",
    "Lease",
    "LeaseRejected",
    "TrackerChanged",
    "sign_lease",
    "verify_lease",
]
