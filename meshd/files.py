"""Files that are either whole or absent: readers (scripts, tests, the next start) never see half."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def staged_file(path: Path) -> Iterator[Path]:
    """A sibling temporary path to write ``path`` through: moved over ``path`` when the block ends,
    removed if it raises (for writers that want a path, not bytes: GGUF and safetensors writers)."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    staging = Path(name)
    try:
        yield staging
        staging.replace(path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


@contextmanager
def staged_directory(path: Path) -> Iterator[Path]:
    """A sibling temporary directory to fill: it replaces ``path`` when the block ends, and is removed
    if it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield staging
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
