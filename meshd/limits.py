"""Rates with a burst, per peer, as a pure state machine (time is passed in): the relay's bandwidth
per registered peer, the requests a peer answers from each other peer, the sessions it lets each
open. And the one way state kept per peer stays bounded: the least recently used entry goes first;
and the one way JSON from others is read, bounded by the parser's stack as by a clear error.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, MutableMapping
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def remember(entries: MutableMapping[K, V], key: K, value: V, capacity: int) -> V:
    """Store ``value`` under ``key`` as the most recently used entry (a dict keeps insertion order),
    dropping the least recently used ones beyond ``capacity``; returns ``value``."""
    entries.pop(key, None)
    entries[key] = value
    while len(entries) > capacity:
        del entries[next(iter(entries))]
    return value


class TokenBucket:
    """A rate with a burst; traffic above the rate is delayed, and refused once the delay would exceed
    ``max_delay``. ``take`` returns the seconds to wait before forwarding, or ``None`` for refused."""

    def __init__(self, rate: float, burst: float, max_delay: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.max_delay = max_delay
        self.tokens = burst
        self.updated = now

    def take(self, size: int, now: float) -> float | None:
        if self.rate <= 0:
            return 0.0
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        after = self.tokens - size
        if after >= 0:
            self.tokens = after
            return 0.0
        delay = -after / self.rate
        if delay > self.max_delay:
            return None
        self.tokens = after
        return delay


class KeyedRates:
    """One :class:`TokenBucket` per key (a peer, or a peer and a kind of request), at most
    ``capacity`` of them: a key not heard from for longest is forgotten first, and starts afresh."""

    def __init__(self, rate: float, burst: float, capacity: int) -> None:
        self.rate = rate
        self.burst = burst
        self.capacity = capacity
        self._buckets: dict[Hashable, TokenBucket] = {}

    def allow(self, key: Hashable, now: float) -> bool:
        """Whether one more event of ``key`` fits its rate now (and count it if so)."""
        bucket = self._buckets.get(key) or TokenBucket(self.rate, self.burst, 0.0, now)
        return remember(self._buckets, key, bucket, self.capacity).take(1, now) == 0.0


def parse_json(data: str | bytes | bytearray) -> Any:
    """``json.loads``, with a document nested past what the parser's stack holds raised as the
    ``ValueError`` any other bad JSON is: a short message of brackets must not escape its reader's
    error handling (a request, a relay's control message, a capture line)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None
