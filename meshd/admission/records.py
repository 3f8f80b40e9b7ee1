"""The signed records of a private mesh: invites, membership credentials, revocations, and the token
form of an invite.

Each record is serialized once and signed over those bytes by the mesh's admission key; a receiver
parses the signed bytes and checks the signature against the mesh key it already trusts, never a key
the record names for itself. An invite token is the signed invite in base64url text, so it can be
pasted into a shell or a settings file.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from meshd.errors import ErrorCode, MeshError
from meshd.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, verify
from meshd.wire import admission_pb2 as pb

TOKEN_PREFIX = "meshd-invite-"
INVITE_ID_BYTES = 16
MAX_TOKEN_CHARS = 4096
M = TypeVar("M", bound=Message)


class NotMember(MeshError):
    """A peer without a valid membership of this private mesh asked for something only members get."""

    code = ErrorCode.NOT_MEMBER


class InviteRefused(MeshError):
    """An invite that does not parse, is not signed by the mesh's key, has expired or is used up."""

    code = ErrorCode.INVITE_REFUSED


def mesh_id(mesh_key: bytes) -> str:
    """A short printable name of a mesh: the start of its admission key in hex."""
    return bytes(mesh_key).hex()[:16]


def _parse(kind: type[M], data: bytes, what: str, error: type[MeshError]) -> M:
    out = kind()
    try:
        out.ParseFromString(bytes(data))
    except DecodeError:
        raise error(f"{what} does not parse") from None
    return out


def _checked(payload: bytes, signature: bytes, mesh_key: bytes, what: str, error: type[MeshError]) -> None:
    if len(signature) != SIGNATURE_BYTES or not verify(mesh_key, payload, signature):
        raise error(f"{what} is not signed by this mesh's admission key")


# -- invites ---------------------------------------------------------------------------------------


def sign_invite(key: Identity, invite_id: bytes, now_ms: int, expires_at_ms: int, uses: int,
                addresses: Iterable[str]) -> pb.SignedInvite:
    invite = pb.Invite(mesh_key=key.public_key, invite_id=invite_id, issued_at_ms=now_ms,
                       expires_at_ms=expires_at_ms, uses=uses, addresses=list(addresses))
    payload = invite.SerializeToString(deterministic=True)
    return pb.SignedInvite(invite=payload, signature=key.sign(payload))


def invite_token(signed: pb.SignedInvite) -> str:
    return TOKEN_PREFIX + base64.urlsafe_b64encode(signed.SerializeToString()).decode("ascii").rstrip("=")


def parse_token(token: str) -> tuple[pb.SignedInvite, pb.Invite]:
    """The signed invite in a token and what it says, its signature checked against the key it names
    (a joiner trusts the token it was handed; the admitting peer checks it against its own key)."""
    text = token.strip()
    if not text.startswith(TOKEN_PREFIX) or len(text) > MAX_TOKEN_CHARS:
        raise InviteRefused(f"not a meshd invite token (it starts with {TOKEN_PREFIX!r})")
    body = text[len(TOKEN_PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        raise InviteRefused("the invite token is not base64url text") from None
    signed = _parse(pb.SignedInvite, raw, "the invite token", InviteRefused)
    invite = _parse(pb.Invite, signed.invite, "the invite", InviteRefused)
    if len(invite.mesh_key) != PUBLIC_KEY_BYTES or len(invite.invite_id) != INVITE_ID_BYTES or invite.uses < 1:
        raise InviteRefused("the invite lacks a mesh key, an id or uses")
    _checked(signed.invite, signed.signature, invite.mesh_key, "the invite", InviteRefused)
    return signed, invite


def check_invite(signed: pb.SignedInvite, mesh_key: bytes, now_ms: int) -> pb.Invite:
    """The invite, if this mesh's key signed it and it has not expired."""
    invite = _parse(pb.Invite, signed.invite, "the invite", InviteRefused)
    if invite.mesh_key != mesh_key:
        raise InviteRefused(f"the invite is for mesh {mesh_id(invite.mesh_key)}, not {mesh_id(mesh_key)}")
    _checked(signed.invite, signed.signature, mesh_key, "the invite", InviteRefused)
    if invite.expires_at_ms <= now_ms:
        raise InviteRefused("the invite has expired")
    if len(invite.invite_id) != INVITE_ID_BYTES or invite.uses < 1:
        raise InviteRefused("the invite lacks an id or uses")
    return invite


# -- memberships -----------------------------------------------------------------------------------


def sign_membership(key: Identity, peer_id: str, now_ms: int, invite_id: bytes = b"") -> pb.SignedMembership:
    record = pb.Membership(mesh_key=key.public_key, peer_id=peer_id, issued_at_ms=now_ms, invite_id=invite_id)
    payload = record.SerializeToString(deterministic=True)
    return pb.SignedMembership(membership=payload, signature=key.sign(payload))


def check_membership(signed: pb.SignedMembership, mesh_key: bytes, peer_id: str) -> pb.Membership:
    """The credential, if the mesh's key signed it for exactly this peer."""
    if not signed.membership:
        raise NotMember(f"{peer_id[:12]} shows no membership of mesh {mesh_id(mesh_key)}")
    record = _parse(pb.Membership, signed.membership, "the membership", NotMember)
    if record.mesh_key != mesh_key:
        raise NotMember(f"{peer_id[:12]} is a member of mesh {mesh_id(record.mesh_key)}, not {mesh_id(mesh_key)}")
    if record.peer_id != peer_id:
        raise NotMember(f"the membership shown by {peer_id[:12]} was granted to {record.peer_id[:12]}")
    _checked(signed.membership, signed.signature, mesh_key, "the membership", NotMember)
    return record


# -- revocations -----------------------------------------------------------------------------------


def sign_revocation(key: Identity, peer_id: str, now_ms: int, reason: str = "") -> pb.SignedRevocation:
    record = pb.Revocation(mesh_key=key.public_key, peer_id=peer_id, revoked_at_ms=now_ms, reason=reason[:200])
    payload = record.SerializeToString(deterministic=True)
    return pb.SignedRevocation(revocation=payload, signature=key.sign(payload))


def check_revocation(signed: pb.SignedRevocation, mesh_key: bytes) -> pb.Revocation:
    record = _parse(pb.Revocation, signed.revocation, "the revocation", NotMember)
    if record.mesh_key != mesh_key or not record.peer_id:
        raise NotMember("the revocation is for another mesh, or names no peer")
    _checked(signed.revocation, signed.signature, mesh_key, "the revocation", NotMember)
    return record
