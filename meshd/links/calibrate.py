"""What a shaped link actually delivers, next to what it was set to.

A loopback TCP connection in this process, its sending side wrapped in the same ``ShapedStream``
that peers use: small timestamped probes measure the one-way delay (sender and receiver read one
clock, so no clock sync is involved), then a bulk transfer measures the rate. The figures include
everything a peer's bytes go through besides the shaper itself (timer wake-ups, the kernel's
loopback, the receiving task being scheduled), which is the point: they are what the mesh gets.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import trio

from meshd.links.profiles import LinkShape
from meshd.links.stream import ShapedStream
from meshd.stats import percentile

PROBES = 100
PROBE = struct.Struct("!dI")  # when it was handed to the link, its index
PROBE_BYTES = 64  # a decode step's message is a few hundred bytes; a probe is small next to it
MIN_PROBE_INTERVAL_S = 0.005
BULK_S = 0.4  # how long the bulk transfer takes at the set rate
MIN_BULK_BYTES = 256 * 1024
MAX_BULK_BYTES = 64 * 1024 * 1024
BULK_WRITE_BYTES = 64 * 1024


class LinkCalibrationError(RuntimeError):
    pass


@dataclass(frozen=True)
class LinkMeasurement:
    """One calibration: the probes' one-way delays (seconds, sorted) and the bulk transfer."""

    shape: LinkShape
    delays_s: tuple[float, ...]
    bulk_bytes: int
    bulk_rate_bit_s: float | None  # bytes after the first read / first to last read; None if one read

    def delay_ms(self, q: float) -> float:
        return percentile(list(self.delays_s), q) * 1e3

    @property
    def jitter_ms(self) -> float:
        """Half the p5-p95 spread of the delays, on the scale of a set ``±J`` (uniform ±J gives 0.9 J;
        a normal jitter of standard deviation σ gives 1.64 σ)."""
        return (self.delay_ms(0.95) - self.delay_ms(0.05)) / 2

    def as_json(self) -> dict[str, Any]:
        shape = self.shape
        rate = self.bulk_rate_bit_s
        return {
            "profile": shape.label, "spec": shape.spec,
            "set_delay_ms": round(shape.delay_s * 1e3, 3),
            "measured_delay_ms_p50": round(self.delay_ms(0.5), 3),
            "measured_delay_ms_p95": round(self.delay_ms(0.95), 3),
            "measured_delay_ms_p5": round(self.delay_ms(0.05), 3),
            "set_jitter_ms": round(shape.jitter_s * 1e3, 3), "jitter": shape.jitter,
            "measured_jitter_ms": round(self.jitter_ms, 3),
            "set_rate_mbit": round(shape.rate_bit_s / 1e6, 3),
            "measured_rate_mbit": None if rate is None else round(rate / 1e6, 3),
            "probes": len(self.delays_s), "bulk_bytes": self.bulk_bytes,
        }


async def measure_link(shape: LinkShape, *, probes: int = PROBES, bulk_s: float = BULK_S,
                       seed: int = 0) -> LinkMeasurement:
    """Calibrate ``shape`` on a fresh loopback connection; takes about ``probes`` × 5 ms + ``bulk_s``."""
    if probes < 1:
        raise ValueError("at least one probe")
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    async with listener:
        raw = await trio.open_tcp_stream("127.0.0.1", listener.socket.getsockname()[1])
        receiver = await listener.accept()
    bulk_bytes = min(MAX_BULK_BYTES, max(MIN_BULK_BYTES, int(shape.bytes_per_s * bulk_s)))
    async with receiver, trio.open_nursery() as nursery:
        link = ShapedStream(raw, shape, nursery, seed=seed)
        try:
            delays = await _probe(link, receiver, probes, max(MIN_PROBE_INTERVAL_S, 4 * shape.jitter_s))
            rate = await _bulk(link, receiver, bulk_bytes)
        finally:
            await trio.aclose_forcefully(link)
    return LinkMeasurement(shape, tuple(sorted(delays)), bulk_bytes, rate)


def calibrate(shape: LinkShape, **options: Any) -> LinkMeasurement:
    """:func:`measure_link` from synchronous code (the benchmark runner)."""
    async def run() -> LinkMeasurement:
        return await measure_link(shape, **options)

    return trio.run(run)


async def _probe(link: trio.abc.SendStream, receiver: trio.abc.ReceiveStream, count: int,
                 interval_s: float) -> list[float]:
    """One-way delays of ``count`` probes sent ``interval_s`` apart: far enough apart that one
    probe's jitter never holds back the next."""
    async def send() -> None:
        for i in range(count):
            await link.send_all(PROBE.pack(trio.current_time(), i).ljust(PROBE_BYTES, b"\0"))
            await trio.sleep(interval_s)

    delays: list[float] = []
    pending = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        while len(delays) < count:
            chunk = await receiver.receive_some(65536)
            now = trio.current_time()
            if not chunk:
                raise LinkCalibrationError(f"the link closed after {len(delays)} of {count} probes")
            pending += chunk
            while len(pending) >= PROBE_BYTES:
                sent, _index = PROBE.unpack_from(pending)
                del pending[:PROBE_BYTES]
                delays.append(now - sent)
    return delays


async def _bulk(link: trio.abc.SendStream, receiver: trio.abc.ReceiveStream, size: int) -> float | None:
    """The rate a ``size``-byte transfer arrives at, in bit/s, from its first read to its last."""
    async def send() -> None:
        block = memoryview(bytes(BULK_WRITE_BYTES))
        left = size
        while left:
            n = min(left, len(block))
            await link.send_all(block[:n])
            left -= n

    received = first_bytes = 0
    first = last = 0.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        while received < size:
            chunk = await receiver.receive_some(1024 * 1024)
            now = trio.current_time()
            if not chunk:
                raise LinkCalibrationError(f"the link closed after {received} of {size} bulk bytes")
            if not received:
                first, first_bytes = now, len(chunk)
            received += len(chunk)
            last = now
    return (received - first_bytes) * 8 / (last - first) if last > first else None
