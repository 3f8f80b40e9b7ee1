"""Errors the transport raises to its callers and handlers."""

from __future__ import annotations

from h2.errors import ErrorCodes

from meshd.errors import ErrorCode, MeshError


class TransportError(MeshError):
    """A connection or stream to a peer failed: unreachable, timed out, closed, or misused."""

    code = ErrorCode.TRANSPORT_ERROR


class PeerAuthError(TransportError):
    """The remote end did not prove it holds the identity key it claims (or that we expected)."""

    code = ErrorCode.PEER_AUTH


class StreamReset(TransportError):
    """The stream was reset, by the peer or by us; ``error_code`` is the HTTP/2 RST_STREAM code."""

    code = ErrorCode.STREAM_RESET

    def __init__(self, error_code: int, reason: str) -> None:
        self.error_code = error_code
        self.reason = reason
        super().__init__(f"stream reset ({_code_name(error_code)}): {reason}")


class FramingError(TransportError):
    """A stream's bytes are not a valid sequence of length-prefixed messages."""

    code: ErrorCode = ErrorCode.BAD_FRAMING
    error_code: int = ErrorCodes.PROTOCOL_ERROR


class MessageTooLarge(FramingError):
    """A message (announced or offered) is larger than ``max_message_bytes``."""

    code = ErrorCode.MESSAGE_TOO_LARGE
    error_code: int = ErrorCodes.FRAME_SIZE_ERROR


class BufferFull(MessageTooLarge):
    """The streams of one connection hold more unread bytes than ``max_buffered_bytes``."""

    error_code: int = ErrorCodes.ENHANCE_YOUR_CALM


def _code_name(error_code: int) -> str:
    try:
        return ErrorCodes(error_code).name
    except ValueError:
        return hex(error_code)
