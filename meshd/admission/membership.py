"""This peer's place in its mesh, kept in its data directory: open, founder, member, or joining.

- A peer started without bootstrap addresses or an invite founds a private mesh: it creates the
  admission key (``admission.key``, mode 0600) and grants itself the first membership.
- A holder of the admission key issues invites, redeems them into memberships (counting each
  invite's uses on disk, so a restart does not refill them) and revokes members.
- A peer given an invite token redeems it with the admitting peer named in the token, once; the
  credential it receives is kept (``admission/membership``) and shown on its cards from then on,
  and the token's addresses are kept too, to join through on later starts.
- Revocations heard are kept too (``admission/revocations``), so a restart does not forget them.
- ``open_mesh`` turns all of it off: anyone who can reach the peer may take part.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshd.address import Address
from meshd.admission.gate import MeshGate
from meshd.admission.records import (
    INVITE_ID_BYTES,
    InviteRefused,
    NotMember,
    check_invite,
    check_membership,
    invite_token,
    mesh_id,
    parse_token,
    sign_invite,
    sign_membership,
    sign_revocation,
)
from meshd.errors import ErrorCode, MeshError
from meshd.files import write_atomically
from meshd.identity import Identity
from meshd.transport.streams import StreamOpener
from meshd.wire import admission_pb2 as apb
from meshd.wire import rpc_pb2 as rpb

log = logging.getLogger("meshd.admission")

ADMISSION_KEY_FILE = "admission.key"
STATE_DIR = "admission"
MEMBERSHIP_FILE = "membership"
REVOCATIONS_FILE = "revocations"
REDEEMED_FILE = "redeemed.json"
ADDRESSES_FILE = "addresses.json"  # where the invite said the mesh is: bootstrap addresses for later starts
MAX_INVITE_USES = 1000
MAX_INVITE_S = 30 * 24 * 3600.0
JOIN_TIMEOUT_S = 10.0


class NotAdmitter(MeshError):
    """Asked to issue invites, redeem one or revoke a member without holding the admission key."""

    code = ErrorCode.INVITE_REFUSED


def _ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Membership:
    """How this peer belongs: ``gate`` None for an open mesh; ``key`` set where it can admit others."""

    data_dir: Path
    identity: Identity
    gate: MeshGate | None
    key: Identity | None = None
    pending: apb.SignedInvite | None = None  # an invite still to redeem
    addresses: list[str] = field(default_factory=list)  # the invite's: where to join the mesh through
    _redeemed: dict[str, dict] = field(default_factory=dict)  # invite id hex -> {"expires_at_ms", "peers"}

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def load(cls, data_dir: Path, identity: Identity, *, open_mesh: bool, invite: str = "",
             founding: bool = False) -> Membership:
        """What the data directory and the settings say; raises :class:`MeshError` with what to do
        when the peer would join a mesh it has no way into."""
        data_dir = Path(data_dir)
        if open_mesh:
            return cls(data_dir, identity, None)
        state = data_dir / STATE_DIR
        key = None
        if (data_dir / ADMISSION_KEY_FILE).exists():
            key = Identity.load_or_create(data_dir, ADMISSION_KEY_FILE)
        held = _read_membership(state / MEMBERSHIP_FILE)
        token = parse_token(invite) if invite else None
        if token is not None and (held is None or token[1].mesh_key != _mesh_key_of(held)):
            signed, record = token
            if record.expires_at_ms <= _ms():
                raise InviteRefused("the invite has expired; ask a member for a new one (meshctl invite)")
            gate = MeshGate(record.mesh_key, identity.peer_id)
            out = cls(data_dir, identity, gate, key if key and key.public_key == record.mesh_key else None,
                      pending=signed, addresses=list(record.addresses))
        elif held is not None:
            gate = MeshGate(_mesh_key_of(held), identity.peer_id, own=held)
            kept = _read_json(state / ADDRESSES_FILE).get("addresses", [])
            addresses = list(token[1].addresses) if token is not None else [a for a in kept if isinstance(a, str)]
            out = cls(data_dir, identity, gate, key if key and key.public_key == gate.mesh_key else None,
                      addresses=addresses)
        elif key is not None or founding:
            if key is None:
                key = Identity.load_or_create(data_dir, ADMISSION_KEY_FILE)
                log.info("founded private mesh %s; invite peers with `meshctl invite`", mesh_id(key.public_key))
            own = sign_membership(key, identity.peer_id, _ms())
            write_atomically(_state(state) / MEMBERSHIP_FILE, own.SerializeToString(), mode=0o600)
            out = cls(data_dir, identity, MeshGate(key.public_key, identity.peer_id, own=own), key)
        else:
            raise NotMember("this peer is not a member of any mesh: join one with an invite (`meshd join TOKEN`, "
                            "made by `meshctl invite` on a member), or set open_mesh (--open-mesh) to join an open "
                            "mesh")
        assert out.gate is not None
        out.gate.revoke_all(_read_revocations(state / REVOCATIONS_FILE, ))
        out.gate.on_revoked = lambda _peer: out._save_revocations()
        if out.key is not None:
            out._redeemed = _read_json(state / REDEEMED_FILE)
        return out

    @property
    def mesh(self) -> str:
        return self.gate.mesh_id if self.gate is not None else "open"

    def describe(self) -> dict:
        """For the status: which mesh, and whether this peer can admit others."""
        gate = self.gate
        return {"mesh": self.mesh, "mesh_key": gate.mesh_key.hex() if gate is not None else "",
                "private": gate is not None, "admits": self.key is not None,
                "member": gate is not None and gate.own is not None,
                "revoked_peers": len(gate.revocations()) if gate is not None else 0,
                "refused": dict(gate.refused) if gate is not None else {}}

    # -- joining with an invite ------------------------------------------------------------------

    async def join(self, opener: StreamOpener) -> None:
        """Redeem the pending invite with the peers it names; the credential is kept on disk."""
        from meshd.rpc.router import ask_in_turn  # the RPC layer, only where this peer joins

        if self.pending is None or self.gate is None:
            return
        gate = self.gate
        request = rpb.PeerRequest(join=apb.JoinRequest(invite=self.pending))

        def checked(reply: apb.JoinReply) -> apb.JoinReply:
            check_membership(reply.membership, gate.mesh_key, self.identity.peer_id)
            return reply

        sources: list[tuple[str | None, str]] = [(None, str(Address.parse(a))) for a in self.addresses]
        _, reply = await ask_in_turn(opener, sources, request, "joined", checked,
                                     timeout=JOIN_TIMEOUT_S, what="a membership for this invite")
        gate.own = apb.SignedMembership()
        gate.own.CopyFrom(reply.membership)
        state = _state(self.data_dir / STATE_DIR)
        write_atomically(state / ADDRESSES_FILE, json.dumps({"addresses": self.addresses}))
        write_atomically(state / MEMBERSHIP_FILE, gate.own.SerializeToString(), mode=0o600)
        gate.revoke_all(reply.revocations)
        self._save_revocations()
        self.pending = None
        log.info("joined private mesh %s", gate.mesh_id)

    # -- admitting others (holders of the admission key) -------------------------------------------

    def _admitter(self) -> tuple[Identity, MeshGate]:
        if self.key is None or self.gate is None:
            raise NotAdmitter("this peer does not hold the mesh's admission key; ask the peer that founded the mesh")
        return self.key, self.gate

    def issue_invite(self, expires_s: float, uses: int, addresses: list[str]) -> tuple[str, int]:
        """A token and when it expires (ms since the epoch)."""
        key, _ = self._admitter()
        if not 0 < expires_s <= MAX_INVITE_S:
            raise ValueError(f"an invite lasts more than 0 s and at most {MAX_INVITE_S / 86400:.0f} days")
        if not 1 <= uses <= MAX_INVITE_USES:
            raise ValueError(f"an invite admits 1 to {MAX_INVITE_USES} peers")
        if not addresses:
            raise NotAdmitter("this peer has no address other peers can dial, so nobody could redeem an invite here")
        now = _ms()
        expires = now + int(expires_s * 1000)
        signed = sign_invite(key, os.urandom(INVITE_ID_BYTES), now, expires, uses, addresses)
        return invite_token(signed), expires

    def redeem(self, sender: str, request: apb.JoinRequest) -> apb.JoinReply:
        """The join handler: a membership for ``sender`` if the invite is this mesh's, unexpired and
        not used up (a peer redeeming the same invite again gets its membership again, uncounted)."""
        key, gate = self._admitter()
        now = _ms()
        invite = check_invite(request.invite, key.public_key, now)
        if gate.is_revoked(sender):
            raise InviteRefused(f"{sender[:12]} was revoked from this mesh")
        entry = self._redeemed.setdefault(invite.invite_id.hex(), {"expires_at_ms": invite.expires_at_ms, "peers": []})
        if sender not in entry["peers"]:
            if len(entry["peers"]) >= invite.uses:
                raise InviteRefused(f"the invite is used up ({invite.uses} use{'s' if invite.uses > 1 else ''})")
            entry["peers"].append(sender)
            self._redeemed = {k: v for k, v in self._redeemed.items() if v["expires_at_ms"] > now}
            write_atomically(_state(self.data_dir / STATE_DIR) / REDEEMED_FILE, json.dumps(self._redeemed))
        log.info("admitted %s to mesh %s with invite %s", sender[:12], gate.mesh_id, invite.invite_id.hex()[:8])
        membership = sign_membership(key, sender, now, invite.invite_id)
        gate.check_credential(sender, membership)
        return apb.JoinReply(membership=membership, revocations=gate.revocations())

    def revoke(self, peer_id: str, reason: str = "") -> apb.SignedRevocation:
        key, gate = self._admitter()
        if peer_id == self.identity.peer_id:
            raise ValueError("a peer cannot revoke itself; stop it instead")
        if gate.is_revoked(peer_id):
            raise ValueError(f"{peer_id[:12]} is revoked already")
        return sign_revocation(key, peer_id, _ms(), reason)

    def _save_revocations(self) -> None:
        if self.gate is None:
            return
        lines = [base64.b64encode(r.SerializeToString()).decode("ascii") for r in self.gate.revocations()]
        write_atomically(_state(self.data_dir / STATE_DIR) / REVOCATIONS_FILE, "\n".join(lines) + "\n")


def _state(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def _mesh_key_of(signed: apb.SignedMembership) -> bytes:
    record = apb.Membership()
    record.ParseFromString(signed.membership)
    return record.mesh_key


def _read_membership(path: Path) -> apb.SignedMembership | None:
    if not path.exists():
        return None
    signed = apb.SignedMembership()
    try:
        signed.ParseFromString(path.read_bytes())
        if len(_mesh_key_of(signed)) != 32:
            raise ValueError("no mesh key")
    except Exception as exc:
        raise NotMember(f"the membership kept in {path} is unreadable ({exc}); delete it and join again with an "
                        "invite") from None
    return signed


def _read_revocations(path: Path) -> list[apb.SignedRevocation]:
    out: list[apb.SignedRevocation] = []
    if not path.exists():
        return out
    for line in path.read_text().split():
        signed = apb.SignedRevocation()
        try:
            signed.ParseFromString(base64.b64decode(line))
        except Exception:
            log.warning("an unreadable line in %s was skipped", path)
            continue
        out.append(signed)
    return out


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
    except ValueError:
        log.error("%s is not JSON; invite uses start again from nothing", path)
        return {}
    return doc if isinstance(doc, dict) else {}
