from meshd.wire import admission_pb2 as _admission_pb2
from meshd.wire import card_pb2 as _card_pb2
from meshd.wire import kv_tier_pb2 as _kv_tier_pb2
from meshd.wire import trace_pb2 as _trace_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayerRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("model_id", "exclude", "keep", "avoid", "compat_key")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    AVOID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    exclude: _containers.RepeatedScalarFieldContainer[str]
    keep: _containers.RepeatedScalarFieldContainer[str]
    avoid: _containers.RepeatedScalarFieldContainer[str]
    compat_key: str
    def __init__(self, model_id: _Optional[str] = ..., exclude: _Optional[_Iterable[str]] = ..., keep: _Optional[_Iterable[str]] = ..., avoid: _Optional[_Iterable[str]] = ..., compat_key: _Optional[str] = ...) -> None: ...

class LinkCost(_message.Message):
    __slots__ = ("from_peer", "to_peer", "rtt_ms", "rate_bps", "bytes", "latency_ms", "transfer_ms", "rtt_measured", "rate_measured", "relayed")
    FROM_PEER_FIELD_NUMBER: _ClassVar[int]
    TO_PEER_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    RATE_BPS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    RTT_MEASURED_FIELD_NUMBER: _ClassVar[int]
    RATE_MEASURED_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    from_peer: str
    to_peer: str
    rtt_ms: float
    rate_bps: float
    bytes: int
    latency_ms: float
    transfer_ms: float
    rtt_measured: bool
    rate_measured: bool
    relayed: bool
    def __init__(self, from_peer: _Optional[str] = ..., to_peer: _Optional[str] = ..., rtt_ms: _Optional[float] = ..., rate_bps: _Optional[float] = ..., bytes: _Optional[int] = ..., latency_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., rtt_measured: _Optional[bool] = ..., rate_measured: _Optional[bool] = ..., relayed: _Optional[bool] = ...) -> None: ...

class RouteHop(_message.Message):
    __slots__ = ("peer_id", "start", "end", "compute_ms", "seam_ms", "hop_ms", "load_factor", "crossing")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    SEAM_MS_FIELD_NUMBER: _ClassVar[int]
    HOP_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FACTOR_FIELD_NUMBER: _ClassVar[int]
    CROSSING_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    start: int
    end: int
    compute_ms: float
    seam_ms: float
    hop_ms: float
    load_factor: float
    crossing: LinkCost
    def __init__(self, peer_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., compute_ms: _Optional[float] = ..., seam_ms: _Optional[float] = ..., hop_ms: _Optional[float] = ..., load_factor: _Optional[float] = ..., crossing: _Optional[_Union[LinkCost, _Mapping]] = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("model_id", "compat_key", "epoch", "cost_ms", "hops", "entry", "back")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COST_MS_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    BACK_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    compat_key: str
    epoch: int
    cost_ms: float
    hops: _containers.RepeatedCompositeFieldContainer[RouteHop]
    entry: str
    back: LinkCost
    def __init__(self, model_id: _Optional[str] = ..., compat_key: _Optional[str] = ..., epoch: _Optional[int] = ..., cost_ms: _Optional[float] = ..., hops: _Optional[_Iterable[_Union[RouteHop, _Mapping]]] = ..., entry: _Optional[str] = ..., back: _Optional[_Union[LinkCost, _Mapping]] = ...) -> None: ...

class NoRoute(_message.Message):
    __slots__ = ("model_id", "missing")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    missing: _containers.RepeatedCompositeFieldContainer[LayerRange]
    def __init__(self, model_id: _Optional[str] = ..., missing: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ...) -> None: ...

class PlacementOrder(_message.Message):
    __slots__ = ("model_id", "compat_key", "range")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    compat_key: str
    range: LayerRange
    def __init__(self, model_id: _Optional[str] = ..., compat_key: _Optional[str] = ..., range: _Optional[_Union[LayerRange, _Mapping]] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelFilesRequest(_message.Message):
    __slots__ = ("model_id", "compat_key")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    compat_key: str
    def __init__(self, model_id: _Optional[str] = ..., compat_key: _Optional[str] = ...) -> None: ...

class ModelFiles(_message.Message):
    __slots__ = ("files", "architecture", "weights_digest", "numerics")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    architecture: str
    weights_digest: str
    numerics: str
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ..., architecture: _Optional[str] = ..., weights_digest: _Optional[str] = ..., numerics: _Optional[str] = ...) -> None: ...

class ManifestRequest(_message.Message):
    __slots__ = ("model_id", "compat_key")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    compat_key: str
    def __init__(self, model_id: _Optional[str] = ..., compat_key: _Optional[str] = ...) -> None: ...

class TensorRecord(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "chunks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    chunks: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., chunks: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WeightsManifest(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorRecord]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorRecord, _Mapping]]] = ...) -> None: ...

class ChunkRequest(_message.Message):
    __slots__ = ("compat_key", "tensor", "index")
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    compat_key: str
    tensor: str
    index: int
    def __init__(self, compat_key: _Optional[str] = ..., tensor: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class DialbackRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class DialbackReply(_message.Message):
    __slots__ = ("dialable", "error")
    DIALABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    dialable: bool
    error: str
    def __init__(self, dialable: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class RpcError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class SpeedCheck(_message.Message):
    __slots__ = ("model_id", "compat_key", "steps")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    compat_key: str
    steps: int
    def __init__(self, model_id: _Optional[str] = ..., compat_key: _Optional[str] = ..., steps: _Optional[int] = ...) -> None: ...

class SpeedChecked(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    def __init__(self, steps: _Optional[int] = ...) -> None: ...

class PrefixProbe(_message.Message):
    __slots__ = ("model_id", "compat_key", "upstream_peer_id", "names", "lengths", "source_peer_id", "source_upstream_peer_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_UPSTREAM_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    compat_key: str
    upstream_peer_id: str
    names: _containers.RepeatedScalarFieldContainer[bytes]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    source_peer_id: str
    source_upstream_peer_id: str
    def __init__(self, model_id: _Optional[str] = ..., compat_key: _Optional[str] = ..., upstream_peer_id: _Optional[str] = ..., names: _Optional[_Iterable[bytes]] = ..., lengths: _Optional[_Iterable[int]] = ..., source_peer_id: _Optional[str] = ..., source_upstream_peer_id: _Optional[str] = ...) -> None: ...

class PrefixHeld(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, names: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PeerRequest(_message.Message):
    __slots__ = ("gossip", "route", "placement", "model_files", "dialback", "manifest", "chunk", "join", "speed_check", "prefix_probe", "kv_put", "kv_get", "trace")
    GOSSIP_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FILES_FIELD_NUMBER: _ClassVar[int]
    DIALBACK_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    SPEED_CHECK_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PROBE_FIELD_NUMBER: _ClassVar[int]
    KV_PUT_FIELD_NUMBER: _ClassVar[int]
    KV_GET_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    gossip: _card_pb2.GossipMessage
    route: RouteRequest
    placement: PlacementOrder
    model_files: ModelFilesRequest
    dialback: DialbackRequest
    manifest: ManifestRequest
    chunk: ChunkRequest
    join: _admission_pb2.JoinRequest
    speed_check: SpeedCheck
    prefix_probe: PrefixProbe
    kv_put: _kv_tier_pb2.KVPut
    kv_get: _kv_tier_pb2.KVGet
    trace: _trace_pb2.TraceRequest
    def __init__(self, gossip: _Optional[_Union[_card_pb2.GossipMessage, _Mapping]] = ..., route: _Optional[_Union[RouteRequest, _Mapping]] = ..., placement: _Optional[_Union[PlacementOrder, _Mapping]] = ..., model_files: _Optional[_Union[ModelFilesRequest, _Mapping]] = ..., dialback: _Optional[_Union[DialbackRequest, _Mapping]] = ..., manifest: _Optional[_Union[ManifestRequest, _Mapping]] = ..., chunk: _Optional[_Union[ChunkRequest, _Mapping]] = ..., join: _Optional[_Union[_admission_pb2.JoinRequest, _Mapping]] = ..., speed_check: _Optional[_Union[SpeedCheck, _Mapping]] = ..., prefix_probe: _Optional[_Union[PrefixProbe, _Mapping]] = ..., kv_put: _Optional[_Union[_kv_tier_pb2.KVPut, _Mapping]] = ..., kv_get: _Optional[_Union[_kv_tier_pb2.KVGet, _Mapping]] = ..., trace: _Optional[_Union[_trace_pb2.TraceRequest, _Mapping]] = ...) -> None: ...

class PeerReply(_message.Message):
    __slots__ = ("accepted", "route", "no_route", "model_files", "dialback", "error", "manifest", "chunk", "joined", "speed_checked", "prefix_held", "kv_chunk", "kv_missing", "gossip", "traced")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    NO_ROUTE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FILES_FIELD_NUMBER: _ClassVar[int]
    DIALBACK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    SPEED_CHECKED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HELD_FIELD_NUMBER: _ClassVar[int]
    KV_CHUNK_FIELD_NUMBER: _ClassVar[int]
    KV_MISSING_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_FIELD_NUMBER: _ClassVar[int]
    TRACED_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    route: RouteReply
    no_route: NoRoute
    model_files: ModelFiles
    dialback: DialbackReply
    error: RpcError
    manifest: WeightsManifest
    chunk: TensorChunk
    joined: _admission_pb2.JoinReply
    speed_checked: SpeedChecked
    prefix_held: PrefixHeld
    kv_chunk: _kv_tier_pb2.KVChunk
    kv_missing: _kv_tier_pb2.KVMissing
    gossip: _card_pb2.GossipMessage
    traced: _trace_pb2.TraceReply
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., route: _Optional[_Union[RouteReply, _Mapping]] = ..., no_route: _Optional[_Union[NoRoute, _Mapping]] = ..., model_files: _Optional[_Union[ModelFiles, _Mapping]] = ..., dialback: _Optional[_Union[DialbackReply, _Mapping]] = ..., error: _Optional[_Union[RpcError, _Mapping]] = ..., manifest: _Optional[_Union[WeightsManifest, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., joined: _Optional[_Union[_admission_pb2.JoinReply, _Mapping]] = ..., speed_checked: _Optional[_Union[SpeedChecked, _Mapping]] = ..., prefix_held: _Optional[_Union[PrefixHeld, _Mapping]] = ..., kv_chunk: _Optional[_Union[_kv_tier_pb2.KVChunk, _Mapping]] = ..., kv_missing: _Optional[_Union[_kv_tier_pb2.KVMissing, _Mapping]] = ..., gossip: _Optional[_Union[_card_pb2.GossipMessage, _Mapping]] = ..., traced: _Optional[_Union[_trace_pb2.TraceReply, _Mapping]] = ...) -> None: ...
