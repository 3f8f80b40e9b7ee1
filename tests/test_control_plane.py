"""Two control planes gossiping over an in-memory network, on the real clock: a gossip answer rides on
the reply to the RPC that asked for it, and failure detection works as before."""

from __future__ import annotations

import time

import trio

from meshd.daemon.config import PeerConfig
from meshd.daemon.control_plane import ControlPlane
from meshd.gossip import MemberState
from meshd.identity import Identity
from meshd.rpc import RpcRouter
from meshd.transport.memory import MemoryNetwork
from meshd.wire import card_pb2 as cpb


async def test_an_answer_rides_on_the_reply_and_probes_keep_both_peers_alive():
    network = MemoryNetwork()
    arrived: dict[str, list[str]] = {"a": [], "b": []}  # kinds of gossip messages that came as RPCs of their own
    planes: dict[str, ControlPlane] = {}
    async with trio.open_nursery() as nursery:
        for name, bootstrap in (("a", []), ("b", ["a.test:1"])):
            identity = Identity.generate()
            config = PeerConfig(bootstrap=bootstrap)
            router = RpcRouter()
            address = f"{name}.test:1"
            opener = network.join(identity.peer_id, address, router.serve, nursery)
            plane = ControlPlane(identity, config, opener, card=lambda a=address: cpb.CapabilityCard(addresses=[a]),
                                 directly_reachable=lambda: True)

            async def on_gossip(sender, message, plane=plane, name=name):
                arrived[name].append(message.WhichOneof("body") or "")
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
        # several probe rounds, each longer than a probe's timeout plus the suspicion timeout would allow
        # an unanswered probe to go unnoticed
        watch_until = time.monotonic() + 3 * a.config.probe_interval_s + a.config.suspect_timeout_s
        while time.monotonic() < watch_until:
            assert a.gossip.members()[b.peer_id] == MemberState.ALIVE
            assert b.gossip.members()[a.peer_id] == MemberState.ALIVE
            await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    kinds = arrived["a"] + arrived["b"]
    assert kinds.count("ping") >= 4 and "push_pull" in kinds
    assert "ack" not in kinds  # every ack came back in the reply to its ping
