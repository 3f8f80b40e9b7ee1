"""The link model, sans-IO: bytes go in with the time they were sent, and come out at the time a link
of the given shape would deliver them. No sockets, no clock of its own; the caller passes ``now``.

A chunk is serialized when the link is free (one after another, ``size / rate`` each), then
travels the one-way delay (plus its jitter) and is released once that has passed — but never before
the chunk ahead of it, so jitter delays bytes without ever reordering them (a TCP stream cannot
reorder either). Large writes are cut into segments so that a long transfer streams out at the link
rate instead of arriving in one piece after all of it has been serialized.

Backpressure is by the link's backlog: bytes accepted but not yet serialized. ``room`` says how much
more may be accepted now, ``ready_at`` when a given amount fits; bytes already on the wire (departed,
still in their delay) do not count, as they occupy the link, not the sender's buffer, and are
bounded by rate × delay anyway.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from meshd.links.profiles import LinkShape

SEGMENT_BYTES = 16 * 1024  # one TLS record's worth: small next to a prefill bundle, large next to a decode step
# What a sender may queue ahead of the link, like a socket's send buffer: 10 ms of the link's time,
# so that a sender woken a few milliseconds late (Trio's timers, a busy machine) still finds the link
# busy and the rate holds (with 2 ms at 1 Gbit it delivered about 80 %), and at least 256 KiB.
BACKLOG_S = 0.010
MIN_BACKLOG_BYTES = 256 * 1024


def default_backlog(shape: LinkShape) -> int:
    return max(MIN_BACKLOG_BYTES, int(shape.bytes_per_s * BACKLOG_S))


@dataclass(frozen=True)
class Segment:
    release_at: float  # when its last byte has arrived at the far end
    data: bytes


class Shaper:
    """One direction of one link. Feed it with ``send``, drain it with ``take_due``."""

    def __init__(self, shape: LinkShape, *, seed: int = 0, backlog_bytes: int | None = None,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        backlog_bytes = default_backlog(shape) if backlog_bytes is None else backlog_bytes
        if backlog_bytes < 1 or segment_bytes < 1:
            raise ValueError("backlog_bytes and segment_bytes must be at least 1")
        self.shape = shape
        self.backlog_bytes = backlog_bytes
        self.segment_bytes = segment_bytes
        self._rng = random.Random(seed)
        self._queue: deque[Segment] = deque()
        self._free_at = float("-inf")  # when the link has serialized everything accepted so far
        self._last_release = float("-inf")
        self.queued_bytes = 0  # accepted, not yet taken: waiting for the link or in their delay
        self.sent_bytes = 0
        self.released_bytes = 0

    def backlog(self, now: float) -> int:
        """Bytes accepted but not yet serialized onto the link at ``now``."""
        ahead = self._free_at - now
        return round(ahead * self.shape.bytes_per_s) if ahead > 0 else 0  # round: float sums of segment times

    def room(self, now: float) -> int:
        """Bytes ``send`` may take at ``now`` without the backlog going over its bound."""
        return max(0, self.backlog_bytes - self.backlog(now))

    def ready_at(self, size: int) -> float:
        """The earliest time at which ``size`` bytes (at most the bound) have room."""
        size = min(max(size, 1), self.backlog_bytes)
        # a nanosecond late, so that rounding in ``backlog`` cannot leave the room one byte short then
        return self._free_at - (self.backlog_bytes - size) / self.shape.bytes_per_s + 1e-9

    def send(self, data: bytes | bytearray | memoryview, now: float) -> float:
        """Accept ``data`` sent at ``now``; returns when its last byte will be released. The caller
        keeps to ``room`` (this never refuses: the bound is the caller's to honour)."""
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self.segment_bytes):
            piece = bytes(view[start:start + self.segment_bytes])
            departs = max(now, self._free_at)
            self._free_at = departs + len(piece) / self.shape.bytes_per_s
            arrives = self._free_at + self._delay()
            self._last_release = max(self._last_release, arrives)
            self._queue.append(Segment(self._last_release, piece))
            self.queued_bytes += len(piece)
            self.sent_bytes += len(piece)
        return self._last_release

    @property
    def last_release(self) -> float:
        """When the last byte accepted so far will be released (``-inf`` before the first)."""
        return self._last_release

    def next_release(self) -> float | None:
        """When the next queued bytes are due, or ``None`` when nothing is queued."""
        return self._queue[0].release_at if self._queue else None

    def take_due(self, now: float) -> bytes:
        """Every byte due by ``now``, in the order sent (``b""`` when none is)."""
        due: list[bytes] = []
        while self._queue and self._queue[0].release_at <= now:
            due.append(self._queue.popleft().data)
        data = b"".join(due)
        self.queued_bytes -= len(data)
        self.released_bytes += len(data)
        return data

    def drop(self) -> int:
        """Forget everything queued (the link went down); returns how many bytes were dropped."""
        dropped = self.queued_bytes
        self._queue.clear()
        self.queued_bytes = 0
        return dropped

    def _delay(self) -> float:
        shape = self.shape
        if not shape.jitter_s:
            return shape.delay_s
        if shape.jitter == "normal":
            return max(0.0, self._rng.gauss(shape.delay_s, shape.jitter_s))
        return self._rng.uniform(shape.delay_s - shape.jitter_s, shape.delay_s + shape.jitter_s)
