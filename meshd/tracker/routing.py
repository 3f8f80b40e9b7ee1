"""Routing: the cheapest chain of peers that tiles a model's layers exactly.

A hop is one peer running its whole loaded range. The estimated time of one decode token through a
route is the sum of each hop's compute (measured time per layer x layers x a load factor) and of
each seam's latency, plus a fixed per-hop cost so
that, all else equal, fewer hops win: one peer alone when it holds the whole model. A shortest path
over layer boundaries finds the best tiling.

A seam costs the measured round trip to the peer (gossip requests, so for a relayed peer the relay
path is in it). Before anything is measured a default stands in, and a relayed peer adds
``RELAY_PENALTY_MS`` to it: a relay is assumed slower until measured otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from meshd.tracker.placement import coverage, missing_ranges
from meshd.tracker.view import Hop, HopTerms, Route, ShardOffer

PER_HOP_MS = 0.5
UNMEASURED_RTT_MS = 1.0
RELAY_PENALTY_MS = 5.0
KEEP_DISCOUNT = 0.25
AVOID_PENALTY_MS = 10_000.0  # per avoided hop: a route uses as few avoided peers as it can


class NoRouteError(Exception):
    def __init__(self, model_id: str, missing: list[tuple[int, int]]) -> None:
        gaps = ", ".join(f"[{s}, {e})" for s, e in missing) or "none (peers excluded or incompatible)"
        super().__init__(f"no complete route for {model_id}: layers not covered: {gaps}")
        self.model_id = model_id
        self.missing = missing


def seam_ms(offer: ShardOffer, rtt_ms: float | None) -> float:
    """Seam latency: the measured RTT (relay included), or a default plus a relay penalty until measured."""
    if rtt_ms is not None:
        return rtt_ms
    return UNMEASURED_RTT_MS + (RELAY_PENALTY_MS if offer.relayed else 0.0)


def hop_terms(offer: ShardOffer, rtt_ms: float | None) -> HopTerms:
    assert offer.range is not None
    start, end = offer.range
    load = 1.0 + offer.active_sessions * 0.5 + offer.queued
    compute = (end - start) * offer.ms_per_layer * load
    return HopTerms(peer_id=offer.peer_id, start=start, end=end, compute_ms=round(compute, 3),
                    seam_ms=round(seam_ms(offer, rtt_ms), 3), hop_ms=PER_HOP_MS, load_factor=load)


def plan_route(
    model_id: str,
    offers: Iterable[ShardOffer],
    rtt_ms: Callable[[str], float | None],
    epoch: int = 0,
    exclude: frozenset[str] = frozenset(),
    keep: frozenset[str] = frozenset(),
    avoid: frozenset[str] = frozenset(),
    compat_key: str = "",
) -> Route:
    """The cheapest exact tiling of ``[0, n_layers)`` by the offered ranges, or :class:`NoRouteError`.

    ``exclude`` names peers the route must not use. ``avoid`` names peers it should use only where
    nothing else covers their layers (suspected, recently unreachable, or on a route that stalled):
    each costs ``AVOID_PENALTY_MS``, so the route with the fewest of them wins. ``keep`` names peers
    that already hold the session being repaired: a route through them can resume instead of
    recomputing, and their load counts the session itself, so they cost less. ``compat_key``, when
    given, keeps the route inside one compat key: a session repaired mid-generation stays with peers
    that compute as the ones before did.
    """
    usable = [o for o in offers if o.model_id == model_id and o.range is not None and o.peer_id not in exclude
              and (not compat_key or o.compat_key == compat_key)]
    span = {o.peer_id: o.range for o in usable if o.range is not None}
    if not usable:
        raise NoRouteError(model_id, [])
    # the compat key commits to the config, so honest peers of one key agree on the layer count; one
    # that claims another count under the same key is planned apart and cannot disturb their routes
    by_compat: dict[tuple[str, int], list[ShardOffer]] = {}
    for o in usable:
        by_compat.setdefault((o.compat_key, o.n_layers), []).append(o)
    best: Route | None = None
    best_total = 0.0
    missing: list[tuple[int, int]] = []
    for (compat_key, _n), group in sorted(by_compat.items()):
        n_layers = group[0].n_layers
        terms = {o.peer_id: hop_terms(o, rtt_ms(o.peer_id)) for o in group}
        cost = {o.peer_id: (terms[o.peer_id].compute_ms + terms[o.peer_id].seam_ms + terms[o.peer_id].hop_ms)
                * (KEEP_DISCOUNT if o.peer_id in keep else 1.0) + (AVOID_PENALTY_MS if o.peer_id in avoid else 0.0)
                for o in group}
        dist: dict[int, tuple[float, list[ShardOffer]]] = {0: (0.0, [])}
        for boundary in range(n_layers):
            if boundary not in dist:
                continue
            base, path = dist[boundary]
            for o in sorted(group, key=lambda x: x.peer_id):
                start, end = span[o.peer_id]
                if start != boundary:
                    continue
                cand = base + cost[o.peer_id]
                if end not in dist or cand < dist[end][0]:
                    dist[end] = (cand, [*path, o])
        if n_layers in dist:
            total, path = dist[n_layers]
            hop_terms_ = tuple(terms[o.peer_id] for o in path)
            estimate = sum(t.compute_ms + t.seam_ms + t.hop_ms for t in hop_terms_)
            route = Route(
                model_id=model_id, compat_key=compat_key,
                hops=tuple(Hop(o.peer_id, *span[o.peer_id]) for o in path),
                epoch=epoch, cost_ms=round(estimate, 3), terms=hop_terms_,
            )
            if best is None or total < best_total:
                best, best_total = route, total
        else:
            missing = missing_ranges(coverage(group, n_layers)) or missing
    if best is None:
        raise NoRouteError(model_id, missing)
    return best
