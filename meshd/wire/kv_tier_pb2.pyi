from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVSnapshot(_message.Message):
    __slots__ = ("key", "model_id", "compat_key", "numerics", "range_start", "range_end", "length", "kv_heads", "head_dim", "dtype", "raw_bytes", "raw_sha256", "chunk_sha256", "publisher", "public_key", "signature")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    RANGE_START_FIELD_NUMBER: _ClassVar[int]
    RANGE_END_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAW_SHA256_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SHA256_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    model_id: str
    compat_key: str
    numerics: str
    range_start: int
    range_end: int
    length: int
    kv_heads: int
    head_dim: int
    dtype: str
    raw_bytes: int
    raw_sha256: bytes
    chunk_sha256: _containers.RepeatedScalarFieldContainer[bytes]
    publisher: str
    public_key: bytes
    signature: bytes
    def __init__(self, key: _Optional[bytes] = ..., model_id: _Optional[str] = ..., compat_key: _Optional[str] = ..., numerics: _Optional[str] = ..., range_start: _Optional[int] = ..., range_end: _Optional[int] = ..., length: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., raw_bytes: _Optional[int] = ..., raw_sha256: _Optional[bytes] = ..., chunk_sha256: _Optional[_Iterable[bytes]] = ..., publisher: _Optional[str] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class KVPut(_message.Message):
    __slots__ = ("snapshot", "index", "data")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    snapshot: KVSnapshot
    index: int
    data: bytes
    def __init__(self, snapshot: _Optional[_Union[KVSnapshot, _Mapping]] = ..., index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVGet(_message.Message):
    __slots__ = ("key", "compat_key", "range_start", "range_end", "index")
    KEY_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    RANGE_START_FIELD_NUMBER: _ClassVar[int]
    RANGE_END_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    compat_key: str
    range_start: int
    range_end: int
    index: int
    def __init__(self, key: _Optional[bytes] = ..., compat_key: _Optional[str] = ..., range_start: _Optional[int] = ..., range_end: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("snapshot", "index", "data")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    snapshot: KVSnapshot
    index: int
    data: bytes
    def __init__(self, snapshot: _Optional[_Union[KVSnapshot, _Mapping]] = ..., index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVMissing(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
