"""Establishing an authenticated channel over a byte stream (Trio adapter around ``auth``).

Both functions return an ``SSLStream`` positioned right where HTTP/2 starts, and the proven peer
id of the other end. Callers bound them with a timeout.
"""

from __future__ import annotations

import ssl

import trio

from meshd.identity import Identity
from meshd.transport import auth
from meshd.transport.errors import PeerAuthError, TransportError
from meshd.transport.tls import ALPN, peer_id_from_certificate


async def receive_exactly(stream: trio.abc.ReceiveStream, size: int) -> bytes:
    """Read exactly ``size`` bytes, never more, so nothing after them is consumed."""
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        if not chunk:
            raise TransportError(f"connection closed during the handshake ({len(data)} of {size} bytes)")
        data += chunk
    return bytes(data)


async def client_handshake(
    transport_stream: trio.abc.Stream,
    context: ssl.SSLContext,
    identity: Identity,
    expected_peer_id: str | None,
) -> tuple[trio.SSLStream, str]:
    """TLS, check the server's key against ``expected_peer_id`` (any if None), then prove our own key."""
    stream = trio.SSLStream(transport_stream, context, server_hostname=None)
    await stream.do_handshake()
    server_der = stream.getpeercert(binary_form=True)
    peer_id = peer_id_from_certificate(server_der)
    if expected_peer_id is not None and peer_id != expected_peer_id:
        raise PeerAuthError(f"dialled peer {expected_peer_id} but the server proved identity {peer_id}")
    if stream.selected_alpn_protocol() != ALPN:
        raise TransportError(f"server did not agree to {ALPN} (ALPN {stream.selected_alpn_protocol()!r})")
    nonce = auth.decode_challenge(await receive_exactly(stream, auth.CHALLENGE_BYTES))
    await stream.send_all(auth.encode_response(identity, nonce, server_der))
    if await receive_exactly(stream, 1) != auth.ACCEPTED:
        raise PeerAuthError(f"peer {peer_id} rejected our client authentication")
    return stream, peer_id


async def server_handshake(
    transport_stream: trio.abc.Stream, context: ssl.SSLContext, own_cert_der: bytes
) -> tuple[trio.SSLStream, str]:
    """TLS, then challenge the client to sign a fresh nonce bound to our certificate."""
    stream = trio.SSLStream(transport_stream, context, server_side=True)
    await stream.do_handshake()
    nonce = auth.new_nonce()
    await stream.send_all(auth.encode_challenge(nonce))
    response = await receive_exactly(stream, auth.RESPONSE_BYTES)
    try:
        proof = auth.verify_response(response, nonce, own_cert_der)
    except PeerAuthError:
        await stream.send_all(auth.REJECTED)
        raise
    await stream.send_all(auth.ACCEPTED)
    return stream, proof.peer_id
