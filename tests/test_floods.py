"""Floods against real daemons: cards, streams, oversized messages and headers, connections that never
authenticate. Each is refused, logged and counted; the daemon's memory stays bounded (its RSS is read
before and after) and it keeps answering."""

from __future__ import annotations

import socket
import struct
import time

import psutil
import pytest
import trio

from meshd.cards import sign_card
from meshd.daemon.local_mesh import LocalMesh
from meshd.identity import Identity
from meshd.rpc import RpcFailed
from meshd.rpc import call as rpc_call
from meshd.session.messages import SEAM_PATH
from meshd.transport import Transport
from meshd.transport.config import TransportConfig
from meshd.transport.errors import TransportError
from meshd.wire import card_pb2 as cpb
from meshd.wire import rpc_pb2 as rpb
from tests.helpers import api_chat, join_mesh, metric_total

pytestmark = pytest.mark.slow

MiB = 1024 * 1024


def rss(peer) -> int:
    return psutil.Process(peer.process.pid).memory_info().rss




@pytest.fixture(scope="module")
def private(tiny_model, tmp_path_factory):
    with LocalMesh(tmp_path_factory.mktemp("floods")) as m:
        m.start_peers([dict(model=tiny_model, layers=(0, 2)), dict(model=tiny_model, layers=(2, 4))])
        m.wait_covered("tiny", timeout=60)
        yield m


def test_a_card_flood_fills_the_store_to_its_cap_and_no_further(tiny_model, tmp_path):
    with LocalMesh(tmp_path / "open", open_mesh=True) as m:
        (peer,) = m.start_peers([dict(model=tiny_model, layers=(0, 4))])
        m.wait_covered("tiny", timeout=60)
        reference = api_chat(peer)
        before = rss(peer)
        now_ms = int(time.time() * 1000)
        flood = []
        for n in range(11_000):
            key = Identity.from_seed(n.to_bytes(4, "big") * 8)
            card = cpb.CapabilityCard(peer_id=key.peer_id, public_key=key.public_key, sequence=1,
                                      issued_at_ms=now_ms, expires_at_ms=now_ms + 600_000, addresses=["127.0.0.1:9"])
            flood.append(sign_card(card, key))

        async def send() -> None:
            async with Transport(Identity.generate()) as transport:
                for start in range(0, len(flood), 100):
                    message = cpb.GossipMessage(cards=flood[start:start + 100])
                    await rpc_call(transport, peer.peer_id, peer.listen, rpb.PeerRequest(gossip=message), timeout=30)

        trio.run(send)
        status = peer.get("/status")
        assert status["rejected_cards"].get("store_full", 0) >= 1000
        assert metric_total(peer, "meshd_cards_rejected", 'reason="store_full"') >= 1000
        grown = rss(peer) - before
        print(f"card flood: 11000 cards sent, {len(peer.get('/peers')['peers'])} held, RSS grew {grown / MiB:.1f} MiB")
        assert grown < 150 * MiB
        assert api_chat(peer) == reference


async def test_a_stream_flood_is_cut_at_the_connections_buffer_budget(private):
    head, tail = private.peers[:2]
    reference = await trio.to_thread.run_sync(api_chat, head)
    before = rss(tail)
    async with Transport(Identity.generate(), TransportConfig(stream_window=4 * MiB)) as flooder:
        await join_mesh(flooder, head)
        streams, cut = [], 0
        for _ in range(200):  # each announces a 8 MiB seam message and sends 1 MiB of it, then waits
            stream = await flooder.open_stream(tail.peer_id, tail.listen, SEAM_PATH)
            try:
                await stream._send_bytes(struct.pack(">I", 8 * MiB) + b"x" * MiB)
            except TransportError:
                cut += 1  # reset by the peer: its connection's budget is spent
            streams.append(stream)
        await trio.sleep(2.0)
        peak = rss(tail) - before
        status = tail.get("/status")
        assert status["transport_refusals"].get("buffer_full", 0) >= 50
        assert metric_total(tail, "meshd_transport_refusals", 'reason="buffer_full"') >= 50
        assert await trio.to_thread.run_sync(api_chat, head) == reference  # served during the flood
    print(f"stream flood: 200 streams x 1 MiB sent, {cut} cut while sending; RSS grew {peak / MiB:.0f} MiB "
          "(budget 128 MiB)")
    assert peak < 128 * MiB + 96 * MiB
    assert "more than 134217728 bytes of unread messages" in tail.log_path.read_text()


async def test_oversized_messages_and_headers_are_refused(private):
    head, tail = private.peers[:2]
    reference = await trio.to_thread.run_sync(api_chat, head)
    async with Transport(Identity.generate()) as outsider:
        # an outsider may only ask to join: a request of more than 64 KiB is not even read
        big = rpb.PeerRequest(gossip=cpb.GossipMessage(cards=[cpb.SignedCard(card=b"x" * 200_000)]))
        # the stream is reset for its size (not refused for its sender: that would need reading it)
        with pytest.raises(RpcFailed, match="FRAME_SIZE_ERROR"):
            await rpc_call(outsider, tail.peer_id, tail.listen, big, timeout=10)
        stream = await outsider.open_stream(tail.peer_id, tail.listen, SEAM_PATH, headers={"x-big": "a" * 32_768})
        with trio.fail_after(10), pytest.raises(Exception):  # noqa: B017 - the connection is closed
            await stream.receive_message()
    assert tail.get("/status")["transport_refusals"].get("protocol_error", 0) >= 1
    assert "message too large" in tail.log_path.read_text() or "announced a" in tail.log_path.read_text()
    assert await trio.to_thread.run_sync(api_chat, head) == reference


def test_connections_that_never_authenticate_are_bounded_and_time_out(private):
    head, tail = private.peers[:2]
    reference = api_chat(head)
    before = rss(tail)
    host, port = tail.listen.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(300)]
    try:
        private.wait_until(lambda: tail.get("/status")["transport_refusals"].get("handshakes_full_for_host", 0)
                           >= 250, 20, "connections beyond the per-host cap to be refused")
        assert api_chat(head) == reference  # existing links keep serving
        private.wait_until(lambda: tail.get("/status")["transport_refusals"].get("handshake_timeout", 0) >= 16,
                           30, "the held connections to time out")
        grown = rss(tail) - before
    finally:
        for sock in idle:
            sock.close()
    print(f"slow-loris: 300 connections held without a handshake; RSS grew {grown / MiB:.1f} MiB")
    assert grown < 32 * MiB
    assert metric_total(tail, "meshd_transport_refusals", 'reason="handshake_timeout"') >= 16
    assert "no authentication within" in tail.log_path.read_text()
    assert api_chat(head) == reference
