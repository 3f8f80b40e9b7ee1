"""Whether a large bundle should be compressed for the link it is about to cross.

Compression pays only where the link is slow: zstd over byte planes saves about a sixth of a hidden
state's bytes and costs the sender and the receiver CPU time for every byte. This policy, kept per
next hop, decides from what it has measured on that link:

- the link's throughput, from how long large sends took: only a send larger than the stream's
  flow-control window has to wait for the receiver, so only such sends are counted, as their bytes
  over their duration. The window's worth that went out at once makes this an overestimate, which
  errs towards sending raw; a receiver busy computing slows a send down, so the estimate is the best
  of the recent samples;
- the compression's saving and cost per byte, from the compressions done so far. While the link looks
  slow enough for compression to possibly pay, every ``probe_every``-th eligible payload is compressed
  even when the estimates say no, so that the estimates follow the data.

A payload is compressed when the time saved on the link beats the time spent compressing and
decompressing. Small payloads (every decode step) and links that have not been measured travel raw.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from meshd.wire.bundle import COMPRESS_MIN_BYTES

MODES = ("auto", "off", "always")
# Decompressing (zstd, then regrouping the byte planes back) measured at about half the time of
# compressing on the CPUs in docs/benchmarks.md; the sender counts the receiver's share this way.
RECEIVER_SHARE = 0.5
# The best saving that could make compression worth probing on a link: no link is probed where even
# this would not pay.
BEST_SAVING = 0.5


@dataclass
class CompressionPolicy:
    mode: str = "auto"
    window_bytes: int = 1024 * 1024  # the stream flow-control window of the link's transport
    samples: int = 8
    probe_every: int = 16
    link_rates: deque = field(default_factory=deque)  # bytes per second, recent large sends
    saving: float | None = None  # fraction of bytes saved, smoothed
    cost_s_per_byte: float | None = None  # sender's compression time per raw byte, smoothed
    _eligible: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"compression mode {self.mode!r} is not one of {', '.join(MODES)}")
        self.link_rates = deque(self.link_rates, maxlen=self.samples)

    @property
    def link_bytes_per_s(self) -> float | None:
        return max(self.link_rates) if self.link_rates else None

    def should_compress(self, raw_bytes: int) -> bool:
        """Whether to compress a payload of ``raw_bytes`` for this link now."""
        if raw_bytes < COMPRESS_MIN_BYTES or self.mode == "off":
            return False
        if self.mode == "always":
            return True
        rate = self.link_bytes_per_s
        if rate is None:
            return False
        self._eligible += 1
        if self.saving is None or self.cost_s_per_byte is None:
            return self._worth_probing(rate)
        if self._pays(rate, self.saving, self.cost_s_per_byte):
            return True
        return self._eligible % self.probe_every == 0 and self._worth_probing(rate)

    def _worth_probing(self, rate: float) -> bool:
        cost = self.cost_s_per_byte if self.cost_s_per_byte is not None else 0.0
        return self._pays(rate, BEST_SAVING, cost)

    @staticmethod
    def _pays(rate: float, saving: float, cost_s_per_byte: float) -> bool:
        saved_s_per_byte = saving / rate
        return saved_s_per_byte > cost_s_per_byte * (1 + RECEIVER_SHARE)

    def record_send(self, wire_bytes: int, seconds: float) -> None:
        """A send of ``wire_bytes`` that took ``seconds``; only sends beyond one window tell the rate."""
        if wire_bytes > self.window_bytes and seconds > 0:
            self.link_rates.append(wire_bytes / seconds)

    def record_compression(self, raw_bytes: int, compressed_bytes: int, seconds: float) -> None:
        """A compression of ``raw_bytes`` into ``compressed_bytes`` that took ``seconds``."""
        if raw_bytes <= 0:
            return
        saving = max(0.0, 1 - compressed_bytes / raw_bytes)
        cost = max(0.0, seconds) / raw_bytes
        self.saving = saving if self.saving is None else 0.7 * self.saving + 0.3 * saving
        self.cost_s_per_byte = cost if self.cost_s_per_byte is None else 0.7 * self.cost_s_per_byte + 0.3 * cost
