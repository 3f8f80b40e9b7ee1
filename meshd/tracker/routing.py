"""Routing: the cheapest chain of peers that tiles a model's layers exactly.

A hop is one peer running its whole loaded range. One decode token through a route costs each hop's
compute (measured time per layer x layers x a load factor) and a fixed per-hop cost, plus every link
it crosses: from the entry to the head, from each hop to the next, and from the tail back to the
entry. A crossing costs the one-way latency of that link (half its round trip) plus the bytes it
carries over the link's rate: a hidden state across a seam, a token id in and a token out (too small
to count). So a route is as good as its links, not as its hops' distance from whoever plans it, and
one peer holding the whole model serves alone unless splitting is really faster.

Links come from a :class:`~meshd.tracker.links.LinkTable`: the planner's own measurements and those
the cards publish. An unmeasured round trip is ``UNMEASURED_RTT_MS``, plus ``RELAY_PENALTY_MS`` when
an end is relayed (a relay is assumed slower until measured otherwise; a measured round trip already
includes the relay path); an unmeasured rate is ``UNMEASURED_RATE_BPS``.

The cost of a hop depends on the hop before it, so the search runs over (layer boundary, last
peer) states; each peer holds one range, so its last peer alone is the state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace

from meshd.tracker.links import LinkTable
from meshd.tracker.placement import coverage, missing_ranges
from meshd.tracker.view import Crossing, Hop, HopTerms, Route, ShardOffer

PER_HOP_MS = 0.5
UNMEASURED_RTT_MS = 1.0
RELAY_PENALTY_MS = 5.0
# 100 Mbit/s: a modest LAN or a good uplink, so that an unmeasured link is not assumed faster than most
UNMEASURED_RATE_BPS = 100e6
KEEP_DISCOUNT = 0.25
AVOID_PENALTY_MS = 10_000.0  # per avoided hop: a route uses as few avoided peers as it can
# A decode step's hidden state is [1, hidden]. Cards say a layer's weight bytes, not the hidden size: a
# Llama-family layer holds about 12 x hidden^2 weights (attention about 4, the MLP about 8), at 2 bytes
# each in the dtype real checkpoints keep. The estimate is within a factor of about 1.5 for them,
# and every crossing of one model carries the same bundle, so it weighs links against compute only.
WEIGHTS_PER_HIDDEN_SQUARED = 12
BYTES_PER_VALUE = 2
BUNDLE_OVERHEAD_BYTES = 256  # the bundle's framing, ids and the stream's headers
MAX_HIDDEN = 65_536

Links = LinkTable | Callable[[str], float | None]
"""A :class:`LinkTable`, or just the planner's round trip to each peer (then the planner is taken
to be the entry, and links between two other peers are unmeasured)."""


class NoRouteError(Exception):
    def __init__(self, model_id: str, missing: list[tuple[int, int]]) -> None:
        gaps = ", ".join(f"[{s}, {e})" for s, e in missing) or "none (peers excluded or incompatible)"
        super().__init__(f"no complete route for {model_id}: layers not covered: {gaps}")
        self.model_id = model_id
        self.missing = missing


def link_rtt_ms(rtt_ms: float | None, relayed: bool) -> float:
    """A link's round trip: as measured (a relay path included), or a default plus a relay penalty."""
    if rtt_ms is not None:
        return rtt_ms
    return UNMEASURED_RTT_MS + (RELAY_PENALTY_MS if relayed else 0.0)


def seam_ms(offer: ShardOffer, rtt_ms: float | None) -> float:
    """The round trip of a link into ``offer``'s peer (see :func:`link_rtt_ms`)."""
    return link_rtt_ms(rtt_ms, offer.relayed)


def bundle_bytes(layer_bytes: int) -> int:
    """Bytes a decode step's hidden state takes across a seam, estimated from one layer's weight bytes."""
    hidden = min(MAX_HIDDEN, math.isqrt(max(0, layer_bytes) // (WEIGHTS_PER_HIDDEN_SQUARED * BYTES_PER_VALUE)))
    return BUNDLE_OVERHEAD_BYTES + BYTES_PER_VALUE * hidden


NO_CROSSING = Crossing("", "", 0.0, 0.0, 0, 0.0, 0.0, rtt_measured=True, rate_measured=True, relayed=False)  # free


def _figures(links: LinkTable, a: str, b: str, relayed: Callable[[str], bool]) -> tuple[float, float, bool, bool, bool]:
    """The round trip and rate a crossing from ``a`` to ``b`` is planned with, whether each was
    measured, and whether an end is relayed."""
    known = links.link(a, b)
    via_relay = relayed(a) or relayed(b)
    rate = known.rate_bps if known.rate_bps is not None else UNMEASURED_RATE_BPS
    return link_rtt_ms(known.rtt_ms, via_relay), rate, known.rtt_ms is not None, known.rate_bps is not None, via_relay


def _crossing_ms(rtt_ms: float, rate_bps: float, nbytes: int) -> float:
    return rtt_ms / 2 + nbytes * 8 / rate_bps * 1000


def crossing(links: LinkTable, a: str, b: str, nbytes: int, relayed: Callable[[str], bool]) -> Crossing:
    """What one crossing from ``a`` to ``b`` carrying ``nbytes`` costs (nothing from a peer to itself)."""
    if a == b:
        return replace(NO_CROSSING, from_peer=a, to_peer=b)
    rtt, rate, rtt_measured, rate_measured, via_relay = _figures(links, a, b, relayed)
    return Crossing(from_peer=a, to_peer=b, rtt_ms=round(rtt, 3), rate_bps=rate, bytes=nbytes,
                    latency_ms=round(rtt / 2, 3), transfer_ms=round(_crossing_ms(0.0, rate, nbytes), 3),
                    rtt_measured=rtt_measured, rate_measured=rate_measured, relayed=via_relay)


def hop_terms(offer: ShardOffer, into: Crossing) -> HopTerms:
    """The hop's own terms, reached across ``into``."""
    assert offer.range is not None
    start, end = offer.range
    load = 1.0 + offer.active_sessions * 0.5 + offer.queued
    compute = (end - start) * offer.ms_per_layer * load
    return HopTerms(peer_id=offer.peer_id, start=start, end=end, compute_ms=round(compute, 3),
                    seam_ms=round(into.cost_ms, 3), hop_ms=PER_HOP_MS, load_factor=load, crossing=into)


def plan_route(
    model_id: str,
    offers: Iterable[ShardOffer],
    rtt_ms: Links,
    epoch: int = 0,
    exclude: frozenset[str] = frozenset(),
    keep: frozenset[str] = frozenset(),
    avoid: frozenset[str] = frozenset(),
    compat_key: str = "",
    entry: str | None = None,
) -> Route:
    """The cheapest exact tiling of ``[0, n_layers)`` by the offered ranges, or :class:`NoRouteError`.

    ``rtt_ms`` says what the links cost (see :data:`Links`). ``entry`` is the peer whose API took the
    request, which sends the tokens in and gets them back; by default the planner itself.
    ``exclude`` names peers the route must not use. ``avoid`` names peers it should use only where
    nothing else covers their layers (suspected, recently unreachable, or on a route that stalled):
    each costs ``AVOID_PENALTY_MS``, so the route with the fewest of them wins. ``keep`` names peers
    that already hold the session being repaired: a route through them can resume instead of
    recomputing, and their load counts the session itself, so they cost less. ``compat_key``, when
    given, keeps the route inside one compat key: a session repaired mid-generation stays with peers
    that compute as the ones before did.
    """
    links = rtt_ms if isinstance(rtt_ms, LinkTable) else LinkTable.of_round_trips(rtt_ms)
    entry_id = links.planner if entry is None else entry
    usable = [o for o in offers if o.model_id == model_id and o.range is not None and o.peer_id not in exclude
              and (not compat_key or o.compat_key == compat_key) and not o.prefill_only]
    if not usable:
        raise NoRouteError(model_id, [])
    relayed_offers = {o.peer_id for o in usable if o.relayed}

    def relayed(peer_id: str) -> bool:
        return peer_id in relayed_offers or links.relayed(peer_id)

    # the compat key commits to the config, so honest peers of one key agree on the layer count; one
    # that claims another count under the same key is planned apart and cannot disturb their routes
    by_compat: dict[tuple[str, int], dict[str, ShardOffer]] = {}
    for o in usable:
        by_compat.setdefault((o.compat_key, o.n_layers), {}).setdefault(o.peer_id, o)
    best: Route | None = None
    best_total = 0.0
    missing: list[tuple[int, int]] = []
    for (compat_key, n_layers), by_peer in sorted(by_compat.items()):
        group = list(by_peer.values())
        found = _cheapest_chain(group, n_layers, links, entry_id, relayed, keep, avoid)
        if found is None:
            missing = missing_ranges(coverage(group, n_layers)) or missing
            continue
        total, terms, back = found
        estimate = sum(t.compute_ms + t.seam_ms + t.hop_ms for t in terms) + back.cost_ms
        route = Route(model_id=model_id, compat_key=compat_key,
                      hops=tuple(Hop(t.peer_id, t.start, t.end) for t in terms),
                      epoch=epoch, cost_ms=round(estimate, 3), terms=terms, entry=entry_id, back=back)
        if best is None or total < best_total:
            best, best_total = route, total
    if best is None:
        raise NoRouteError(model_id, missing)
    return best


def _cheapest_chain(group: list[ShardOffer], n_layers: int, links: LinkTable, entry: str,
                    relayed: Callable[[str], bool], keep: frozenset[str], avoid: frozenset[str],
                    ) -> tuple[float, tuple[HopTerms, ...], Crossing] | None:
    """The cheapest chain of one compat key's offers from layer 0 to ``n_layers``: its cost with the
    keep discounts and avoid penalties, its hops' terms, and the crossing back to the entry."""
    layer_bytes = sorted(o.layer_bytes for o in group)
    seam_bytes = bundle_bytes(layer_bytes[len(layer_bytes) // 2])  # the median: one liar cannot set it

    def weight(peer_id: str, own_ms: float, link_ms: float) -> float:
        return ((own_ms + link_ms) * (KEEP_DISCOUNT if peer_id in keep else 1.0)
                + (AVOID_PENALTY_MS if peer_id in avoid else 0.0))

    # best[peer]: the cheapest chain from layer 0 ending with that peer: (cost, previous peer, its terms)
    best: dict[str, tuple[float, str | None, HopTerms]] = {}
    ending_at: dict[int, list[str]] = {}
    ranked: set[int] = set()
    for o in sorted(group, key=lambda x: (x.range or (0, 0), x.peer_id)):
        assert o.range is not None
        start, end = o.range
        if start == 0:
            sources: list[tuple[str | None, float]] = [(None, 0.0)]
        else:
            if start not in ranked:  # every chain ending there is final by now: cheapest first
                ranked.add(start)
                ending_at.get(start, []).sort(key=lambda p: best[p][0])
            sources = [(p, best[p][0]) for p in ending_at.get(start, [])]
        alone = hop_terms(o, NO_CROSSING)
        own = alone.compute_ms + alone.hop_ms
        least = weight(o.peer_id, own, 0.0)  # what this hop costs across a free link
        for previous, base in sources:
            if o.peer_id in best and base + least >= best[o.peer_id][0]:
                break  # the rest start dearer than the best found, and no link costs less than nothing
            source, nbytes = (entry, 0) if previous is None else (previous, seam_bytes)
            rtt, rate, *_ = _figures(links, source, o.peer_id, relayed)  # no objects until one is better
            cost = base + weight(o.peer_id, own, _crossing_ms(rtt, rate, nbytes))
            if o.peer_id not in best or cost < best[o.peer_id][0]:
                best[o.peer_id] = (cost, previous, hop_terms(o, crossing(links, source, o.peer_id, nbytes, relayed)))
        if o.peer_id in best:
            ending_at.setdefault(end, []).append(o.peer_id)
    chosen: tuple[float, str, Crossing] | None = None
    for tail in ending_at.get(n_layers, []):
        back = crossing(links, tail, entry, 0, relayed)
        total = best[tail][0] + back.cost_ms
        if chosen is None or total < chosen[0]:
            chosen = (total, tail, back)
    if chosen is None:
        return None
    total, tail, back = chosen
    path: list[HopTerms] = []
    at: str | None = tail
    while at is not None:
        _cost, previous, terms = best[at]
        path.append(terms)
        at = previous
    return total, tuple(reversed(path)), back
