"""Routes for the entry: asked of the tracker, or planned from this peer's own view when it does not answer.

The tracker is never on the data path, and losing it must not cost a session: a route request that
gets no answer in time is planned locally from the same gossip view. Either way the route uses as
few as it can of the peers that recently failed to answer or are suspected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from meshd.rpc import RpcFailed, call
from meshd.session.entry import PlannedRoute
from meshd.tracker.duties import TrackerDuties, route_from_reply
from meshd.tracker.routing import NoRouteError, plan_route
from meshd.tracker.view import MeshView, Route
from meshd.transport.streams import StreamOpener
from meshd.wire import rpc_pb2 as pb

log = logging.getLogger("meshd.session")

ROUTE_ASK_TIMEOUT_S = 2.0


class RouteClient:
    """A :class:`~meshd.session.entry.RouteSource` over the gossip view and the elected tracker."""

    def __init__(self, view: MeshView, opener: StreamOpener, tracker: Callable[[], str | None],
                 duties: TrackerDuties, excluded: Callable[[], frozenset[str]] = frozenset,
                 avoided: Callable[[], frozenset[str]] = frozenset,
                 on_route: Callable[[Route], None] = lambda _r: None) -> None:
        self.view = view
        self.avoided = avoided  # peers slower than their cards claim: used only where nothing else covers
        self.on_route = on_route  # told every route handed out (speed checks time its hops' claims)
        self.excluded = excluded  # peers this peer's audits caught computing wrong: in none of its routes
        self.opener = opener
        self.tracker = tracker
        self.duties = duties  # its epoch counter numbers locally planned routes too

    def is_alive(self, peer_id: str) -> bool:
        return self.view.is_alive(peer_id)

    def mark_unreachable(self, peer_id: str) -> None:
        self.view.mark_unreachable(peer_id)

    def demote(self, peer_id: str, why: str) -> None:
        self.view.demote(peer_id, why)

    async def route_for(self, model_id: str, exclude: frozenset[str] = frozenset(),
                        keep: frozenset[str] = frozenset(), avoid: frozenset[str] = frozenset(),
                        compat_key: str = "") -> PlannedRoute:
        """A route without ``exclude``, using as few avoided peers as it can (``avoid``, and peers this
        peer found unreachable or gossip suspects), favouring ``keep`` (the peers that hold a session
        being repaired), and only through peers of ``compat_key`` when given."""
        exclude = exclude | self.excluded() | frozenset(self.view.demoted())
        avoid = (avoid | self.view.avoided() | self.avoided()) - exclude
        route, source = await self._ask_tracker(model_id, exclude, keep, avoid, compat_key)
        if route is None:
            route = plan_route(model_id, self.view.offers(), self.view.rtt_of, epoch=self.duties.next_epoch(),
                               exclude=exclude, keep=keep, avoid=avoid, compat_key=compat_key)
        addresses = {}
        for hop in route.hops:
            address = self.view.address_of(hop.peer_id)
            if address is None:
                raise NoRouteError(model_id, [(hop.start, hop.end)])
            addresses[hop.peer_id] = address
        self.on_route(route)
        return PlannedRoute(route, addresses, source)

    async def _ask_tracker(self, model_id: str, exclude: frozenset[str], keep: frozenset[str],
                           avoid: frozenset[str], compat_key: str) -> tuple[Route | None, str]:
        tracker = self.tracker()
        if tracker is None:
            return None, "local"
        if tracker == self.view.self_id:
            return None, "tracker (self)"
        address = self.view.address_of(tracker)
        if address is None:
            return None, "local"
        request = pb.PeerRequest(route=pb.RouteRequest(model_id=model_id, exclude=sorted(exclude), keep=sorted(keep),
                                                       avoid=sorted(avoid), compat_key=compat_key))
        try:
            reply = await call(self.opener, tracker, address, request, timeout=ROUTE_ASK_TIMEOUT_S)
        except RpcFailed as exc:
            log.info("tracker %s gave no route (%s); planning locally", tracker[:12], exc)
            return None, "local"
        if reply.WhichOneof("body") == "no_route":
            raise NoRouteError(model_id, [(r.start, r.end) for r in reply.no_route.missing])
        if reply.WhichOneof("body") != "route":
            log.info("tracker %s answered a route request with %s; planning locally", tracker[:12],
                     reply.WhichOneof("body"))
            return None, "local"
        if compat_key and reply.route.compat_key != compat_key:
            log.warning("tracker %s answered with a route of another compat key; planning locally", tracker[:12])
            return None, "local"
        try:
            return route_from_reply(reply.route), f"tracker {tracker[:12]}"
        except ValueError as exc:
            log.warning("tracker %s sent an invalid route (%s); planning locally", tracker[:12], exc)
            return None, "local"
