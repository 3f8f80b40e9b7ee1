"""The tracker role's duties: answer route requests and place peers that wait for a range.

Whichever peer holds the tracker lease runs these; any eligible peer can take over, because every
decision is computed from the gossip view alone. Both duties are pure: ``route_reply`` turns a
request and the view into the reply, and ``placement_orders`` says which orders to send now. The
daemon performs what they return.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from meshd.tracker.placement import place
from meshd.tracker.routing import Links, NoRouteError, plan_route
from meshd.tracker.view import Crossing, Hop, HopTerms, Route, ShardOffer
from meshd.wire import rpc_pb2 as pb

PLACEMENT_RETRY_S = 30.0  # an order that did not lead to a loaded range is sent again after this


def _link_cost(c: Crossing | None) -> pb.LinkCost | None:
    if c is None:
        return None
    return pb.LinkCost(from_peer=c.from_peer, to_peer=c.to_peer, rtt_ms=c.rtt_ms, rate_bps=c.rate_bps, bytes=c.bytes,
                       latency_ms=c.latency_ms, transfer_ms=c.transfer_ms, rtt_measured=c.rtt_measured,
                       rate_measured=c.rate_measured, relayed=c.relayed)


def _crossing(m: pb.LinkCost) -> Crossing:
    return Crossing(from_peer=m.from_peer, to_peer=m.to_peer, rtt_ms=m.rtt_ms, rate_bps=m.rate_bps, bytes=m.bytes,
                    latency_ms=m.latency_ms, transfer_ms=m.transfer_ms, rtt_measured=m.rtt_measured,
                    rate_measured=m.rate_measured, relayed=m.relayed)


def route_to_reply(route: Route) -> pb.RouteReply:
    return pb.RouteReply(
        model_id=route.model_id, compat_key=route.compat_key, epoch=route.epoch, cost_ms=route.cost_ms,
        hops=[pb.RouteHop(peer_id=t.peer_id, start=t.start, end=t.end, compute_ms=t.compute_ms, seam_ms=t.seam_ms,
                          hop_ms=t.hop_ms, load_factor=t.load_factor, crossing=_link_cost(t.crossing))
              for t in route.terms],
        entry=route.entry, back=_link_cost(route.back),
    )


def route_from_reply(reply: pb.RouteReply) -> Route:
    """A route as a tracker sent it; one that does not tile its layers contiguously is refused. Its
    cost terms are the tracker's estimates, shown to operators and used for nothing else."""
    hops = tuple(Hop(h.peer_id, h.start, h.end) for h in reply.hops)
    if not hops or hops[0].start != 0 or any(a.end != b.start for a, b in itertools.pairwise(hops)):
        raise ValueError("the route does not tile its layers contiguously from 0")
    if any(h.end <= h.start for h in hops):
        raise ValueError("the route has an empty hop")
    terms = tuple(HopTerms(peer_id=h.peer_id, start=h.start, end=h.end, compute_ms=h.compute_ms, seam_ms=h.seam_ms,
                           hop_ms=h.hop_ms, load_factor=h.load_factor,
                           crossing=_crossing(h.crossing) if h.HasField("crossing") else None)
                  for h in reply.hops)
    return Route(model_id=reply.model_id, compat_key=reply.compat_key, hops=hops, epoch=reply.epoch,
                 cost_ms=reply.cost_ms, terms=terms, entry=reply.entry,
                 back=_crossing(reply.back) if reply.HasField("back") else None)


def no_route_reply(exc: NoRouteError) -> pb.NoRoute:
    return pb.NoRoute(model_id=exc.model_id, missing=[pb.LayerRange(start=s, end=e) for s, e in exc.missing])


@dataclass(frozen=True)
class Order:
    """A placement order to send: ``peer_id`` should load ``layers`` of the model."""

    peer_id: str
    model_id: str
    compat_key: str
    layers: tuple[int, int]

    def message(self) -> pb.PlacementOrder:
        return pb.PlacementOrder(model_id=self.model_id, compat_key=self.compat_key,
                                 range=pb.LayerRange(start=self.layers[0], end=self.layers[1]))


@dataclass
class TrackerDuties:
    retry_s: float = PLACEMENT_RETRY_S
    # (peer, compat key) -> (range, sent at): a peer that takes another numerics class is ordered anew at once
    _orders: dict[tuple[str, str], tuple[tuple[int, int], float]] = field(default_factory=dict)
    _epochs: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def next_epoch(self) -> int:
        return next(self._epochs)

    def route_reply(self, request: pb.RouteRequest, offers: Iterable[ShardOffer], links: Links,
                    entry: str | None = None) -> pb.RouteReply | pb.NoRoute:
        """The route for ``entry`` (the peer that asked: its API took the request), or why there is none."""
        try:
            route = plan_route(request.model_id, offers, links, epoch=self.next_epoch(),
                               exclude=frozenset(request.exclude), keep=frozenset(request.keep),
                               avoid=frozenset(request.avoid), compat_key=request.compat_key, entry=entry)
        except NoRouteError as exc:
            return no_route_reply(exc)
        return route_to_reply(route)

    def placement_orders(self, offers: Iterable[ShardOffer], now: float) -> list[Order]:
        """Orders for the peers that wait for a range and were not sent one recently."""
        by_model: dict[tuple[str, str, int], list[ShardOffer]] = {}
        for offer in offers:  # by layer count too: see plan_route; prefill workers cover nothing
            if offer.prefill_only:
                continue
            by_model.setdefault((offer.model_id, offer.compat_key, offer.n_layers), []).append(offer)
        self._orders = {k: order for k, order in self._orders.items() if now - order[1] < self.retry_s}
        orders = []
        for (model_id, compat_key, _n), group in sorted(by_model.items()):
            if not any(o.range is None and (o.peer_id, compat_key) not in self._orders for o in group):
                continue
            pending = {p: layers for (p, key), (layers, _sent) in self._orders.items() if key == compat_key}
            view = [o.placed(pending[o.peer_id]) if o.range is None and o.peer_id in pending else o for o in group]
            for peer_id, layers in sorted(place(view).items()):
                self._orders[(peer_id, compat_key)] = (layers, now)
                orders.append(Order(peer_id, model_id, compat_key, layers))
        return orders
