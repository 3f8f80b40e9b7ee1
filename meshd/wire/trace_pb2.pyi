from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class TraceRequest(_message.Message):
    __slots__ = ("model_id", "compat_key", "range_start", "range_end", "input", "prefill_tokens", "chunk_tokens", "layers")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    RANGE_START_FIELD_NUMBER: _ClassVar[int]
    RANGE_END_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    compat_key: str
    range_start: int
    range_end: int
    input: bytes
    prefill_tokens: int
    chunk_tokens: int
    layers: bool
    def __init__(self, model_id: _Optional[str] = ..., compat_key: _Optional[str] = ..., range_start: _Optional[int] = ..., range_end: _Optional[int] = ..., input: _Optional[bytes] = ..., prefill_tokens: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., layers: _Optional[bool] = ...) -> None: ...

class TraceReply(_message.Message):
    __slots__ = ("output", "numerics", "compute_ms")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    output: bytes
    numerics: str
    compute_ms: float
    def __init__(self, output: _Optional[bytes] = ..., numerics: _Optional[str] = ..., compute_ms: _Optional[float] = ...) -> None: ...
