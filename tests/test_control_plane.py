"""Two control planes gossiping over an in-memory network, on the real clock: a gossip answer rides on
the reply to the RPC that asked for it, a peer the transport hears from is not probed, and failure
detection works as before."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import trio

from meshd.daemon.config import PeerConfig
from meshd.daemon.control_plane import ControlPlane
from meshd.gossip import MemberState
from meshd.identity import Identity
from meshd.rpc import RpcRouter
from meshd.transport.memory import MemoryNetwork
from meshd.wire import card_pb2 as cpb

# push-pulls seldom, so that pings are what keeps each peer hearing from the other
CONFIG = {"pushpull_interval_s": 5.0}


async def two_planes(nursery: trio.Nursery, arrived: list[tuple[str, str, str]],
                     last_received_by_a: Callable[[dict[str, str]], Mapping[str, float]] | None = None,
                     ) -> tuple[ControlPlane, ControlPlane]:
    """Planes ``a`` and ``b`` (which joins through ``a``), started; every gossip message that arrives as
    an RPC of its own is recorded as (receiver, sender, kind). ``last_received_by_a``, given the names'
    peer ids, is what ``a``'s transport reports having heard."""
    network = MemoryNetwork()
    planes: dict[str, ControlPlane] = {}
    ids: dict[str, str] = {}
    for name, bootstrap in (("a", []), ("b", ["a.test:1"])):
        identity = Identity.generate()
        ids[identity.peer_id] = name
        router = RpcRouter()
        address = f"{name}.test:1"
        opener = network.join(identity.peer_id, address, router.serve, nursery)
        heard = None
        if name == "a" and last_received_by_a is not None:
            heard = lambda: last_received_by_a({n: p for p, n in ids.items()})  # noqa: E731
        plane = ControlPlane(identity, PeerConfig(bootstrap=bootstrap, **CONFIG), opener,
                             card=lambda a=address: cpb.CapabilityCard(addresses=[a]),
                             directly_reachable=lambda: True, last_received=heard)

        async def on_gossip(sender, message, plane=plane, name=name):
            arrived.append((name, ids.get(sender, "?"), message.WhichOneof("body") or ""))
            return await plane.on_gossip(sender, message)

        router.register("gossip", on_gossip)
        planes[name] = plane
        await nursery.start(plane.run, lambda: None)
    a, b = planes["a"], planes["b"]
    deadline = time.monotonic() + 10
    while not (a.gossip.members().get(b.peer_id) == MemberState.ALIVE
               and b.gossip.members().get(a.peer_id) == MemberState.ALIVE):
        assert time.monotonic() < deadline, "the two never met"
        await trio.sleep(0.05)
    return a, b


async def watch_both_alive(a: ControlPlane, b: ControlPlane) -> None:
    """Several probe rounds, longer than a probe's timeout plus the suspicion timeout would allow an
    unanswered probe to go unnoticed."""
    watch_until = time.monotonic() + 4 * a.config.probe_interval_s + a.config.suspect_timeout_s
    while time.monotonic() < watch_until:
        assert a.gossip.members()[b.peer_id] == MemberState.ALIVE
        assert b.gossip.members()[a.peer_id] == MemberState.ALIVE
        await trio.sleep(0.05)


async def test_an_answer_rides_on_the_reply_and_probes_keep_both_peers_alive():
    arrived: list[tuple[str, str, str]] = []
    async with trio.open_nursery() as nursery:
        a, b = await two_planes(nursery, arrived)
        await watch_both_alive(a, b)
        seen = a.view.last_seen(b.peer_id)  # what /peers shows as last_seen_s: gossip's own record
        assert seen is not None and time.time() - seen < 2 * a.config.probe_interval_s
        nursery.cancel_scope.cancel()
    kinds = [kind for _, _, kind in arrived]
    assert kinds.count("ping") >= 4 and "push_pull" in kinds
    assert "ack" not in kinds  # every ack came back in the reply to its ping


async def test_a_peer_the_transport_hears_from_is_not_probed_but_stays_alive():
    """``a``'s transport reports bytes from ``b`` all the time (as a route's traffic would): ``a`` sends
    ``b`` no pings, while ``b``, told nothing of the sort, keeps probing ``a``."""
    arrived: list[tuple[str, str, str]] = []
    async with trio.open_nursery() as nursery:
        a, b = await two_planes(nursery, arrived, lambda ids: {ids["b"]: time.monotonic()} if "b" in ids else {})
        met = len(arrived)
        await watch_both_alive(a, b)
        nursery.cancel_scope.cancel()
    pings = [(receiver, sender) for receiver, sender, kind in arrived[met:] if kind == "ping"]
    assert ("b", "a") not in pings
    assert pings.count(("a", "b")) >= 3
