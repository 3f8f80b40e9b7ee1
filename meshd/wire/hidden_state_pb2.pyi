from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PREFILL: _ClassVar[Phase]
    DECODE: _ClassVar[Phase]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]

class TensorEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RAW: _ClassVar[TensorEncoding]
    ZSTD_BYTE_PLANES: _ClassVar[TensorEncoding]
PHASE_UNSPECIFIED: Phase
PREFILL: Phase
DECODE: Phase
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT32: DType
RAW: TensorEncoding
ZSTD_BYTE_PLANES: TensorEncoding

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "encoding")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    encoding: TensorEncoding
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., encoding: _Optional[_Union[TensorEncoding, str]] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: bool
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class HiddenStateBundle(_message.Message):
    __slots__ = ("version", "session_id", "epoch", "step", "phase", "start_position", "token_count", "tensors", "range_start", "range_end", "sample", "sampling", "sent_at_ns", "draft", "prefix", "keep_prefix")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    RANGE_START_FIELD_NUMBER: _ClassVar[int]
    RANGE_END_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    KEEP_PREFIX_FIELD_NUMBER: _ClassVar[int]
    version: int
    session_id: str
    epoch: int
    step: int
    phase: Phase
    start_position: int
    token_count: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    range_start: int
    range_end: int
    sample: bool
    sampling: Sampling
    sent_at_ns: int
    draft: _containers.RepeatedScalarFieldContainer[int]
    prefix: bytes
    keep_prefix: bytes
    def __init__(self, version: _Optional[int] = ..., session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., start_position: _Optional[int] = ..., token_count: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., range_start: _Optional[int] = ..., range_end: _Optional[int] = ..., sample: _Optional[bool] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., sent_at_ns: _Optional[int] = ..., draft: _Optional[_Iterable[int]] = ..., prefix: _Optional[bytes] = ..., keep_prefix: _Optional[bytes] = ...) -> None: ...
