"""Percentiles of measured samples, one way for every figure meshd reports (``/stats``, benchmarks)."""

from __future__ import annotations

from collections.abc import Iterable


def percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted, non-empty ``ordered``: the sample at rank ``q * n``."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def percentiles(values: Iterable[float], scale: float = 1.0) -> dict[str, float]:
    """``{"count", "p50", "p95", "mean"}`` of ``values`` times ``scale``; only ``count`` when empty."""
    data = sorted(v * scale for v in values)
    if not data:
        return {"count": 0}
    return {"count": len(data), "p50": percentile(data, 0.5), "p95": percentile(data, 0.95),
            "mean": sum(data) / len(data)}
