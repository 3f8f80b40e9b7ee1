"""Peer identity: key file handling, peer ids, signatures."""

from __future__ import annotations

import os
import stat

import pytest

from meshd.identity import (
    KEY_FILE_NAME,
    Identity,
    IdentityError,
    peer_id_from_public_key,
    public_key_matches,
    verify,
)


def test_key_file_is_created_private(tmp_path):
    identity = Identity.load_or_create(tmp_path / "data")
    path = tmp_path / "data" / KEY_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(identity.public_key) == 32
    assert len(identity.peer_id) == 32
    assert identity.peer_id == identity.peer_id.lower()


def test_reload_gives_the_same_identity(tmp_path):
    first = Identity.load_or_create(tmp_path)
    second = Identity.load_or_create(tmp_path)
    assert first.peer_id == second.peer_id
    assert first.public_key == second.public_key


def test_raw_seed_file_is_accepted(tmp_path):
    seed = bytes(range(32))
    path = tmp_path / KEY_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, seed)
    os.close(fd)
    assert Identity.load_or_create(tmp_path).seed == seed


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_refuses_key_readable_by_others(tmp_path, mode):
    Identity.load_or_create(tmp_path)
    path = tmp_path / KEY_FILE_NAME
    path.chmod(mode)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load_or_create(tmp_path)


def test_refuses_malformed_key(tmp_path):
    path = tmp_path / KEY_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"not a key")
    os.close(fd)
    with pytest.raises(IdentityError, match="neither"):
        Identity.load_or_create(tmp_path)


def test_peer_id_matches_key():
    identity = Identity.generate()
    other = Identity.generate()
    assert peer_id_from_public_key(identity.public_key) == identity.peer_id
    assert public_key_matches(identity.peer_id, identity.public_key)
    assert not public_key_matches(identity.peer_id, other.public_key)
    assert not public_key_matches(identity.peer_id, b"short")
    assert identity.peer_id != other.peer_id
    with pytest.raises(ValueError):
        peer_id_from_public_key(b"\x00" * 31)


def test_verify_accepts_genuine_and_rejects_tampered():
    identity = Identity.generate()
    signature = identity.sign(b"card")
    assert len(signature) == 64
    assert verify(identity.public_key, b"card", signature)
    assert not verify(identity.public_key, b"card!", signature)
    assert not verify(identity.public_key, b"card", bytes(64))
    assert not verify(Identity.generate().public_key, b"card", signature)
    # Malformed input is a failed check, never an exception.
    assert not verify(b"short", b"card", signature)
    assert not verify(identity.public_key, b"card", b"short")
