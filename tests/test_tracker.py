"""Placement and routing over a gossip view."""

from __future__ import annotations

import pytest

from meshd.tracker.duties import TrackerDuties
from meshd.tracker.placement import place
from meshd.tracker.routing import NoRouteError, plan_route
from meshd.tracker.view import ShardOffer

LAYER = 100
EDGE = 50


def offer(pid, budget, rng=None, n=4, compat_key="k", **kw) -> ShardOffer:
    return ShardOffer(peer_id=pid, model_id="m", compat_key=compat_key, n_layers=n, layer_bytes=LAYER,
                      edge_bytes=EDGE, memory_budget_bytes=budget, range=rng, **kw)


def test_three_peers_cover_the_model_without_manual_ranges():
    plan = place([offer("a", 2 * LAYER + EDGE), offer("b", LAYER + EDGE), offer("c", LAYER + EDGE)])
    covered = sorted(plan.values())
    assert covered == [(0, 2), (2, 3), (3, 4)]


def test_weakest_layers_are_filled_first():
    existing = [offer("a", 10_000, (0, 4)), offer("b", 10_000, (0, 2))]
    plan = place([*existing, offer("c", 2 * LAYER + EDGE)])
    assert plan == {"c": (2, 4)}


def test_placement_keeps_ranges_tileable():
    mb = 1
    offers = [ShardOffer(f"p{i}", "m", "k", 16, 45 * mb, 131 * mb, budget, None)
              for i, budget in enumerate([6 * 45 + 131, 5 * 45 + 131, 5 * 45 + 131])]
    plan = place(offers)
    placed = [ShardOffer(o.peer_id, "m", "k", 16, 45, 131, 0, plan[o.peer_id]) for o in offers]
    route = plan_route("m", placed, rtt_ms=lambda p: 1.0)
    assert [(h.start, h.end) for h in route.hops] == sorted(plan.values())
    assert route.hops[-1].end == 16


def test_budget_limits_the_range_and_big_budget_takes_everything():
    assert place([offer("a", 10 * LAYER)]) == {"a": (0, 4)}
    assert place([offer("a", 3 * LAYER + EDGE)]) == {"a": (0, 3)}
    assert place([offer("a", 10)]) == {}


def test_route_prefers_one_peer_holding_everything():
    offers = [offer("a", 0, (0, 2)), offer("b", 0, (2, 4)), offer("c", 0, (0, 4))]
    route = plan_route("m", offers, rtt_ms=lambda p: 1.0)
    assert [h.peer_id for h in route.hops] == ["c"]


def test_route_tiles_exactly_and_avoids_loaded_or_slow_peers():
    offers = [offer("a", 0, (0, 2)), offer("b", 0, (2, 4)), offer("c", 0, (2, 4), active_sessions=6),
              offer("d", 0, (0, 1))]
    route = plan_route("m", offers, rtt_ms=lambda p: 1.0, epoch=3)
    assert [(h.peer_id, h.start, h.end) for h in route.hops] == [("a", 0, 2), ("b", 2, 4)]
    assert route.epoch == 3 and len(route.terms) == 2
    far = plan_route("m", offers, rtt_ms=lambda p: 50.0 if p == "b" else 1.0)
    assert [h.peer_id for h in far.hops] == ["a", "c"]


def test_missing_layers_are_reported():
    with pytest.raises(NoRouteError) as info:
        plan_route("m", [offer("a", 0, (0, 1)), offer("b", 0, (3, 4))], rtt_ms=lambda p: 1.0)
    assert info.value.missing == [(1, 3)]
    with pytest.raises(NoRouteError):
        plan_route("m", [offer("a", 0, (0, 4))], rtt_ms=lambda p: 1.0, exclude=frozenset({"a"}))


def test_incompatible_hops_are_never_mixed():
    offers = [offer("a", 0, (0, 2)), ShardOffer("b", "m", "other", 4, LAYER, EDGE, 0, (2, 4))]
    with pytest.raises(NoRouteError):
        plan_route("m", offers, rtt_ms=lambda p: 1.0)


def test_a_route_never_mixes_compat_keys():
    """Two numerics classes that only together cover the model give no route; each whole class does."""
    offers = [offer("a1", 1, (0, 2), compat_key="class-a"), offer("b1", 1, (2, 4), compat_key="class-b")]
    with pytest.raises(NoRouteError):
        plan_route("m", offers, lambda _p: 1.0)
    offers += [offer("a2", 1, (2, 4), compat_key="class-a"), offer("b0", 1, (0, 4), compat_key="class-b")]
    assert plan_route("m", offers, lambda _p: 1.0).compat_key == "class-b"  # one hop is cheapest
    kept = plan_route("m", offers, lambda _p: 1.0, compat_key="class-a")
    assert kept.compat_key == "class-a" and [h.peer_id for h in kept.hops] == ["a1", "a2"]


def test_a_peer_claiming_another_layer_count_under_a_compat_key_disturbs_nothing():
    """The compat key commits to the config, so honest peers of one key agree on the layer count; a
    card that claims the key with other layers (and ranges beyond the honest count) is planned apart."""
    honest = [offer("a", 0, (0, 2)), offer("b", 0, (2, 4)), offer("c", 10 * LAYER + 2 * EDGE)]
    liar = offer("z", 0, (4, 8), n=8)
    for offers in ([*honest, liar], [liar, *honest]):
        route = plan_route("m", offers, lambda _p: 1.0)
        assert [h.peer_id for h in route.hops] == ["a", "b"]
        orders = TrackerDuties().placement_orders(offers, now=0.0)
        assert [(o.peer_id, o.layers) for o in orders] == [("c", (0, 4))]


def test_a_card_claiming_a_billion_layers_offers_nothing():
    """Placement and routing work per layer: a signed card claiming 2**32 - 1 layers would have had
    the tracker allocate a table of that size (found by the fuzzer as an out-of-memory kill)."""
    from meshd.tracker.view import MAX_LAYERS, offers_of
    from meshd.wire import card_pb2 as cpb

    card = cpb.CapabilityCard(peer_id="z", models=[cpb.ModelServed(model_id="m", compat_key="k", n_layers=2**32 - 1,
                                                                    layer_bytes=1)], memory_budget_bytes=2**63)
    assert offers_of(card) == []
    card.models[0].n_layers = MAX_LAYERS
    assert len(offers_of(card)) == 1


def test_placement_orders_are_sent_once_per_compat_key_until_they_are_due_again():
    """An order not yet followed is not repeated before ``retry_s``; a peer that meanwhile took another
    numerics class (and so offers another compat key) is ordered in that one at once."""
    duties = TrackerDuties(retry_s=30.0)
    whole = 4 * LAYER + 2 * EDGE
    assert [(o.peer_id, o.compat_key) for o in duties.placement_orders([offer("a", whole)], now=0.0)] == [("a", "k")]
    assert duties.placement_orders([offer("a", whole)], now=10.0) == []
    moved = [offer("b", whole, (0, 4), compat_key="k2"), offer("a", whole, compat_key="k2")]
    orders = duties.placement_orders(moved, now=11.0)
    assert [(o.peer_id, o.compat_key) for o in orders] == [("a", "k2")]
    assert duties.placement_orders(moved, now=12.0) == []
    assert [o.peer_id for o in duties.placement_orders(moved, now=41.5)] == ["a"], "due again"
