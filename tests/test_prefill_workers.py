"""Prefill workers' cost model: when a prompt's prefill moves to idle replicas of the decode route's
busy hops, and to which."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshd.session.prefill_workers import UNMEASURED_PREFILL_GAIN, plan_prefill_workers, prefill_ms
from meshd.tracker.duties import TrackerDuties
from meshd.tracker.links import LinkEstimate, LinkTable
from meshd.tracker.routing import NoRouteError, plan_route
from meshd.tracker.view import Hop, Route, ShardOffer

ENTRY = "entry"
KV_TOKEN = 20 * 1024  # bytes of KV one token takes on a range


def offer(peer: str, start: int, end: int, *, sessions: int = 0, prefill_ms_per_token: float = 1.0,
          compat: str = "k") -> ShardOffer:
    return ShardOffer(peer_id=peer, model_id="m", compat_key=compat, n_layers=16, layer_bytes=1, edge_bytes=0,
                      memory_budget_bytes=1, range=(start, end), ms_per_layer=5.0, active_sessions=sessions,
                      prefill_ms_per_token=prefill_ms_per_token, kv_token_bytes=KV_TOKEN)


ROUTE = Route("m", "k", (Hop("a", 0, 5), Hop("b", 5, 11), Hop("c", 11, 16)), epoch=1, cost_ms=0.0)


def busy_route(**changes: int) -> list[ShardOffer]:
    return [offer("a", 0, 5, sessions=changes.get("a", 1)), offer("b", 5, 11, sessions=changes.get("b", 1)),
            offer("c", 11, 16, sessions=changes.get("c", 1))]


class UniformLinks(LinkTable):
    """Every link between two peers measured alike."""

    def __init__(self, rtt_ms: float, rate_bps: float) -> None:
        super().__init__(ENTRY, lambda _peer: LinkEstimate(rtt_ms, rate_bps))
        self.estimate = LinkEstimate(rtt_ms, rate_bps)

    def link(self, a: str, b: str) -> LinkEstimate:
        return LinkEstimate(0.0, None) if a == b else self.estimate


def links(rtt_ms: float = 0.2, rate_bps: float = 10e9) -> LinkTable:
    return UniformLinks(rtt_ms, rate_bps)


def test_idle_replicas_of_a_busy_route_prefill_a_long_prompt():
    offers = [*busy_route(), offer("a2", 0, 5), offer("b2", 5, 11), offer("c2", 11, 16)]
    plan = plan_prefill_workers(ROUTE, offers, links(), ENTRY, cut=2000, chunk_tokens=512)
    assert plan is not None and plan.pays
    assert [h.peer_id for h in plan.hops] == ["a2", "b2", "c2"]
    assert [(h.start, h.end) for h in plan.hops] == [(0, 5), (5, 11), (11, 16)]
    assert plan.workers_ms < plan.route_ms
    assert plan.route_ms == pytest.approx(3 * 2000 * 1.0 * 1.5)  # three hops, each loaded by one session


def test_an_idle_route_prefills_its_own_prompts():
    offers = [*busy_route(a=0, b=0, c=0), offer("b2", 5, 11)]
    assert plan_prefill_workers(ROUTE, offers, links(), ENTRY, cut=2000, chunk_tokens=512) is None


def test_the_entrys_own_sessions_count_as_load_when_cards_lag():
    offers = [*busy_route(a=0, b=0, c=0), offer("b2", 5, 11)]
    plan = plan_prefill_workers(ROUTE, offers, links(), ENTRY, cut=2000, chunk_tokens=512, sessions={"b": 2})
    assert plan is not None and plan.pays and [h.peer_id for h in plan.hops] == ["a", "b2", "c"]


def test_only_exact_idle_replicas_in_the_same_compat_key_are_workers():
    offers = [*busy_route(),
              offer("other-range", 5, 10), offer("other-key", 5, 11, compat="k2"), offer("busy", 5, 11, sessions=1)]
    assert plan_prefill_workers(ROUTE, offers, links(), ENTRY, cut=2000, chunk_tokens=512) is None
    assert plan_prefill_workers(ROUTE, [*offers, offer("b2", 5, 11)], links(), ENTRY, cut=2000, chunk_tokens=512,
                                exclude=frozenset({"b2"})) is None


def test_an_unmeasured_link_is_taken_at_the_default_rate():
    offers = [*busy_route(), offer("b2", 5, 11)]
    # 40 MB of KV at the 100 Mbit/s an unmeasured link is taken for: 3.3 s, more than the 1 s it saves
    plan = plan_prefill_workers(ROUTE, offers, LinkTable(ENTRY, lambda _p: LinkEstimate()), ENTRY, cut=2000,
                                chunk_tokens=512)
    assert plan is not None and not plan.pays


def test_a_slow_link_makes_the_route_prefill_itself():
    offers = [*busy_route(), offer("b2", 5, 11)]
    fast = plan_prefill_workers(ROUTE, offers, links(), ENTRY, cut=2000, chunk_tokens=512)
    assert fast is not None and fast.pays and [h.peer_id for h in fast.hops] == ["a", "b2", "c"]
    # 40 MB of KV over 10 Mbit/s takes half a minute: recomputing on the loaded route is faster
    slow = plan_prefill_workers(ROUTE, offers, links(rate_bps=10e6), ENTRY, cut=2000, chunk_tokens=512)
    assert slow is not None and not slow.pays and slow.workers_ms > 30_000


def test_a_slower_worker_than_the_loaded_hop_is_not_used():
    offers = [*busy_route(), offer("b2", 5, 11, prefill_ms_per_token=3.0)]  # 3x slower, the hop only 1.5x loaded
    plan = plan_prefill_workers(ROUTE, offers, links(), ENTRY, cut=2000, chunk_tokens=512)
    assert plan is not None and not plan.pays


def test_the_fastest_of_several_replicas_is_chosen():
    offers = [*busy_route(), offer("b2", 5, 11, prefill_ms_per_token=0.9),
              offer("b3", 5, 11, prefill_ms_per_token=0.5)]
    plan = plan_prefill_workers(ROUTE, offers, links(), ENTRY, cut=2000, chunk_tokens=512)
    assert plan is not None and plan.pays and plan.hops[1].peer_id == "b3"


def test_a_route_hop_missing_from_the_offers_gets_no_workers():
    offers = [offer("a", 0, 5, sessions=1), offer("c", 11, 16, sessions=1), offer("b2", 5, 11)]
    assert plan_prefill_workers(ROUTE, offers, links(), ENTRY, cut=2000, chunk_tokens=512) is None


def test_unmeasured_prefill_is_estimated_from_decode_speed():
    unmeasured = replace(offer("b", 5, 11), prefill_ms_per_token=0.0)
    assert prefill_ms(unmeasured, 100) == pytest.approx(100 * 6 * 5.0 / UNMEASURED_PREFILL_GAIN)
    assert prefill_ms(offer("b", 5, 11, prefill_ms_per_token=2.0), 100) == pytest.approx(200.0)


def test_prefill_only_peers_are_workers_and_never_hops_of_a_route():
    worker = replace(offer("b2", 5, 11), prefill_only=True, ms_per_layer=0.01)  # the fastest decode, too
    offers = [*busy_route(), worker]
    route = plan_route("m", offers, links(), entry=ENTRY)
    assert [h.peer_id for h in route.hops] == ["a", "b", "c"]
    with pytest.raises(NoRouteError):
        plan_route("m", [offers[0], worker, offers[2]], links(), entry=ENTRY)
    plan = plan_prefill_workers(ROUTE, offers, links(), ENTRY, cut=2000, chunk_tokens=512)
    assert plan is not None and plan.pays and plan.hops[1].peer_id == "b2"


def test_a_prefill_only_peer_is_never_placed_and_covers_nothing():
    unplaced = replace(offer("new", 0, 5), range=None, memory_budget_bytes=10**12)
    worker = replace(offer("b2", 5, 11), prefill_only=True)
    orders = TrackerDuties("t").placement_orders([offer("a", 0, 5), worker, unplaced], now=0.0)
    assert [(o.peer_id, o.layers) for o in orders] == [("new", (5, 16))]  # the worker's layers count as uncovered


def test_a_cards_prefill_figure_moves_only_when_the_measurement_moved_clearly():
    from meshd.runtime.served_model import card_figure

    assert card_figure(0.0, 0.0) == 0.0 and card_figure(0.0, 1234.5) == 1200.0  # first measurement
    assert card_figure(1200.0, 1400.0) == 1200.0 and card_figure(1200.0, 1000.0) == 1200.0  # within the band
    assert card_figure(1200.0, 1600.0) == 1600.0 and card_figure(1200.0, 900.0) == 900.0  # beyond it
    assert card_figure(1200.0, 0.0) == 1200.0  # no measurement: the last figure stays
