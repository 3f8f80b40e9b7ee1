from meshd.wire import admission_pb2 as _admission_pb2
from meshd.wire import audit_pb2 as _audit_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    ALIVE: _ClassVar[MemberState]
    SUSPECT: _ClassVar[MemberState]
    DEAD: _ClassVar[MemberState]
    LEFT: _ClassVar[MemberState]
MEMBER_STATE_UNSPECIFIED: MemberState
ALIVE: MemberState
SUSPECT: MemberState
DEAD: MemberState
LEFT: MemberState

class Hardware(_message.Message):
    __slots__ = ("ram_bytes", "device", "cpu_count", "device_memory_bytes")
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ram_bytes: int
    device: str
    cpu_count: int
    device_memory_bytes: int
    def __init__(self, ram_bytes: _Optional[int] = ..., device: _Optional[str] = ..., cpu_count: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ...) -> None: ...

class ModelServed(_message.Message):
    __slots__ = ("model_id", "compat_key", "n_layers", "range_start", "range_end", "decode_tok_s", "pinned", "layer_bytes", "edge_bytes", "context_length", "numerics", "shard_error", "backend", "quantization", "prefill_tok_s", "kv_token_bytes", "prefill_only", "class_since_ms")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    RANGE_START_FIELD_NUMBER: _ClassVar[int]
    RANGE_END_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOK_S_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    EDGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    SHARD_ERROR_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOK_S_FIELD_NUMBER: _ClassVar[int]
    KV_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    CLASS_SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    compat_key: str
    n_layers: int
    range_start: int
    range_end: int
    decode_tok_s: float
    pinned: bool
    layer_bytes: int
    edge_bytes: int
    context_length: int
    numerics: str
    shard_error: str
    backend: str
    quantization: str
    prefill_tok_s: float
    kv_token_bytes: int
    prefill_only: bool
    class_since_ms: int
    def __init__(self, model_id: _Optional[str] = ..., compat_key: _Optional[str] = ..., n_layers: _Optional[int] = ..., range_start: _Optional[int] = ..., range_end: _Optional[int] = ..., decode_tok_s: _Optional[float] = ..., pinned: _Optional[bool] = ..., layer_bytes: _Optional[int] = ..., edge_bytes: _Optional[int] = ..., context_length: _Optional[int] = ..., numerics: _Optional[str] = ..., shard_error: _Optional[str] = ..., backend: _Optional[str] = ..., quantization: _Optional[str] = ..., prefill_tok_s: _Optional[float] = ..., kv_token_bytes: _Optional[int] = ..., prefill_only: _Optional[bool] = ..., class_since_ms: _Optional[int] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("active_sessions", "queued")
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    active_sessions: int
    queued: int
    def __init__(self, active_sessions: _Optional[int] = ..., queued: _Optional[int] = ...) -> None: ...

class LinkMeasure(_message.Message):
    __slots__ = ("peer_id", "rtt_us", "rate_bps")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RTT_US_FIELD_NUMBER: _ClassVar[int]
    RATE_BPS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    rtt_us: int
    rate_bps: int
    def __init__(self, peer_id: _Optional[str] = ..., rtt_us: _Optional[int] = ..., rate_bps: _Optional[int] = ...) -> None: ...

class CapabilityCard(_message.Message):
    __slots__ = ("peer_id", "public_key", "name", "sequence", "issued_at_ms", "expires_at_ms", "addresses", "relay_addresses", "api_address", "hardware", "models", "load", "kv_free_bytes", "tracker_eligible", "software_version", "memory_budget_bytes", "membership", "links", "kv_tier_bytes")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    API_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRACKER_ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    public_key: bytes
    name: str
    sequence: int
    issued_at_ms: int
    expires_at_ms: int
    addresses: _containers.RepeatedScalarFieldContainer[str]
    relay_addresses: _containers.RepeatedScalarFieldContainer[str]
    api_address: str
    hardware: Hardware
    models: _containers.RepeatedCompositeFieldContainer[ModelServed]
    load: Load
    kv_free_bytes: int
    tracker_eligible: bool
    software_version: str
    memory_budget_bytes: int
    membership: _admission_pb2.SignedMembership
    links: _containers.RepeatedCompositeFieldContainer[LinkMeasure]
    kv_tier_bytes: int
    def __init__(self, peer_id: _Optional[str] = ..., public_key: _Optional[bytes] = ..., name: _Optional[str] = ..., sequence: _Optional[int] = ..., issued_at_ms: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., addresses: _Optional[_Iterable[str]] = ..., relay_addresses: _Optional[_Iterable[str]] = ..., api_address: _Optional[str] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., models: _Optional[_Iterable[_Union[ModelServed, _Mapping]]] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., kv_free_bytes: _Optional[int] = ..., tracker_eligible: _Optional[bool] = ..., software_version: _Optional[str] = ..., memory_budget_bytes: _Optional[int] = ..., membership: _Optional[_Union[_admission_pb2.SignedMembership, _Mapping]] = ..., links: _Optional[_Iterable[_Union[LinkMeasure, _Mapping]]] = ..., kv_tier_bytes: _Optional[int] = ...) -> None: ...

class SignedCard(_message.Message):
    __slots__ = ("card", "signature")
    CARD_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    card: bytes
    signature: bytes
    def __init__(self, card: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class TrackerLease(_message.Message):
    __slots__ = ("peer_id", "term", "expires_at_ms", "issued_at_ms", "public_key")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    term: int
    expires_at_ms: int
    issued_at_ms: int
    public_key: bytes
    def __init__(self, peer_id: _Optional[str] = ..., term: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., issued_at_ms: _Optional[int] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class SignedLease(_message.Message):
    __slots__ = ("lease", "signature")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    lease: bytes
    signature: bytes
    def __init__(self, lease: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class MemberDigest(_message.Message):
    __slots__ = ("peer_id", "sequence", "state")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    sequence: int
    state: MemberState
    def __init__(self, peer_id: _Optional[str] = ..., sequence: _Optional[int] = ..., state: _Optional[_Union[MemberState, str]] = ...) -> None: ...

class PushPull(_message.Message):
    __slots__ = ("cards", "digest", "reply", "leases", "revocations", "accusations", "summary", "bucket_count", "buckets", "revocations_hash", "accusations_hash")
    CARDS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    ACCUSATIONS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNT_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_HASH_FIELD_NUMBER: _ClassVar[int]
    ACCUSATIONS_HASH_FIELD_NUMBER: _ClassVar[int]
    cards: _containers.RepeatedCompositeFieldContainer[SignedCard]
    digest: _containers.RepeatedCompositeFieldContainer[MemberDigest]
    reply: bool
    leases: _containers.RepeatedCompositeFieldContainer[SignedLease]
    revocations: _containers.RepeatedCompositeFieldContainer[_admission_pb2.SignedRevocation]
    accusations: _containers.RepeatedCompositeFieldContainer[_audit_pb2.SignedAccusation]
    summary: bytes
    bucket_count: int
    buckets: _containers.RepeatedScalarFieldContainer[int]
    revocations_hash: int
    accusations_hash: int
    def __init__(self, cards: _Optional[_Iterable[_Union[SignedCard, _Mapping]]] = ..., digest: _Optional[_Iterable[_Union[MemberDigest, _Mapping]]] = ..., reply: _Optional[bool] = ..., leases: _Optional[_Iterable[_Union[SignedLease, _Mapping]]] = ..., revocations: _Optional[_Iterable[_Union[_admission_pb2.SignedRevocation, _Mapping]]] = ..., accusations: _Optional[_Iterable[_Union[_audit_pb2.SignedAccusation, _Mapping]]] = ..., summary: _Optional[bytes] = ..., bucket_count: _Optional[int] = ..., buckets: _Optional[_Iterable[int]] = ..., revocations_hash: _Optional[int] = ..., accusations_hash: _Optional[int] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("seq", "from_peer")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FROM_PEER_FIELD_NUMBER: _ClassVar[int]
    seq: int
    from_peer: str
    def __init__(self, seq: _Optional[int] = ..., from_peer: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq", "from_peer")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FROM_PEER_FIELD_NUMBER: _ClassVar[int]
    seq: int
    from_peer: str
    def __init__(self, seq: _Optional[int] = ..., from_peer: _Optional[str] = ...) -> None: ...

class PingReq(_message.Message):
    __slots__ = ("seq", "target_peer", "from_peer")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TARGET_PEER_FIELD_NUMBER: _ClassVar[int]
    FROM_PEER_FIELD_NUMBER: _ClassVar[int]
    seq: int
    target_peer: str
    from_peer: str
    def __init__(self, seq: _Optional[int] = ..., target_peer: _Optional[str] = ..., from_peer: _Optional[str] = ...) -> None: ...

class Leave(_message.Message):
    __slots__ = ("from_peer", "sequence")
    FROM_PEER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    from_peer: str
    sequence: int
    def __init__(self, from_peer: _Optional[str] = ..., sequence: _Optional[int] = ...) -> None: ...

class GossipMessage(_message.Message):
    __slots__ = ("push_pull", "ping", "ack", "ping_req", "leave", "updates", "cards", "leases", "answer_in_reply")
    PUSH_PULL_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    PING_REQ_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    CARDS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    ANSWER_IN_REPLY_FIELD_NUMBER: _ClassVar[int]
    push_pull: PushPull
    ping: Ping
    ack: Ack
    ping_req: PingReq
    leave: Leave
    updates: _containers.RepeatedCompositeFieldContainer[MemberDigest]
    cards: _containers.RepeatedCompositeFieldContainer[SignedCard]
    leases: _containers.RepeatedCompositeFieldContainer[SignedLease]
    answer_in_reply: bool
    def __init__(self, push_pull: _Optional[_Union[PushPull, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., ping_req: _Optional[_Union[PingReq, _Mapping]] = ..., leave: _Optional[_Union[Leave, _Mapping]] = ..., updates: _Optional[_Iterable[_Union[MemberDigest, _Mapping]]] = ..., cards: _Optional[_Iterable[_Union[SignedCard, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[SignedLease, _Mapping]]] = ..., answer_in_reply: _Optional[bool] = ...) -> None: ...
