"""Rates with a burst, per peer, as a pure state machine (time is passed in): the relay's bandwidth
per registered peer, and the requests a peer answers from each other peer."""

from __future__ import annotations


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
