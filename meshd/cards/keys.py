"""Peer ids and Ed25519 signatures as cards and leases use them.

A peer id is derived from the public key, so any record that carries both is self-certifying: a
receiver needs no registry to know which key may speak for which peer.
"""

from __future__ import annotations

import base64
import hashlib

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def peer_id_from_public_key(public_key: bytes) -> str:
    """Lowercase unpadded base32 of the first 20 bytes of blake2b-256 of the key."""
    digest = hashlib.blake2b(public_key, digest_size=32).digest()[:20]
    return base64.b32encode(digest).decode("ascii").lower().rstrip("=")


def peer_id_of(signing_key: SigningKey) -> str:
    return peer_id_from_public_key(bytes(signing_key.verify_key))


def sign(signing_key: SigningKey, payload: bytes) -> bytes:
    """Detached signature over exactly ``payload``."""
    return signing_key.sign(payload).signature


def signature_valid(public_key: bytes, payload: bytes, signature: bytes) -> bool:
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        VerifyKey(public_key).verify(payload, signature)
    except BadSignatureError:
        return False
    return True
