"""The capture store: append-only JSONL segments in one directory, bounded by records, bytes and age.

Records are appended, one line each written in one call, to the newest segment
(``capture-000001.jsonl``...); a segment is never rewritten. Retention drops whole segments, oldest
first, while the store holds more records or bytes than allowed or its oldest record is older than
allowed; each segment holds at most 1/16 of each bound (records, bytes, time span), so the store stays
within its bounds and keeps at least 15/16 of them; a record goes once older than the age bound. A
crash can only cut the last line short: a reader skips such a line with a warning, and the store
cuts it off before it appends again. Files are private to the daemon's user (0600, directory 0700):
a full capture holds people's prompts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.limits import parse_json

log = logging.getLogger("meshd.capture")

SEGMENT = re.compile(r"^capture-(\d{6,})\.jsonl$")
SEGMENT_SHARE = 16  # a segment holds at most this fraction of each bound


def segment_name(seq: int) -> str:
    return f"capture-{seq:06d}.jsonl"


def segment_files(directory: Path) -> list[tuple[int, Path]]:
    """The capture segments in ``directory``, oldest first, with their sequence numbers."""
    found = []
    for path in directory.iterdir():
        match = SEGMENT.match(path.name)
        if match is not None:
            found.append((int(match.group(1)), path))
    return sorted(found)


@dataclass
class _Segment:
    seq: int
    path: Path
    records: int = 0
    bytes: int = 0
    first_ms: int | None = None
    last_ms: int | None = None


@dataclass(frozen=True)
class Retention:
    max_records: int
    max_bytes: int
    max_age_s: float

    def __post_init__(self) -> None:
        if self.max_records < 1 or self.max_bytes < 1 or self.max_age_s <= 0:
            raise ValueError("capture retention needs at least one record, one byte and some seconds")

    @property
    def segment_records(self) -> int:
        return max(1, -(-self.max_records // SEGMENT_SHARE))

    @property
    def segment_bytes(self) -> int:
        return max(1, self.max_bytes // SEGMENT_SHARE)

    @property
    def segment_span_ms(self) -> float:
        return self.max_age_s * 1000 / SEGMENT_SHARE


@dataclass
class CaptureStore:
    """The segments of one capture directory; used from one thread at a time (the daemon's writer)."""

    directory: Path
    retention: Retention
    clock: Callable[[], float] = time.time  # wall clock, seconds: records' time_ms is on it
    segments: list[_Segment] = field(default_factory=list)
    _fd: int | None = None

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._load()
        self.prune()

    # -- state -------------------------------------------------------------------------------------

    @property
    def records(self) -> int:
        return sum(s.records for s in self.segments)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.segments)

    def oldest_ms(self) -> int | None:
        return next((s.first_ms for s in self.segments if s.first_ms is not None), None)

    def _load(self) -> None:
        found = segment_files(self.directory)
        for seq, path in found:
            segment = _Segment(seq, path)
            if (seq, path) == found[-1]:
                _cut_torn_tail(path)
            for _, doc, _warning in _lines(path):
                if doc is not None:
                    segment.records += 1
                    stamp = doc.get("time_ms") if isinstance(doc.get("time_ms"), int) else None
                    if stamp is not None:
                        segment.first_ms = stamp if segment.first_ms is None else min(segment.first_ms, stamp)
                        segment.last_ms = stamp if segment.last_ms is None else max(segment.last_ms, stamp)
            segment.bytes = path.stat().st_size
            self.segments.append(segment)

    # -- writing -----------------------------------------------------------------------------------

    def append(self, record: dict[str, Any]) -> bool:
        """Append one record (its ``time_ms`` stamps it); False when it is larger than the whole store
        may be. Raises OSError when the disk refuses (the caller logs it)."""
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        if len(line) > self.retention.max_bytes:
            log.warning("capture: a record of %d bytes is larger than capture_max_bytes (%d); not kept",
                        len(line), self.retention.max_bytes)
            return False
        stamp = record.get("time_ms")
        time_ms = stamp if isinstance(stamp, int) else int(self.clock() * 1000)
        segment = self._segment_for(len(line), time_ms)
        fd = self._open(segment)
        view = memoryview(line)
        try:
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError:
            # a record cut short would run into the next one and take it too: cut it off again
            with contextlib.suppress(OSError):
                os.ftruncate(fd, segment.bytes)
            raise
        segment.records += 1
        segment.bytes += len(line)
        segment.first_ms = time_ms if segment.first_ms is None else segment.first_ms
        segment.last_ms = time_ms
        self.prune()
        return True

    def _segment_for(self, size: int, time_ms: int) -> _Segment:
        """The newest segment, or a new one when the record would take it past its share of a bound."""
        r = self.retention
        current = self.segments[-1] if self.segments else None
        if current is not None and (current.records == 0 or (
                current.records < r.segment_records and current.bytes + size <= r.segment_bytes
                and (current.first_ms is None or time_ms - current.first_ms <= r.segment_span_ms))):
            return current
        self._close()
        seq = current.seq + 1 if current is not None else 1
        segment = _Segment(seq, self.directory / segment_name(seq))
        self.segments.append(segment)
        return segment

    def _open(self, segment: _Segment) -> int:
        if self._fd is None:
            self._fd = os.open(segment.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return self._fd

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._close()

    def prune(self) -> int:
        """Drop the oldest segments while a bound is passed; returns how many records went."""
        r = self.retention
        now_ms = self.clock() * 1000
        dropped = 0
        while self.segments:
            oldest = self.segments[0]
            too_old = oldest.first_ms is not None and now_ms - oldest.first_ms > r.max_age_s * 1000
            if not (self.records > r.max_records or self.bytes > r.max_bytes or too_old):
                break
            if oldest is self.segments[-1]:
                self._close()
            oldest.path.unlink(missing_ok=True)
            self.segments.pop(0)
            dropped += oldest.records
        if dropped:
            log.debug("capture: retention dropped %d records", dropped)
        return dropped

    def status(self) -> dict[str, Any]:
        oldest = self.oldest_ms()
        return {"records": self.records, "bytes": self.bytes, "segments": len(self.segments),
                "oldest_age_s": None if oldest is None else round(self.clock() - oldest / 1000, 1)}


def _cut_torn_tail(path: Path) -> None:
    """Cut off a last line that a crash left without its newline, so that the next append starts clean."""
    size = path.stat().st_size
    if size == 0:
        return
    with path.open("rb+") as f:
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return
        # find the last newline, reading backwards in blocks
        end = size
        keep = 0
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            at = block.rfind(b"\n")
            if at >= 0:
                keep = start + at + 1
                break
            end = start
        f.truncate(keep)
    log.warning("capture: %s ended in a torn record (%d bytes, the daemon stopped mid-write); cut off",
                path, size - keep)


# -- reading ---------------------------------------------------------------------------------------


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """(line number, record or None, warning or None) for each line of one file."""
    with path.open("rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    torn_tail = lines[-1] != b""
    if not torn_tail:
        lines.pop()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        last = number == len(lines)
        try:
            doc = parse_json(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or (last and torn_tail):
            what = "a torn last line (the daemon stopped mid-write)" if last else "not a JSON record"
            yield number, None, f"{path}:{number}: {what}; skipped"
            continue
        yield number, doc, None


@dataclass
class CaptureFile:
    """Records read from a capture directory or file, oldest first, with what was skipped and why."""

    records: list[dict[str, Any]]
    warnings: list[str]


def read_capture(path: Path) -> CaptureFile:
    """Every record of a capture directory (its segments in order) or of one JSONL file."""
    path = Path(path)
    if path.is_dir():
        files = [p for _, p in segment_files(path)]
        if not files:
            raise FileNotFoundError(f"{path} holds no capture segments (capture-NNNNNN.jsonl)")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"no capture at {path}")
    records: list[dict[str, Any]] = []
    warnings: list[str] = []
    for file in files:
        for _, doc, warning in _lines(file):
            if doc is not None:
                records.append(doc)
            elif warning is not None:
                warnings.append(warning)
    return CaptureFile(records, warnings)
