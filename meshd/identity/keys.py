"""A peer's Ed25519 identity: the key file, signing, and the peer id derived from the public key.

The peer id is a hash of the public key rather than the key itself so that it is short enough for
logs and certificate names, yet anyone holding the key can check it against the id.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import nacl.exceptions
import nacl.signing

from meshd.errors import ErrorCode, MeshError
from meshd.identity.private_files import PrivateFileError, load_or_create_private

KEY_FILE_NAME = "identity.key"
PUBLIC_KEY_BYTES = 32
SEED_BYTES = 32
SIGNATURE_BYTES = 64
_PEER_ID_DIGEST_BYTES = 20


class IdentityError(MeshError):
    """The identity key file is missing, malformed or not private to its owner."""

    code = ErrorCode.BAD_IDENTITY


def is_peer_id(text: str) -> bool:
    """Whether ``text`` has the form of a peer id (what :func:`peer_id_from_public_key` gives)."""
    return len(text) == 32 and all(c in "abcdefghijklmnopqrstuvwxyz234567" for c in text)


def peer_id_from_public_key(public_key: bytes) -> str:
    """Return the peer id of an Ed25519 public key: base32 of a 160-bit blake2b digest, lowercase, unpadded."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    digest = hashlib.blake2b(public_key, digest_size=32).digest()[:_PEER_ID_DIGEST_BYTES]
    return base64.b32encode(digest).decode("ascii").lower().rstrip("=")


def public_key_matches(peer_id: str, public_key: bytes) -> bool:
    """Whether ``public_key`` is the key that ``peer_id`` names."""
    try:
        return peer_id_from_public_key(bytes(public_key)) == peer_id
    except (TypeError, ValueError):
        return False


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Check a detached Ed25519 signature; any malformed input is simply a failed check."""
    try:
        nacl.signing.VerifyKey(bytes(public_key)).verify(bytes(data), bytes(signature))
    except (nacl.exceptions.CryptoError, ValueError, TypeError):
        return False
    return True


class Identity:
    """An Ed25519 signing key and the peer id it implies."""

    def __init__(self, signing_key: nacl.signing.SigningKey) -> None:
        self._signing_key = signing_key
        self.public_key: bytes = signing_key.verify_key.encode()
        self.peer_id: str = peer_id_from_public_key(self.public_key)

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity of a 32-byte seed (tests and simulations derive many from fixed seeds)."""
        if len(seed) != SEED_BYTES:
            raise IdentityError(f"a seed is {SEED_BYTES} bytes, got {len(seed)}")
        return cls(nacl.signing.SigningKey(bytes(seed)))

    @classmethod
    def generate(cls) -> Identity:
        """A fresh identity that lives only in memory (tests, throwaway peers)."""
        return cls(nacl.signing.SigningKey.generate())

    @classmethod
    def load_or_create(cls, data_dir: Path, file_name: str = KEY_FILE_NAME) -> Identity:
        """Load ``data_dir/identity.key`` (or ``file_name``), creating it (mode 0600) on first run."""
        path = Path(data_dir) / file_name
        try:
            raw, _created = load_or_create_private(
                path, lambda: bytes(nacl.signing.SigningKey.generate()).hex().encode("ascii") + b"\n", "identity key")
        except PrivateFileError as exc:
            raise IdentityError(str(exc)) from None
        return cls(nacl.signing.SigningKey(_parse_seed(raw, path)))

    @property
    def seed(self) -> bytes:
        """The 32-byte private seed; needed to put this key in a TLS certificate."""
        return bytes(self._signing_key)

    def sign(self, data: bytes) -> bytes:
        """A 64-byte detached signature over ``data``."""
        return self._signing_key.sign(bytes(data)).signature

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id!r})"


def _parse_seed(raw: bytes, path: Path) -> bytes:
    if len(raw) == SEED_BYTES:
        return raw
    text = raw.strip()
    if len(text) == 2 * SEED_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise IdentityError(f"identity key {path} is neither a raw 32-byte seed nor 64 hex characters")
