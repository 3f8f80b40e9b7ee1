"""Stop-sequence matching over a stream of text increments.

Text is released as soon as it cannot be part of a stop string, so a stream holds back only the
longest suffix that is still a prefix of some stop string.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = list(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add an increment; return the text that is now safe to emit.

        When a stop string completes, return the text before it and set ``stopped``; later feeds
        are refused.
        """
        if self.stopped:
            raise RuntimeError("feed after a stop string matched")
        buffer = self._held + text
        cut = min((i for i in (buffer.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release what was held back; called when generation ends without a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buffer: str) -> int:
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:k]):
                    best = k
                    break
        return best
