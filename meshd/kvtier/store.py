"""The memory a KV-tier peer lends: signed prefix snapshots of hops, bounded in bytes.

Chunks of a snapshot arrive one request at a time, each with the signed description; the snapshot
is served once all have arrived. A chunk is checked against its digest and its description's
signature before it is kept, and only its publisher may put it, so the tier holds nothing a hop did
not compute and sign. Snapshots being assembled are bounded too, and dropped when their upload stops
for ``PENDING_S``. Complete snapshots are evicted least recently used first. Nothing here does I/O;
the clock is given.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from meshd.errors import ErrorCode, MeshError
from meshd.kvtier.snapshots import SnapshotRefused, check_chunk, check_description
from meshd.wire import kv_tier_pb2 as pb

PENDING_S = 60.0
ENTRY_BYTES = 1024  # what keeping a snapshot costs beyond its description and chunks, counted as its bytes

TierKey = tuple[bytes, str, int, int]  # (scoped name, compat key, range start, range end)


class TierRefused(MeshError):
    """A chunk the tier does not keep: not signed by its sender, not intact, or larger than the tier."""

    code = ErrorCode.BAD_REQUEST


@dataclass
class _Entry:
    """A snapshot held: its bytes count its description and a fixed cost too, so that snapshots of
    empty chunks cannot be kept without bound."""

    snapshot: pb.KVSnapshot
    chunks: list[bytes | None]
    nbytes: int = 0
    touched: float = 0.0
    missing: int = field(init=False)

    def __post_init__(self) -> None:
        self.missing = sum(1 for c in self.chunks if c is None)
        self.nbytes += ENTRY_BYTES + self.snapshot.ByteSize() + 8 * len(self.chunks)


def tier_key(snapshot: pb.KVSnapshot) -> TierKey:
    return (snapshot.key, snapshot.compat_key, snapshot.range_start, snapshot.range_end)


class TierStore:
    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 1:
            raise ValueError("a KV tier lends at least one byte")
        self.max_bytes = max_bytes
        self._clock = clock
        self._complete: OrderedDict[TierKey, _Entry] = OrderedDict()
        self._pending: dict[TierKey, _Entry] = {}
        self._used = 0  # the bytes of every entry held, complete or pending
        self.puts = 0
        self.gets = 0
        self.misses = 0
        self.refused = 0
        self.evicted = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def _drop_pending(self, key: TierKey) -> None:
        self._used -= self._pending.pop(key).nbytes

    def _drop_complete(self, key: TierKey | None = None) -> None:
        """Drop ``key``, or the least recently used snapshot."""
        if key is None:
            _key, entry = self._complete.popitem(last=False)
        else:
            entry = self._complete.pop(key)
        self._used -= entry.nbytes

    def put(self, sender: str, put: pb.KVPut) -> None:
        """Keep one chunk from ``sender``; the snapshot is served once its last chunk is in."""
        snapshot = put.snapshot
        try:
            check_description(snapshot)
            check_chunk(snapshot, put.index, put.data)
        except SnapshotRefused as exc:
            self.refused += 1
            raise TierRefused(str(exc)) from None
        if snapshot.publisher != sender:
            self.refused += 1
            raise TierRefused("only the hop that computed a snapshot may put it")
        self._expire()
        key = tier_key(snapshot)
        entry = self._pending.get(key)
        if entry is None or entry.snapshot.SerializeToString(deterministic=True) != snapshot.SerializeToString(
                deterministic=True):
            if entry is not None:
                self._drop_pending(key)
            entry = self._pending[key] = _Entry(snapshot, [None] * len(snapshot.chunk_sha256))
            self._used += entry.nbytes
        if entry.chunks[put.index] is None:
            entry.chunks[put.index] = put.data
            entry.nbytes += len(put.data)
            self._used += len(put.data)
            entry.missing -= 1
        entry.touched = self._clock()
        self.puts += 1
        if entry.nbytes > self.max_bytes:
            self._drop_pending(key)
            self.refused += 1
            raise TierRefused(f"the snapshot is larger than this tier's {self.max_bytes} bytes")
        while self._used > self.max_bytes and self._complete:
            self._drop_complete()
            self.evicted += 1
        if self._used > self.max_bytes:
            self._drop_pending(key)
            self.refused += 1
            raise TierRefused("this tier is full of snapshots still being put")
        if entry.missing == 0:
            del self._pending[key]  # its bytes stay counted: it moves to the complete ones
            if key in self._complete:
                self._drop_complete(key)
            self._complete[key] = entry

    def get(self, get: pb.KVGet) -> pb.KVChunk | None:
        """Chunk ``get.index`` of a complete snapshot, or None when the tier does not hold it."""
        key = (get.key, get.compat_key, get.range_start, get.range_end)
        entry = self._complete.get(key)
        if entry is None or not 0 <= get.index < len(entry.chunks):
            self.misses += 1
            return None
        self._complete.move_to_end(key)
        self.gets += 1
        data = entry.chunks[get.index]
        assert data is not None
        return pb.KVChunk(snapshot=entry.snapshot, index=get.index, data=data)

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, e in self._pending.items() if now - e.touched > PENDING_S]:
            self._drop_pending(key)

    def summary(self) -> dict[str, object]:
        return {"snapshots": len(self._complete), "pending": len(self._pending), "bytes": self.used_bytes,
                "max_bytes": self.max_bytes, "puts": self.puts, "gets": self.gets, "misses": self.misses,
                "refused": self.refused, "evicted": self.evicted}
