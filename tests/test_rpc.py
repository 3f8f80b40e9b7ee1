"""Peer RPC: one request, one reply, dispatched by kind; refusals keep their code; garbage is answered."""

from __future__ import annotations

import pytest
import trio

from meshd.errors import ErrorCode, MeshError
from meshd.rpc import RPC_PATH, RpcFailed, RpcRouter, call
from meshd.transport.memory import MemoryNetwork
from meshd.wire import rpc_pb2 as pb


class NotHere(MeshError):
    code = ErrorCode.UNKNOWN_MODEL


async def serving(nursery: trio.Nursery) -> tuple[RpcRouter, MemoryNetwork]:
    router = RpcRouter()

    async def route(sender: str, request: pb.RouteRequest) -> pb.RouteReply:
        return pb.RouteReply(model_id=request.model_id, compat_key=f"asked by {sender}")

    async def files(_sender: str, request: pb.ModelFilesRequest) -> pb.ModelFiles:
        raise NotHere(f"no {request.model_id} here")

    async def dialback(_sender: str, _request: pb.DialbackRequest) -> pb.DialbackReply:
        raise RuntimeError("a bug in a handler")

    router.register("route", route)
    router.register("model_files", files)
    router.register("dialback", dialback)
    network = MemoryNetwork()
    network.join("server", "server.test:1", router.serve, nursery)
    return router, network


async def test_each_kind_reaches_its_handler_and_refusals_keep_their_code():
    async with trio.open_nursery() as nursery:
        router, network = await serving(nursery)
        client = network.join("client", "client.test:1", router.serve, nursery)
        reply = await call(client, "server", "server.test:1", pb.PeerRequest(route=pb.RouteRequest(model_id="m")), 5)
        assert reply.route.model_id == "m" and reply.route.compat_key == "asked by client"
        with pytest.raises(RpcFailed) as refused:
            await call(client, "server", "server.test:1",
                       pb.PeerRequest(model_files=pb.ModelFilesRequest(model_id="x")), 5)
        assert refused.value.code == ErrorCode.UNKNOWN_MODEL and "no x here" in refused.value.message
        with pytest.raises(RpcFailed) as crashed:
            await call(client, "server", "server.test:1", pb.PeerRequest(dialback=pb.DialbackRequest()), 5)
        assert crashed.value.code == ErrorCode.INTERNAL_ERROR and "bug" not in crashed.value.message
        with pytest.raises(RpcFailed) as unknown:
            await call(client, "server", "server.test:1", pb.PeerRequest(placement=pb.PlacementOrder()), 5)
        assert unknown.value.code == ErrorCode.BAD_REQUEST
        assert router.served == {"route": 1}
        assert router.refused == {"model_files": 1, "dialback": 1, "placement": 1}
        nursery.cancel_scope.cancel()


async def test_garbage_and_silence_are_answered_and_leave_the_router_serving():
    async with trio.open_nursery() as nursery:
        router, network = await serving(nursery)
        client = network.join("client", "client.test:1", router.serve, nursery)
        reply = pb.PeerReply.FromString(await client.request("server", "server.test:1", RPC_PATH, b"\xff\xff\x00"))
        assert reply.error.code == ErrorCode.BAD_REQUEST
        empty = pb.PeerReply.FromString(await client.request("server", "server.test:1", RPC_PATH, b""))
        assert empty.error.code == ErrorCode.BAD_REQUEST  # an empty request has no kind
        with pytest.raises(RpcFailed) as nobody:
            await call(client, "ghost", "ghost.test:1", pb.PeerRequest(route=pb.RouteRequest()), 5)
        assert nobody.value.code == ErrorCode.UNREACHABLE
        assert (await call(client, "server", "server.test:1", pb.PeerRequest(route=pb.RouteRequest(model_id="m")),
                           5)).route.model_id == "m"
        nursery.cancel_scope.cancel()


def test_a_handler_is_registered_once_and_only_for_a_known_kind():
    router = RpcRouter()

    async def handler(_sender: str, _body: object) -> pb.Accepted:
        return pb.Accepted()

    router.register("gossip", handler)
    with pytest.raises(ValueError, match="already"):
        router.register("gossip", handler)
    with pytest.raises(ValueError, match="not a kind"):
        router.register("telemetry", handler)


async def test_a_flooding_peer_is_refused_at_its_rate_and_others_are_not():
    from meshd.wire import card_pb2 as cpb

    rpb = pb
    now = [0.0]
    router = RpcRouter(limits={"gossip": (10.0, 20.0)}, clock=lambda: now[0])
    handled = []

    async def gossip(sender, message):
        handled.append(sender)
        return rpb.Accepted()

    router.register("gossip", gossip)
    request = rpb.PeerRequest(gossip=cpb.GossipMessage())
    replies = [await router.dispatch("flooder", request) for _ in range(50)]
    assert [r.WhichOneof("body") for r in replies].count("accepted") == 20, "the burst, then refusals"
    assert replies[-1].error.code == ErrorCode.RATE_LIMITED and router.rate_limited == {"gossip": 30}
    assert (await router.dispatch("honest", request)).WhichOneof("body") == "accepted"
    now[0] += 1.0  # ten more a second
    later = [(await router.dispatch("flooder", request)).WhichOneof("body") for _ in range(15)]
    assert later.count("accepted") == 10
    assert handled.count("flooder") == 30
