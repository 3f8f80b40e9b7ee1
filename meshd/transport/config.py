"""Transport settings, one object passed down from the daemon's config."""

from __future__ import annotations

from dataclasses import dataclass

from meshd.links.profiles import LinkShape
from meshd.transport.framing import DEFAULT_MAX_MESSAGE_BYTES

MAX_WINDOW = 2**31 - 1


@dataclass(frozen=True)
class TransportConfig:
    """Limits and timeouts of the peer transport.

    ``stream_window`` bounds what one stream may have in flight and buffered on the receiver; the
    connection window is sized so that it never binds before the stream windows do, so one stalled
    stream cannot starve the others on its connection.
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    connect_timeout: float = 10.0  # TCP connect + TLS + client auth, when dialling
    handshake_timeout: float = 10.0  # how long an inbound connection may take to authenticate
    stream_window: int = 1024 * 1024
    max_concurrent_streams: int = 256
    # Bytes of messages one connection's streams may hold received but not yet read whole (partial
    # messages, and whole ones waiting for their reader): a peer that sends more has the stream that
    # crossed the line reset. With the flow-control windows, this bounds what one peer can make us hold.
    max_buffered_bytes: int = 128 * 1024 * 1024
    max_header_list_bytes: int = 16 * 1024  # the headers of one stream, decoded
    max_handshakes: int = 128  # inbound connections authenticating at once; more are closed at once
    max_handshakes_per_host: int = 16
    max_inbound_connections: int = 1024  # authenticated inbound connections at once
    read_size: int = 64 * 1024
    relay_chunk_bytes: int = 64 * 1024  # largest WebSocket message sent through a relay
    # For testing and benchmarks: every connection's outgoing bytes, dialled or accepted, direct or
    # relayed, travel a modelled link of this shape (below TLS), except a peer's connection to itself,
    # which crosses no link. None: sent as they come.
    link_shape: LinkShape | None = None

    def __post_init__(self) -> None:
        if not 0 < self.max_message_bytes < 2**32:
            raise ValueError("max_message_bytes must fit the 4-byte length prefix")
        if not 65535 <= self.stream_window <= MAX_WINDOW:
            raise ValueError(f"stream_window must be between 65535 and {MAX_WINDOW}")
        if self.max_concurrent_streams < 1:
            raise ValueError("max_concurrent_streams must be at least 1")

    @property
    def connection_window(self) -> int:
        return min(MAX_WINDOW, self.stream_window * self.max_concurrent_streams)
