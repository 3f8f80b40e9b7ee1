"""One shard compute at a time among the meshd peers that compute on one machine's CPUs.

Every peer computes with as many threads as the machine has cores. Peers that share a machine (a
route's hops on one box, or sessions of two routes) and compute at the same time run twice the
threads there are cores; OpenMP's threads then wait at every barrier for a partner the kernel has
descheduled, and both computes slow down far more than twice. Taking turns, each compute has all
the cores, which is what the cost tables and the batcher assume. The turn is an exclusive
``flock`` on one file per machine: the kernel hands it on when a holder ends its compute or dies,
and a peer alone on its machine takes it at the cost of two system calls.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = "meshd-cpu-compute.lock"


def default_lock_path() -> Path:
    """One path for every meshd process of the machine, whoever runs it; ``MESHD_CPU_TURN_LOCK`` overrides
    it (``MESHD_CPU_TURN`` is the setting that turns taking turns on or off)."""
    return Path(os.environ.get("MESHD_CPU_TURN_LOCK") or Path(tempfile.gettempdir()) / LOCK_NAME)


class CpuTurn:
    """``with turn:`` around a compute holds the machine's CPU turn for it."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_lock_path()
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            old = os.umask(0)
            try:  # readable and writable by all: peers of other users take turns on it too
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except PermissionError:  # made by another user without write access: a read-only lock works
                self._fd = os.open(self.path, os.O_RDONLY)
            finally:
                os.umask(old)
        return self._fd

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        fd = self._open()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
