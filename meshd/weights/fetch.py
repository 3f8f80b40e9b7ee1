"""Fetching the tensors of a range from the peers that hold them: in chunks, from several at once,
each chunk checked on arrival, resumable.

Every tensor is fetched in the 1 MiB chunks the manifest hashes. Each source gets a few workers that
take the next chunk nobody holds yet; a chunk is kept only when its bytes hash to what the manifest
lists, and is written straight into the tensor's part file in a staging folder. A source that sends
a chunk that does not match is dropped at once and the chunk goes back for another source; one that
cannot be reached a few times running is dropped too. Nothing is lost when the fetch stops: the part
files stay, and the next fetch hashes what they hold and asks only for the chunks still missing.
Once every chunk is in, the tensors are written as one safetensors file of the model directory, and
the staging folder is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from meshd.errors import ErrorCode, MeshError
from meshd.files import staged_file
from meshd.progress import progress
from meshd.runtime.loader import SINGLE_FILE, SafetensorsIndex
from meshd.runtime.manifest import CHUNK_BYTES, TensorEntry

log = logging.getLogger("meshd.weights")

WORKERS_PER_SOURCE = 2
UNREACHABLE_LIMIT = 3  # failures in a row before a source is dropped
WAIT_S = 0.01          # how often an idle worker looks for chunks handed back by others

Ask = Callable[[str, TensorEntry, int], Awaitable[bytes]]
"""``ask(source peer id, tensor, chunk index)`` -> the chunk's bytes, or raises :class:`SourceFailed`."""


class WeightsUnavailable(MeshError):
    """The tensors of a range could not be fetched from any peer."""

    code = ErrorCode.NO_ROUTE


class SourceFailed(Exception):
    """A source could not hand out a chunk: ``lacks`` when it does not hold the tensor."""

    def __init__(self, reason: str, lacks: bool = False) -> None:
        super().__init__(reason)
        self.lacks = lacks


@dataclass
class FetchStats:
    """What one fetch did, for the status and the logs."""

    tensors: int = 0
    bytes_needed: int = 0
    bytes_on_disk: int = 0       # already held (a resumed fetch, or tensors of an earlier range)
    bytes_fetched: int = 0       # received and verified
    bytes_discarded: int = 0     # received and thrown away: they did not match the manifest
    by_source: dict[str, int] = field(default_factory=dict)  # verified bytes per source
    dropped: dict[str, str] = field(default_factory=dict)    # source -> why it was dropped

    def as_json(self) -> dict[str, object]:
        return {"tensors": self.tensors, "bytes_needed": self.bytes_needed, "bytes_on_disk": self.bytes_on_disk,
                "bytes_fetched": self.bytes_fetched, "bytes_discarded": self.bytes_discarded,
                "by_source": dict(self.by_source), "dropped": dict(self.dropped)}


def _part_path(staging: Path, entry: TensorEntry) -> Path:
    return staging / f"{hashlib.sha256(entry.name.encode()).hexdigest()[:24]}.part"


def _held_chunks(staging: Path, entry: TensorEntry) -> set[int]:
    """The chunks of the tensor's part file that already match the manifest (creating the file if absent)."""
    path = _part_path(staging, entry)
    held: set[int] = set()
    if path.is_file() and path.stat().st_size == entry.nbytes:
        with path.open("rb") as f:
            for i, expected in enumerate(entry.chunks):
                if hashlib.sha256(f.read(CHUNK_BYTES)).hexdigest() == expected:
                    held.add(i)
        return held
    with path.open("wb") as f:
        f.truncate(entry.nbytes)
    return held


def seed_from(model_dir: Path, staging: Path, entries: list[TensorEntry]) -> None:
    """Copy into ``staging`` the tensors the model directory already holds (an earlier range's), so
    they are checked and kept rather than fetched again."""
    staging.mkdir(parents=True, exist_ok=True)
    if not (model_dir / SINGLE_FILE).is_file():
        return
    index = SafetensorsIndex(model_dir)
    for entry in entries:
        part = _part_path(staging, entry)
        if entry.name not in index or part.is_file():
            continue
        path, start, nbytes = index.location(entry.name)
        if nbytes != entry.nbytes:
            continue
        with path.open("rb") as src, part.open("wb") as dst:
            src.seek(start)
            for offset in range(0, nbytes, CHUNK_BYTES):
                dst.write(src.read(min(CHUNK_BYTES, nbytes - offset)))


def _write_chunk(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)


async def fetch_chunks(entries: list[TensorEntry], sources: list[str], ask: Ask, staging: Path,
                       what: str = "weights", stats: FetchStats | None = None,
                       workers_per_source: int = WORKERS_PER_SOURCE) -> FetchStats:
    """Fill ``staging`` with part files holding exactly the tensors of ``entries``, asking ``sources``;
    ``stats`` (when given) is kept current as the fetch goes."""
    staging.mkdir(parents=True, exist_ok=True)
    stats = stats if stats is not None else FetchStats()
    stats.tensors, stats.bytes_needed = len(entries), sum(e.nbytes for e in entries)
    pending: deque[tuple[TensorEntry, int]] = deque()
    for entry in entries:
        held = await trio.to_thread.run_sync(_held_chunks, staging, entry)
        stats.bytes_on_disk += sum(entry.chunk_span(i)[1] for i in held)
        pending.extend((entry, i) for i in range(len(entry.chunks)) if i not in held)
    if stats.bytes_on_disk:
        log.info("%s: %.1f of %.1f MB already on disk", what, stats.bytes_on_disk / 1e6, stats.bytes_needed / 1e6)
    remaining = len(pending)
    in_flight = 0
    lacking: dict[str, set[str]] = {s: set() for s in sources}
    failures: dict[str, int] = dict.fromkeys(sources, 0)

    def drop(source: str, reason: str) -> None:
        if source not in stats.dropped:
            stats.dropped[source] = reason
            log.warning("%s: dropped source %s: %s", what, source[:12], reason)

    def next_for(source: str) -> tuple[TensorEntry, int] | None:
        for k, item in enumerate(pending):
            if item[0].name not in lacking[source]:
                del pending[k]
                return item
        return None

    with progress(f"fetching {what}", remaining, "chunks", logger=log, draw=False) as bar:

        async def worker(source: str) -> None:
            nonlocal remaining, in_flight
            while remaining and source not in stats.dropped:
                item = next_for(source)
                if item is None:
                    if not in_flight:  # what is left is what this source lacks, and nothing can come back
                        return
                    await trio.sleep(WAIT_S)  # chunks in flight elsewhere may come back
                    continue
                entry, index = item
                offset, length = entry.chunk_span(index)
                in_flight += 1
                try:
                    data = await ask(source, entry, index)
                except SourceFailed as exc:
                    in_flight -= 1
                    pending.appendleft(item)
                    if exc.lacks:
                        lacking[source].add(entry.name)
                        continue
                    failures[source] += 1
                    if failures[source] >= UNREACHABLE_LIMIT:
                        drop(source, f"failed {failures[source]} times in a row: {exc}")
                    continue
                in_flight -= 1
                if len(data) != length or hashlib.sha256(data).hexdigest() != entry.chunks[index]:
                    pending.appendleft(item)
                    stats.bytes_discarded += len(data)
                    drop(source, f"sent chunk {index} of {entry.name} that does not match the manifest")
                    return
                failures[source] = 0
                await trio.to_thread.run_sync(_write_chunk, _part_path(staging, entry), offset, data)
                stats.bytes_fetched += length
                stats.by_source[source] = stats.by_source.get(source, 0) + length
                remaining -= 1
                bar.advance(note=f"{stats.bytes_fetched / 1e6:.0f} MB")

        async with trio.open_nursery() as nursery:
            for source in sources:
                for _ in range(workers_per_source):
                    nursery.start_soon(worker, source)
    if remaining:
        reasons = "; ".join(f"{s[:12]}: {r}" for s, r in stats.dropped.items()) or "no peer holds them"
        raise WeightsUnavailable(f"{remaining} chunks of {what} could not be fetched ({reasons}); "
                                 "what was fetched is kept for the next try")
    return stats


def assemble(staging: Path, entries: list[TensorEntry], model_dir: Path) -> None:
    """Write the fetched tensors as the model directory's safetensors file, then drop the staging."""
    header: dict[str, object] = {}
    offset = 0
    for entry in sorted(entries, key=lambda e: e.name):
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    raw_header = json.dumps(header, separators=(",", ":")).encode()
    raw_header += b" " * (-len(raw_header) % 8)
    with staged_file(model_dir / SINGLE_FILE) as path, path.open("wb") as out:
        out.write(struct.pack("<Q", len(raw_header)) + raw_header)
        for entry in sorted(entries, key=lambda e: e.name):
            with _part_path(staging, entry).open("rb") as part:
                shutil.copyfileobj(part, out, CHUNK_BYTES)
        out.flush()
        os.fsync(out.fileno())
    with contextlib.suppress(OSError):
        shutil.rmtree(staging)
