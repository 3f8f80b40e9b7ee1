from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Accusation(_message.Message):
    __slots__ = ("accuser", "accuser_key", "accused", "model_id", "compat_key", "prompt", "expected", "got", "at_ms")
    ACCUSER_FIELD_NUMBER: _ClassVar[int]
    ACCUSER_KEY_FIELD_NUMBER: _ClassVar[int]
    ACCUSED_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    GOT_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    accuser: str
    accuser_key: bytes
    accused: str
    model_id: str
    compat_key: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    expected: _containers.RepeatedScalarFieldContainer[int]
    got: _containers.RepeatedScalarFieldContainer[int]
    at_ms: int
    def __init__(self, accuser: _Optional[str] = ..., accuser_key: _Optional[bytes] = ..., accused: _Optional[str] = ..., model_id: _Optional[str] = ..., compat_key: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., expected: _Optional[_Iterable[int]] = ..., got: _Optional[_Iterable[int]] = ..., at_ms: _Optional[int] = ...) -> None: ...

class SignedAccusation(_message.Message):
    __slots__ = ("accusation", "signature")
    ACCUSATION_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    accusation: bytes
    signature: bytes
    def __init__(self, accusation: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...
