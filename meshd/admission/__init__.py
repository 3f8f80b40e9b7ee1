"""Admission to a private mesh: the admission key, invites, membership credentials, revocations.

- :mod:`~meshd.admission.records`: the signed records and the invite token form.
- :mod:`~meshd.admission.gate`: who belongs, as one peer knows it (sans-IO).
- :mod:`~meshd.admission.membership`: this peer's place in its mesh, kept in its data directory.
"""

from meshd.admission.gate import MeshGate
from meshd.admission.membership import Membership, NotAdmitter
from meshd.admission.records import InviteRefused, NotMember, invite_token, mesh_id, parse_token

__all__ = [
           "InviteRefused",
           "Membership",
           "MeshGate",
           "NotAdmitter",
           "NotMember",
           "invite_token",
           "mesh_id",
           "parse_token",
]
