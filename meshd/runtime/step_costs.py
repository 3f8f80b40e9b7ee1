"""What a step costs this hop, by its size: learned from the hop's own steps, kept current.

The cost of a decode step by its number of rows differs from machine to machine and is far from
linear: on the 2-core development machine, the bench model's linears take about as long for two or
three rows as for one, twice that for four, and 2.6 times for eight. A batcher that assumes a shape
forms the wrong batches, so each hop measures its own: every decode step's compute time is folded
into a smoothed figure for its row count, and every prefill chunk's into one for its size class
(powers of two). Sizes never seen are estimated from the nearest measured ones, and the summary
holds only measured figures. Pure bookkeeping (no clock, no I/O): the batcher feeds it.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of a new measurement in its size's figure
MIN_RATE_CHUNK = 64  # prefill chunks this long or longer say what a long prompt's prefill costs per token


def chunk_class(tokens: int) -> int:
    """The size class of a prefill chunk: the power of two at or above its token count."""
    return 1 << max(0, tokens - 1).bit_length()


@dataclass
class _Figure:
    seconds: float
    count: int = 1

    def add(self, seconds: float) -> None:
        self.seconds += SMOOTHING * (seconds - self.seconds)
        self.count += 1


@dataclass
class StepCosts:
    """Smoothed compute seconds of decode steps by row count and of prefill chunks by size class."""

    decode: dict[int, _Figure] = field(default_factory=dict)
    prefill: dict[int, _Figure] = field(default_factory=dict)
    prefill_token: _Figure | None = None  # seconds per token of chunks of MIN_RATE_CHUNK tokens or more

    def observe_decode(self, rows: int, seconds: float) -> None:
        if rows >= 1 and seconds > 0:
            _observe(self.decode, rows, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 1 and seconds > 0:
            _observe(self.prefill, chunk_class(tokens), seconds)
            if tokens >= MIN_RATE_CHUNK:
                if self.prefill_token is None:
                    self.prefill_token = _Figure(seconds / tokens)
                else:
                    self.prefill_token.add(seconds / tokens)

    def prefill_tok_s(self) -> float | None:
        """Tokens per second a long prefill runs at here (None: no long chunk measured yet)."""
        return 1.0 / self.prefill_token.seconds if self.prefill_token is not None else None

    def decode_s(self, rows: int) -> float | None:
        """The expected seconds of a decode step of ``rows`` rows (None: nothing measured yet)."""
        return _estimate(self.decode, rows)

    def prefill_s(self, tokens: int) -> float | None:
        return _estimate(self.prefill, chunk_class(tokens))

    def rows_within(self, seconds: float, most: int) -> int:
        """The most rows (at most ``most``, at least 1) whose decode step is expected within ``seconds``."""
        best = 1
        for rows in range(1, most + 1):
            cost = self.decode_s(rows)
            if cost is not None and cost > seconds:
                break
            best = rows
        return best

    def summary(self) -> dict:
        """Measured figures only, in ms, with the rows per second each decode size gives."""
        return {
            "decode_ms": {str(r): round(f.seconds * 1000, 3) for r, f in sorted(self.decode.items())},
            "decode_rows_per_s": {str(r): round(r / f.seconds, 2) for r, f in sorted(self.decode.items())},
            "decode_samples": {str(r): f.count for r, f in sorted(self.decode.items())},
            "prefill_ms_by_chunk": {str(c): round(f.seconds * 1000, 3) for c, f in sorted(self.prefill.items())},
            "prefill_tok_s": round(1.0 / self.prefill_token.seconds, 1) if self.prefill_token is not None else None,
        }

    def reset(self) -> None:
        self.decode.clear()
        self.prefill.clear()
        self.prefill_token = None


def _observe(table: dict[int, _Figure], size: int, seconds: float) -> None:
    figure = table.get(size)
    if figure is None:
        table[size] = _Figure(seconds)
    else:
        figure.add(seconds)


def _estimate(table: dict[int, _Figure], size: int) -> float | None:
    """The figure for ``size``; between two measured sizes, the line through them; past either end,
    the nearest end's figure. Above the largest measured size that is optimistic on purpose: rows
    never tried are taken as free, so that a batcher tries a larger batch once and then knows."""
    if not table:
        return None
    if size in table:
        return table[size].seconds
    sizes = sorted(table)
    at = bisect_left(sizes, size)
    if at == 0:
        return table[sizes[0]].seconds  # a smaller step costs at most what the smallest measured one does
    if at == len(sizes):
        return table[sizes[-1]].seconds
    low, high = sizes[at - 1], sizes[at]
    share = (size - low) / (high - low)
    return table[low].seconds + share * (table[high].seconds - table[low].seconds)
