"""Authenticated, encrypted HTTP/2 between peers, on Trio.

Every link is TLS 1.3 whose certificate key is the server's Ed25519 identity key; the client
proves its own key inside the channel (see ``meshd.transport.auth``). Each side therefore knows
the other's peer id. One connection per peer carries many HTTP/2 streams; each stream body is a
sequence of length-prefixed messages, so one long-lived stream can carry a whole session.

Public API::

    async with Transport(identity, config=None, **TransportConfig fields) as transport:
        port = await nursery.start(transport.serve, "HOST:PORT", handler)   # also transport.listen_port
        stream = await transport.open_stream(peer_id | None, address, path, headers=None)
        reply = await transport.request(peer_id | None, address, path, body, timeout=30.0)
        await transport.accept_stream(byte_stream, handler, remote)   # inbound link on any trio Stream

    An address is a :class:`meshd.address.Address` or its text: direct ``HOST:PORT`` or a relay
    address ``relay:HOST:PORT`` (see ``meshd.transport.relay``): the same TLS, client authentication
    and HTTP/2 then run through a ``meshd-relay`` inside WebSockets, end to end.

    async def handler(stream: Stream) -> None      # one task per incoming stream
        stream.path, stream.headers, stream.peer_id (proven remote id)

    Stream: await send_message(bytes); await receive_message() -> bytes | None (None: peer ended);
            async for message in stream; await end() (half-close); await reset(error_code);
            await aclose() / async with stream; responder: await respond(status, headers) (optional,
            status 200 is sent with the first message otherwise); requester: await receive_headers().

Errors: ``TransportError`` (base), ``PeerAuthError``, ``StreamReset(error_code, reason)``,
``FramingError`` and ``MessageTooLarge`` (the offending stream is reset, the connection lives on).
The sans-IO pieces are ``framing.MessageDecoder`` and ``auth``; ``connection`` adapts ``h2``.
The planes above depend only on the protocols of ``streams`` (``MessageStream``, ``StreamOpener``).
"""

from h2.errors import ErrorCodes

from meshd.transport.config import TransportConfig
from meshd.transport.connection import Connection, Handler, Stream
from meshd.transport.errors import FramingError, MessageTooLarge, PeerAuthError, StreamReset, TransportError
from meshd.transport.framing import DEFAULT_MAX_MESSAGE_BYTES, MessageDecoder, encode_message
from meshd.transport.streams import MessageStream, StreamHandler, StreamOpener
from meshd.transport.transport import Transport

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Connection",
    "ErrorCodes",
    "FramingError",
    "Handler",
    "MessageDecoder",
    "MessageStream",
    "MessageTooLarge",
    "PeerAuthError",
    "Stream",
    "StreamHandler",
    "StreamOpener",
    "StreamReset",
    "Transport",
    "TransportConfig",
    "TransportError",
    "encode_message",
]
