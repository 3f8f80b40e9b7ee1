"""Routes priced by the links a token crosses: measured between peers, published in cards, planned
pairwise (entry -> head, each seam, tail -> entry)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from meshd.cli import mesh_cmd
from meshd.daemon.status import route_as_json
from meshd.gossip import GossipNode
from meshd.identity import Identity
from meshd.tracker.duties import TrackerDuties, route_from_reply
from meshd.tracker.links import (
    MAX_PUBLISHED,
    MAX_RATE_BPS,
    MAX_RTT_US,
    PUBLISH_MAX_AGE_S,
    RATE_SAMPLE_BYTES,
    RTT_SAMPLE_MAX_BYTES,
    LinkEstimate,
    LinkMeter,
    LinkTable,
    drifted,
    links_of,
)
from meshd.tracker.routing import (
    PER_HOP_MS,
    RELAY_PENALTY_MS,
    UNMEASURED_RATE_BPS,
    UNMEASURED_RTT_MS,
    bundle_bytes,
    plan_route,
)
from meshd.tracker.view import MeshView, ShardOffer
from meshd.wire import card_pb2 as cpb
from meshd.wire import rpc_pb2 as pb

MIB = 1024 * 1024


def offer(peer_id: str, rng: tuple[int, int], ms_per_layer: float = 1.0, relayed: bool = False,
          n: int = 4) -> ShardOffer:
    return ShardOffer(peer_id=peer_id, model_id="m", compat_key="k", n_layers=n, layer_bytes=200 * MIB,
                      edge_bytes=MIB, memory_budget_bytes=0, range=rng, ms_per_layer=ms_per_layer, relayed=relayed)


def card(peer_id: str, relayed: bool = False, **rtt_ms: float) -> cpb.CapabilityCard:
    """A card of ``peer_id`` publishing its round trips to the peers named."""
    return cpb.CapabilityCard(
        peer_id=peer_id, addresses=[] if relayed else [f"{peer_id}:7700"],
        relay_addresses=["relay:1"] if relayed else [],
        links=[cpb.LinkMeasure(peer_id=other, rtt_us=round(ms * 1000)) for other, ms in rtt_ms.items()])


def table(planner: str, own: dict[str, float], *cards: cpb.CapabilityCard) -> LinkTable:
    by_peer = {c.peer_id: c for c in cards}
    return LinkTable(planner, lambda p: LinkEstimate(own.get(p), None), by_peer.get)


def test_a_fast_link_between_hops_wins_where_the_planners_own_round_trips_point_the_other_way():
    """The tracker is near b and far from c, but what the token crosses is a -> b or a -> c."""
    offers = [offer("a", (0, 2)), offer("b", (2, 4)), offer("c", (2, 4))]
    links = table("t", {"a": 1.0, "b": 1.0, "c": 30.0},
                  card("e", a=1.0, b=1.0, c=1.0), card("a", b=40.0, c=2.0))
    assert [h.peer_id for h in plan_route("m", offers, lambda p: {"a": 1.0, "b": 1.0, "c": 30.0}[p]).hops] == ["a", "b"]
    route = plan_route("m", offers, links, entry="e")
    assert [h.peer_id for h in route.hops] == ["a", "c"]
    seam = route.terms[1].crossing
    assert seam is not None and (seam.from_peer, seam.to_peer, seam.rtt_ms, seam.rtt_measured) == ("a", "c", 2.0, True)
    assert seam.bytes == bundle_bytes(200 * MIB) and seam.transfer_ms > 0  # a hidden state crosses a seam
    assert route.entry == "e" and route.back is not None and route.back.from_peer == "c"


def test_the_entrys_link_to_the_head_counts():
    offers = [offer("a1", (0, 2)), offer("a2", (0, 2)), offer("b", (2, 4))]
    links = table("t", {"a1": 1.0, "a2": 1.0, "b": 1.0}, card("e", a1=30.0, a2=2.0, b=1.0),
                  card("b", a1=1.0, a2=1.0))
    route = plan_route("m", offers, links, entry="e")
    assert [h.peer_id for h in route.hops] == ["a2", "b"]
    head = route.terms[0].crossing
    assert head is not None and (head.from_peer, head.latency_ms, head.transfer_ms) == ("e", 1.0, 0.0)
    assert route.back is not None and (route.back.to_peer, route.back.latency_ms) == ("e", 0.5)
    terms = route.terms
    assert route.cost_ms == pytest.approx(sum(t.compute_ms + t.seam_ms + t.hop_ms for t in terms) + 0.5)


def test_a_peer_holding_the_whole_model_serves_alone_when_it_is_as_fast():
    links = table("t", {}, card("e", s=1.0, a=1.0, b=1.0), card("a", b=1.0))
    split = [offer("a", (0, 2)), offer("b", (2, 4))]
    assert [h.peer_id for h in plan_route("m", [*split, offer("s", (0, 4))], links, entry="e").hops] == ["s"]
    alone = plan_route("m", [*split, offer("s", (0, 4))], links, entry="s")  # the entry holds it all: no link at all
    assert [h.peer_id for h in alone.hops] == ["s"]
    assert alone.cost_ms == pytest.approx(4 * 1.0 + PER_HOP_MS)
    # twice as slow per layer, it loses to two hops that split the work
    assert [h.peer_id for h in plan_route("m", [*split, offer("s", (0, 4), ms_per_layer=2.0)], links,
                                          entry="e").hops] == ["a", "b"]


def test_unmeasured_links_cost_the_defaults_and_a_relayed_end_the_relay_penalty_until_measured():
    offers = [offer("a", (0, 2), relayed=True), offer("b", (2, 4))]
    route = plan_route("m", offers, table("t", {}), entry="e")
    head, seam = (t.crossing for t in route.terms)
    assert head is not None and seam is not None and route.back is not None
    assert (head.rtt_ms, head.relayed, head.rtt_measured) == (UNMEASURED_RTT_MS + RELAY_PENALTY_MS, True, False)
    assert (seam.rtt_ms, seam.rate_bps, seam.rate_measured) == (UNMEASURED_RTT_MS + RELAY_PENALTY_MS,
                                                               UNMEASURED_RATE_BPS, False)
    assert (route.back.rtt_ms, route.back.relayed) == (UNMEASURED_RTT_MS, False)
    # measured, the relay path is in the round trip already: no penalty on top
    measured = plan_route("m", offers, table("t", {}, card("a", relayed=True, b=2.0)), entry="e")
    seam = measured.terms[1].crossing
    assert seam is not None and (seam.rtt_ms, seam.relayed, seam.rtt_measured) == (2.0, True, True)
    # an entry reached only through a relay is a relayed end too (its card says so)
    via_relay = plan_route("m", [offer("b", (0, 4))], table("t", {}, card("e", relayed=True)), entry="e")
    assert via_relay.terms[0].crossing is not None and via_relay.terms[0].crossing.relayed


def test_a_bare_round_trip_function_plans_for_the_planner_as_entry():
    route = plan_route("m", [offer("a", (0, 2)), offer("b", (2, 4))], lambda p: {"a": 4.0, "b": 6.0}[p])
    head, seam = (t.crossing for t in route.terms)
    assert head is not None and seam is not None and route.back is not None
    assert (head.latency_ms, route.back.latency_ms) == (2.0, 3.0)
    assert (seam.rtt_ms, seam.rtt_measured) == (UNMEASURED_RTT_MS, False)  # between two others: not known


def test_forged_or_out_of_range_link_measures_are_ignored_one_by_one():
    forged = cpb.CapabilityCard(peer_id="a", links=[
        cpb.LinkMeasure(peer_id="a", rtt_us=1),                      # itself
        cpb.LinkMeasure(peer_id="", rtt_us=1),                       # nobody
        cpb.LinkMeasure(peer_id="x" * 500, rtt_us=1),                # no peer id is that long
        cpb.LinkMeasure(peer_id="b", rtt_us=2**32 - 1, rate_bps=2**64 - 1),  # beyond any real link
        cpb.LinkMeasure(peer_id="c", rtt_us=0, rate_bps=1),          # nothing measured, a rate below any link
        cpb.LinkMeasure(peer_id="d", rtt_us=3000, rate_bps=10**9),
        cpb.LinkMeasure(peer_id="d", rtt_us=1, rate_bps=MAX_RATE_BPS),  # a second word on d
        *[cpb.LinkMeasure(peer_id=f"z{i}", rtt_us=1000) for i in range(30)],
    ])
    published = links_of(forged)
    assert published["d"] == LinkEstimate(3.0, 1e9)
    assert not {"a", "", "x" * 500, "b", "c"} & set(published)
    assert len(published) <= MAX_PUBLISHED and "z29" not in published
    assert links_of(cpb.CapabilityCard(peer_id="a", links=[cpb.LinkMeasure(peer_id="b", rtt_us=MAX_RTT_US)]))[
        "b"].rtt_ms == MAX_RTT_US / 1000
    route = plan_route("m", [offer("a", (0, 2)), offer("b", (2, 4))], table("t", {}, forged), entry="e")
    seam = route.terms[1].crossing
    assert seam is not None and not seam.rtt_measured and not seam.rate_measured


def test_one_end_cannot_make_a_link_look_better_than_the_other_measured_it():
    links = table("t", {}, card("a", b=0.001), card("b", a=30.0))
    assert links.link("a", "b").rtt_ms == 30.0 == links.link("b", "a").rtt_ms
    # the planner's own measurement of a link it is an end of stands
    assert table("a", {"b": 2.0}, card("b", a=30.0)).link("a", "b").rtt_ms == 2.0


def test_a_card_with_the_most_link_measures_stays_small():
    meter = LinkMeter()
    others = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(1, 2 * MAX_PUBLISHED + 1)]
    for i, peer_id in enumerate(others):
        meter.record_rtt(peer_id, 59_000.0, now=float(i))  # as large as a published round trip gets
        meter.record_transfer(peer_id, RATE_SAMPLE_BYTES, 0.0, 1e-9)  # and a rate at the cap
    measures = meter.published(now=float(len(others)))
    assert len(measures) == MAX_PUBLISHED and all(m.rtt_us and m.rate_bps == MAX_RATE_BPS for m in measures)
    links_bytes = cpb.CapabilityCard(links=measures).ByteSize()
    assert links_bytes <= MAX_PUBLISHED * 50, links_bytes  # a 32-character peer id, the largest figures, the tag
    me = Identity.from_seed(b"\x09" * 32)
    full = cpb.CapabilityCard(
        name="a-long-operator-name", addresses=["203.0.113.200:7700"], relay_addresses=["relay:198.51.100.7:7800"],
        api_address="203.0.113.200:8000", tracker_eligible=True, software_version="0.12.3",
        hardware=cpb.Hardware(ram_bytes=2**40, device="cuda:0", cpu_count=128, device_memory_bytes=2**37),
        models=[cpb.ModelServed(model_id="meta-llama/Llama-3.1-70B-Instruct", compat_key="f" * 64, n_layers=80,
                                range_start=40, range_end=80, decode_tok_s=1234.5, layer_bytes=2**31,
                                edge_bytes=2**32, context_length=131072, numerics="cuda-bfloat16-sdpa-tf32",
                                backend="torch")],
        load=cpb.Load(active_sessions=64, queued=128), kv_free_bytes=2**40, memory_budget_bytes=2**40,
        links=measures)
    from meshd.cards.card import CardIssuer

    signed = CardIssuer(me, full).issue(now_ms=1_700_000_000_000)
    # the default card budget is 2 KiB a second; a full card of 16 links fits it with room to spare
    assert signed.ByteSize() < 2048, signed.ByteSize()


def test_round_trips_come_from_small_requests_and_rates_from_runs_of_bulk_transfers():
    meter = LinkMeter()
    meter.record_rtt("b", 2.0, now=0.0, nbytes=300)
    meter.record_rtt("b", 50.0, now=0.1, nbytes=RTT_SAMPLE_MAX_BYTES + 1)  # a push-pull full of cards: no sample
    assert meter.estimate("b") == LinkEstimate(2.0, None)
    # 1 MiB chunks, two in flight at a time: 4 MiB in 0.4 s is what the link delivered
    for k in range(4):
        meter.record_transfer("b", MIB, started=1.0 + 0.2 * (k // 2), ended=1.2 + 0.2 * (k // 2))
    rate = meter.estimate("b").rate_bps
    assert rate == pytest.approx(4 * MIB * 8 / 0.4)
    # too few bytes to tell, or a run broken by a long pause: no sample
    meter.record_transfer("c", MIB, 0.0, 0.01)
    meter.record_transfer("c", 3 * MIB, 10.0, 10.03)
    assert meter.estimate("c").rate_bps is None
    meter.record_transfer("c", MIB, 10.03, 10.04)
    assert meter.estimate("c").rate_bps == pytest.approx(4 * MIB * 8 / 0.04)


def test_a_card_publishes_the_serving_peers_first_and_nothing_stale():
    meter = LinkMeter()
    for i in range(MAX_PUBLISHED + 4):
        meter.record_rtt(f"p{i:02}", 1.0, now=100.0 + i)
    meter.record_rtt("old", 1.0, now=0.0)
    meter.record_rtt("holder", 1.0, now=1.0)  # long ago, but it serves layers
    now = 1.0 + PUBLISH_MAX_AGE_S
    ids = [m.peer_id for m in meter.published(now, serving={"holder", "old"}.__contains__)]
    assert "holder" in ids and "old" not in ids and len(ids) == MAX_PUBLISHED
    assert ids == sorted(ids) and "p19" in ids and "p00" not in ids  # then the most recently measured
    # those in the card already keep their place while they stay fresh: the set does not churn
    kept = [m.peer_id for m in meter.published(now, serving={"holder"}.__contains__, held={"p00", "p01"})]
    assert {"holder", "p00", "p01"} <= set(kept) and "p04" not in kept and len(kept) == MAX_PUBLISHED


def test_only_links_that_moved_issue_a_new_card():
    held = [cpb.LinkMeasure(peer_id="b", rtt_us=2000, rate_bps=10**8)]
    assert not drifted(held, [cpb.LinkMeasure(peer_id="b", rtt_us=2900, rate_bps=14 * 10**7)])  # jitter
    assert drifted(held, [cpb.LinkMeasure(peer_id="b", rtt_us=9000, rate_bps=10**8)])
    assert drifted(held, [cpb.LinkMeasure(peer_id="b", rtt_us=2000, rate_bps=10**9)])
    assert drifted(held, [*held, cpb.LinkMeasure(peer_id="c", rtt_us=2000)])
    assert drifted(held, [cpb.LinkMeasure(peer_id="b", rtt_us=2000)])  # its rate no longer fresh


def test_the_view_reads_links_from_the_cards_it_holds():
    me = GossipNode.with_identity(Identity.from_seed(b"\1" * 32), cpb.CapabilityCard(addresses=["me:1"]),
                                  rng=random.Random(1))
    third = Identity.from_seed(b"\3" * 32).peer_id
    other = GossipNode.with_identity(Identity.from_seed(b"\2" * 32), rng=random.Random(2), template=cpb.CapabilityCard(
        addresses=["other:1"], links=[cpb.LinkMeasure(peer_id=third, rtt_us=7000, rate_bps=5 * 10**8)]))
    other.tick(0.0)
    me.on_card(other.store.get(other.self_id).signed, 0.0)
    view = MeshView(me, clock=lambda: 5.0)
    view.record_rtt(other.self_id, 3.0, wall_now=0.0)
    links = view.rtt_of  # what a planner handed the view's round trips gets
    assert links(other.self_id) == 3.0 and links(me.self_id) == 0.0
    assert links.link(other.self_id, third) == LinkEstimate(7.0, 5e8)
    assert links.link(me.self_id, other.self_id).rtt_ms == 3.0
    assert [m.peer_id for m in view.published_links()] == [other.self_id]


def test_the_tracker_plans_for_the_entry_that_asked_and_its_reply_carries_the_terms():
    offers = [offer("a", (0, 2)), offer("b", (2, 4))]
    links = table("t", {}, card("e", a=4.0, b=2.0), card("a", b=6.0))
    reply = TrackerDuties().route_reply(pb.RouteRequest(model_id="m"), offers, links, entry="e")
    assert isinstance(reply, pb.RouteReply) and reply.entry == "e"
    route = route_from_reply(pb.RouteReply.FromString(reply.SerializeToString()))
    assert route.entry == "e" and route.back is not None and route.back.latency_ms == 1.0
    assert [(t.crossing.from_peer, t.crossing.rtt_ms) for t in route.terms if t.crossing] == [("e", 4.0), ("a", 6.0)]
    assert route == plan_route("m", offers, links, epoch=route.epoch, entry="e")


def test_meshctl_route_shows_each_crossing_and_its_json_matches_the_schema(monkeypatch, capsys):
    import jsonschema

    offers = [offer("aaaaaaaaaaaaaaaa", (0, 2), relayed=True), offer("bbbbbbbbbbbbbbbb", (2, 4))]
    links = LinkTable("t", lambda _p: LinkEstimate(), {
        "eeeeeeeeeeeeeeee": card("eeeeeeeeeeeeeeee", bbbbbbbbbbbbbbbb=0.8),
        "aaaaaaaaaaaaaaaa": cpb.CapabilityCard(peer_id="aaaaaaaaaaaaaaaa", relay_addresses=["relay:1"], links=[
            cpb.LinkMeasure(peer_id="bbbbbbbbbbbbbbbb", rtt_us=2400, rate_bps=940_000_000)])}.get)
    route = plan_route("m", offers, links, epoch=7, entry="eeeeeeeeeeeeeeee")
    doc = json.loads(json.dumps(route_as_json(route, "tracker tttttttttttt")))
    schema = json.loads((Path(mesh_cmd.__file__).parent / "schemas" / "route.json").read_text())
    jsonschema.validate(doc, schema)
    monkeypatch.setattr(mesh_cmd, "control_get", lambda _args, _path: doc)
    assert mesh_cmd._cmd_route(argparse.Namespace(model="m", json=False)) == 0
    shown = capsys.readouterr().out
    print(shown)
    assert f"estimated {route.cost_ms:.3f} ms/token" in shown
    assert "rtt 6.00ms default+relay" in shown  # entry -> the relayed head: never measured
    assert "rtt 2.40ms measured (relayed)" in shown and "at 940 Mbit/s measured" in shown
    assert "rtt 0.80ms measured" in shown.splitlines()[-1]  # the tail's token back to the entry
