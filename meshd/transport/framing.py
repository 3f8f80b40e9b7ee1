"""Length-prefixed messages on an HTTP/2 stream body (sans-IO).

One stream carries many messages (a seam keeps one stream per session for every decode step), so
the body is cut into messages: a 4-byte big-endian length, then that many payload bytes. The
decoder checks the announced length before buffering anything, so an oversized or garbage prefix
costs nothing but the reset of its own stream.
"""

from __future__ import annotations

import struct

from meshd.transport.errors import FramingError, MessageTooLarge

LENGTH_PREFIX = struct.Struct(">I")
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def encode_message(payload: bytes, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """The length prefix and the payload, ready to send."""
    if len(payload) > max_message_bytes:
        raise MessageTooLarge(f"message of {len(payload)} bytes exceeds the limit of {max_message_bytes}")
    return LENGTH_PREFIX.pack(len(payload)) + payload


class MessageDecoder:
    """Feed stream bytes in, get whole messages out; any error poisons the decoder for good."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self._buffer = bytearray()
        self._expected: int | None = None
        self._error: FramingError | None = None

    @property
    def pending(self) -> bool:
        """Whether part of a message is buffered (ending the stream now would truncate it)."""
        return bool(self._buffer) or self._expected is not None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for a message not complete yet."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        if self._error is not None:
            raise self._error
        self._buffer += data
        messages: list[bytes] = []
        while True:
            if self._expected is None:
                if len(self._buffer) < LENGTH_PREFIX.size:
                    return messages
                (length,) = LENGTH_PREFIX.unpack_from(self._buffer)
                if length > self.max_message_bytes:
                    self._error = MessageTooLarge(
                        f"peer announced a {length}-byte message; the limit is {self.max_message_bytes}"
                    )
                    self._buffer.clear()
                    raise self._error
                del self._buffer[: LENGTH_PREFIX.size]
                self._expected = length
            if len(self._buffer) < self._expected:
                return messages
            messages.append(bytes(self._buffer[: self._expected]))
            del self._buffer[: self._expected]
            self._expected = None

    def end(self) -> None:
        """The stream ended: raise if it stopped in the middle of a message."""
        if self._error is not None:
            raise self._error
        if self.pending:
            have = len(self._buffer)
            want = "a length prefix" if self._expected is None else f"{self._expected} bytes"
            self._error = FramingError(f"stream ended inside a message: expected {want}, got {have} bytes")
            raise self._error
