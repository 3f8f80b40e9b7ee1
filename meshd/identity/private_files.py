"""Files holding a secret of this peer (its identity key, its capture and prefix keys): created
private to the owner from the first byte, never overwritten, and refused when others can read them."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

MAX_SECRET_FILE_BYTES = 4096


class PrivateFileError(ValueError):
    """A secret's file is not a regular file private to its owner."""


def load_or_create_private(path: Path, make: Callable[[], bytes], what: str) -> tuple[bytes, bool]:
    """The bytes of ``path``, or ``make()``'s written there (mode 0600, in a directory of mode 0700
    when it is new) if the file does not exist yet; and whether it was created now. ``what`` names
    the secret in errors."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        # O_EXCL: never overwrite a secret another process just wrote; 0600 from the start, so it is
        # never on disk with wider permissions even for an instant.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_private(path, what), False
    data = make()
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return data, True


def read_private(path: Path, what: str) -> bytes:
    """The bytes of ``path``, once it is a regular file (not a link) that only its owner may read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise PrivateFileError(f"{what} {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PrivateFileError(f"{what} {path} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise PrivateFileError(f"{what} {path} is accessible by group or others (mode {mode:04o}); "
                                   f"it must be private to its owner: chmod 600 {path}")
        return os.read(fd, MAX_SECRET_FILE_BYTES)
    finally:
        os.close(fd)
