from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Invite(_message.Message):
    __slots__ = ("mesh_key", "invite_id", "issued_at_ms", "expires_at_ms", "uses", "addresses")
    MESH_KEY_FIELD_NUMBER: _ClassVar[int]
    INVITE_ID_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    mesh_key: bytes
    invite_id: bytes
    issued_at_ms: int
    expires_at_ms: int
    uses: int
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, mesh_key: _Optional[bytes] = ..., invite_id: _Optional[bytes] = ..., issued_at_ms: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., uses: _Optional[int] = ..., addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class SignedInvite(_message.Message):
    __slots__ = ("invite", "signature")
    INVITE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    invite: bytes
    signature: bytes
    def __init__(self, invite: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Membership(_message.Message):
    __slots__ = ("mesh_key", "peer_id", "issued_at_ms", "invite_id")
    MESH_KEY_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    INVITE_ID_FIELD_NUMBER: _ClassVar[int]
    mesh_key: bytes
    peer_id: str
    issued_at_ms: int
    invite_id: bytes
    def __init__(self, mesh_key: _Optional[bytes] = ..., peer_id: _Optional[str] = ..., issued_at_ms: _Optional[int] = ..., invite_id: _Optional[bytes] = ...) -> None: ...

class SignedMembership(_message.Message):
    __slots__ = ("membership", "signature")
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    membership: bytes
    signature: bytes
    def __init__(self, membership: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Revocation(_message.Message):
    __slots__ = ("mesh_key", "peer_id", "revoked_at_ms", "reason")
    MESH_KEY_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    mesh_key: bytes
    peer_id: str
    revoked_at_ms: int
    reason: str
    def __init__(self, mesh_key: _Optional[bytes] = ..., peer_id: _Optional[str] = ..., revoked_at_ms: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SignedRevocation(_message.Message):
    __slots__ = ("revocation", "signature")
    REVOCATION_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    revocation: bytes
    signature: bytes
    def __init__(self, revocation: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("invite",)
    INVITE_FIELD_NUMBER: _ClassVar[int]
    invite: SignedInvite
    def __init__(self, invite: _Optional[_Union[SignedInvite, _Mapping]] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("membership", "revocations")
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    membership: SignedMembership
    revocations: _containers.RepeatedCompositeFieldContainer[SignedRevocation]
    def __init__(self, membership: _Optional[_Union[SignedMembership, _Mapping]] = ..., revocations: _Optional[_Iterable[_Union[SignedRevocation, _Mapping]]] = ...) -> None: ...
