"""Client authentication inside the TLS channel (sans-IO), and why it is as strong as mutual TLS.

The server proves its identity in the TLS 1.3 handshake itself: its certificate carries its
Ed25519 identity key and TLS CertificateVerify signs the handshake transcript with that key, so a
client that checks the certificate's key against the peer id it dialled knows who it talks to.

Python's ``ssl`` cannot accept a self-signed client certificate (it has no verify callback), so
the client proves its key right after the handshake, before HTTP/2 starts:

    server -> client   MAGIC | nonce (32 random bytes)
    client -> server   MAGIC | client public key (32) | signature (64)
    server -> client   one status byte (0 = accepted); on rejection the server closes

The signature covers ``CONTEXT | nonce | sha256(server certificate DER) | client public key``.
The fresh nonce makes an old answer useless (no replay). Binding the server's certificate, as in
RFC 5929 ``tls-server-end-point``, stops relaying: a man in the middle that terminates TLS itself
presents its own certificate, so the answer the real client signs for it names the wrong
certificate and the real server refuses it. The exchange runs inside the encrypted channel, so
the result is the mutual authentication that client certificates would give.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from meshd.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_from_public_key, verify
from meshd.transport.errors import PeerAuthError

MAGIC = b"meshdCA1"
CONTEXT = b"meshd-client-auth-v1"
NONCE_BYTES = 32
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES
RESPONSE_BYTES = len(MAGIC) + PUBLIC_KEY_BYTES + SIGNATURE_BYTES
ACCEPTED = b"\x00"
REJECTED = b"\x01"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def encode_challenge(nonce: bytes) -> bytes:
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes")
    return MAGIC + nonce


def decode_challenge(data: bytes) -> bytes:
    if len(data) != CHALLENGE_BYTES or not data.startswith(MAGIC):
        raise PeerAuthError("server did not send a meshd client-auth challenge")
    return data[len(MAGIC) :]


def signed_payload(nonce: bytes, server_cert_der: bytes, client_public_key: bytes) -> bytes:
    """Exactly what the client signs: context, fresh nonce, server certificate hash, its own key."""
    return CONTEXT + nonce + hashlib.sha256(server_cert_der).digest() + client_public_key


def encode_response(identity: Identity, nonce: bytes, server_cert_der: bytes) -> bytes:
    signature = identity.sign(signed_payload(nonce, server_cert_der, identity.public_key))
    return MAGIC + identity.public_key + signature


@dataclass(frozen=True)
class ClientProof:
    public_key: bytes
    peer_id: str


def verify_response(data: bytes, nonce: bytes, own_cert_der: bytes) -> ClientProof:
    """Check a client's answer to our challenge; raise ``PeerAuthError`` saying what is wrong."""
    if len(data) != RESPONSE_BYTES or not data.startswith(MAGIC):
        raise PeerAuthError("client did not send a meshd client-auth response")
    body = data[len(MAGIC) :]
    public_key, signature = body[:PUBLIC_KEY_BYTES], body[PUBLIC_KEY_BYTES:]
    if not verify(public_key, signed_payload(nonce, own_cert_der, public_key), signature):
        raise PeerAuthError("client-auth signature does not verify for this nonce and server certificate")
    return ClientProof(public_key=public_key, peer_id=peer_id_from_public_key(public_key))
