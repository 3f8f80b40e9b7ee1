"""Files that are either whole or absent: readers (scripts, tests, the next start) never see half."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    """Write ``data`` to a sibling temporary file, flush it to disk, then rename it over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
