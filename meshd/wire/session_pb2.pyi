from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HopAddress(_message.Message):
    __slots__ = ("peer_id", "address", "range_start", "range_end")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANGE_START_FIELD_NUMBER: _ClassVar[int]
    RANGE_END_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    address: str
    range_start: int
    range_end: int
    def __init__(self, peer_id: _Optional[str] = ..., address: _Optional[str] = ..., range_start: _Optional[int] = ..., range_end: _Optional[int] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("session_id", "epoch", "model_id", "compat_key", "hops", "hop_index", "entry_peer_id", "max_tokens", "prompt_tokens", "unchanged_prefix", "resume_from_epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    HOP_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENTRY_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    model_id: str
    compat_key: str
    hops: _containers.RepeatedCompositeFieldContainer[HopAddress]
    hop_index: int
    entry_peer_id: str
    max_tokens: int
    prompt_tokens: int
    unchanged_prefix: int
    resume_from_epoch: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., model_id: _Optional[str] = ..., compat_key: _Optional[str] = ..., hops: _Optional[_Iterable[_Union[HopAddress, _Mapping]]] = ..., hop_index: _Optional[int] = ..., entry_peer_id: _Optional[str] = ..., max_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., unchanged_prefix: _Optional[int] = ..., resume_from_epoch: _Optional[int] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Close(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenResult(_message.Message):
    __slots__ = ("position", "token", "has_logprob", "logprob", "top")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    position: int
    token: int
    has_logprob: bool
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, position: _Optional[int] = ..., token: _Optional[int] = ..., has_logprob: _Optional[bool] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message", "peer_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    peer_id: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., peer_id: _Optional[str] = ...) -> None: ...

class SeamMessage(_message.Message):
    __slots__ = ("open", "bundle", "token", "error", "close", "ready")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    bundle: bytes
    token: TokenResult
    error: SessionError
    close: Close
    ready: Ready
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., bundle: _Optional[bytes] = ..., token: _Optional[_Union[TokenResult, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ..., ready: _Optional[_Union[Ready, _Mapping]] = ...) -> None: ...
