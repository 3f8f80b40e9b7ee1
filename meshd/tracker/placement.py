"""Placement: tell peers that offer a model without a range which layers to load.

Each unplaced peer gets a contiguous window of layers that its memory budget holds (counting the
embedding or LM head when the range touches the head or tail): the window that covers the most
layers nobody holds yet, preferring one that starts and ends on existing range boundaries so that
the ranges tile into routes, then the largest. Peers are placed one after another in a fixed order
(largest budget first, then peer id), so every tracker computes the same plan from the same view.
"""

from __future__ import annotations

from collections.abc import Iterable

from meshd.tracker.view import ShardOffer


def layer_capacity(offer: ShardOffer, start: int, end: int) -> bool:
    """Whether ``[start, end)`` fits the offer's memory budget."""
    need = (end - start) * offer.layer_bytes
    if start == 0:
        need += offer.edge_bytes
    if end == offer.n_layers:
        need += offer.edge_bytes
    return need <= offer.memory_budget_bytes


def coverage(offers: Iterable[ShardOffer], n_layers: int) -> list[int]:
    counts = [0] * n_layers
    for offer in offers:
        if offer.range is not None:
            for layer in range(*offer.range):
                counts[layer] += 1
    return counts


def missing_ranges(counts: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of layers that no peer covers."""
    gaps: list[tuple[int, int]] = []
    start = None
    for i, c in enumerate([*counts, 1]):
        if c == 0 and start is None:
            start = i
        elif c != 0 and start is not None:
            gaps.append((start, i))
            start = None
    return gaps


def best_window(offer: ShardOffer, counts: list[int], boundaries: set[int]) -> tuple[int, int] | None:
    """The window that fits the budget and covers the most uncovered layers; among those, one that
    lines up with existing range boundaries (so routes can tile), then the largest, then the least
    covered, then the leftmost."""
    n = len(counts)
    best: tuple[tuple[int, int, int, int, int], tuple[int, int]] | None = None
    for start in range(n):
        for end in range(start + 1, n + 1):
            if not layer_capacity(offer, start, end):
                break
            uncovered = sum(1 for c in counts[start:end] if c == 0)
            aligned = (start in boundaries) + (end in boundaries)
            key = (-uncovered, -aligned, -(end - start), sum(counts[start:end]), start)
            if best is None or key < best[0]:
                best = (key, (start, end))
    return None if best is None else best[1]


def place(offers: list[ShardOffer]) -> dict[str, tuple[int, int]]:
    """Ranges for every offer that has none yet (all offers are of one model and compat key).

    First the uncovered runs of layers are filled left to right, each waiting peer taking the
    longest window from the current layer that its budget holds; peers left over then add
    redundancy where coverage is thinnest.
    """
    if not offers:
        return {}
    n_layers = offers[0].n_layers
    placed = [o for o in offers if o.range is not None]
    counts = coverage(placed, n_layers)
    boundaries = {0, n_layers}
    for offer in placed:
        assert offer.range is not None
        boundaries.update(offer.range)
    waiting = sorted((o for o in offers if o.range is None and not o.pinned),
                     key=lambda o: (-o.memory_budget_bytes, o.peer_id))
    plan: dict[str, tuple[int, int]] = {}

    def assign(offer: ShardOffer, window: tuple[int, int]) -> None:
        plan[offer.peer_id] = window
        boundaries.update(window)
        for layer in range(*window):
            counts[layer] += 1

    for gap_start, gap_end in missing_ranges(counts):
        position = gap_start
        for offer in list(waiting):
            if position >= gap_end:
                break
            fits = [e for e in range(position + 1, gap_end + 1) if layer_capacity(offer, position, e)]
            if fits:
                waiting.remove(offer)
                assign(offer, (position, max(fits)))
                position = max(fits)
    for offer in waiting:
        window = best_window(offer, counts, boundaries)
        if window is not None:
            assign(offer, window)
    return plan
