"""Peer identity: one Ed25519 key per peer, stored in its data directory.

- ``Identity.load_or_create(data_dir)`` loads ``identity.key`` or creates it (mode 0600); a key
  file readable by anyone but its owner is refused.
- ``Identity.public_key`` (32 bytes), ``Identity.peer_id`` (32 lowercase base32 characters),
  ``Identity.sign(data)`` (64-byte detached signature).
- ``peer_id_from_public_key``, ``public_key_matches`` and ``verify`` check what other peers present.
"""

from meshd.identity.keys import (
    KEY_FILE_NAME,
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    IdentityError,
    peer_id_from_public_key,
    public_key_matches,
    verify,
)

__all__ = [
    "KEY_FILE_NAME",
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "Identity",
    "IdentityError",
    "peer_id_from_public_key",
    "public_key_matches",
    "verify",
]
