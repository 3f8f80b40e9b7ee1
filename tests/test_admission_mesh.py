"""A private mesh of real daemons: members join with invites; outsiders, expired and reused invites
and revoked members are refused, logged and counted, while members keep being served."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import trio

from meshd.daemon.local_mesh import LocalMesh, LocalMeshError
from meshd.identity import Identity
from meshd.rpc import RpcFailed
from meshd.rpc import call as rpc_call
from meshd.session.messages import SEAM_PATH
from meshd.transport import Transport
from meshd.transport.errors import TransportError
from meshd.wire import card_pb2 as cpb
from meshd.wire import rpc_pb2 as rpb
from tests.helpers import api_chat, join_mesh, metric_total

pytestmark = pytest.mark.slow


def meshctl(peer, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", *args, "--control", peer.control],
                          capture_output=True, text=True, timeout=60, check=False)




@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    with LocalMesh(tmp_path_factory.mktemp("private")) as m:
        m.start_peers([dict(model=tiny_model, layers=(0, 2)), dict(model=tiny_model, layers=(2, 4))])
        m.wait_covered("tiny", timeout=60)
        yield m


def test_members_join_with_invites_and_serve_together(mesh):
    founder, member = mesh.peers[:2]
    assert founder.get("/status")["admission"]["admits"]
    status = member.get("/status")["admission"]
    assert status["private"] and status["member"] and not status["admits"]
    assert status["mesh"] == founder.get("/status")["admission"]["mesh"]
    assert "joined private mesh" in member.log_path.read_text()
    assert api_chat(member) == api_chat(founder)


async def test_an_outsider_cannot_gossip_route_or_open_seams(mesh):
    founder, member = mesh.peers[:2]
    text_before = api_chat(founder)
    counted_before = metric_total(member, "meshd_peer_refusals", 'code="not_member"')
    async with Transport(Identity.generate()) as outsider:
        for request in (rpb.PeerRequest(gossip=cpb.GossipMessage(ping=cpb.Ping(seq=1))),
                        rpb.PeerRequest(route=rpb.RouteRequest(model_id="tiny"))):
            with pytest.raises(RpcFailed) as refused:
                await rpc_call(outsider, member.peer_id, member.listen, request, timeout=10)
            assert refused.value.code.value == "not_member"
        seam = await outsider.open_stream(member.peer_id, member.listen, SEAM_PATH)
        with trio.fail_after(10), pytest.raises(TransportError):  # reset before it is read
            await seam.send_message(b"anything")
            await seam.receive_message()
    refused = member.get("/status")["admission"]["refused"]
    assert refused.get("gossip") and refused.get("route") and refused.get(SEAM_PATH)
    assert metric_total(member, "meshd_peer_refusals", 'code="not_member"') >= counted_before + 3
    assert "stream refused: " in member.log_path.read_text() and "has shown no membership of mesh" in \
        member.log_path.read_text()
    assert api_chat(founder) == text_before  # nothing else disturbed


def test_expired_and_used_up_invites_are_refused(mesh):
    founder = mesh.peers[0]
    short = founder.invite(uses=1, expires_s=0.5)
    time.sleep(1.0)
    with pytest.raises(LocalMeshError, match="expired"):
        mesh.start_peer(bootstrap=False, extra=["--invite", short], timeout=60)
    once = founder.invite(uses=1)
    used = mesh.start_peer(bootstrap=False, extra=["--invite", once], timeout=60)
    assert used.get("/status")["admission"]["member"]
    with pytest.raises(LocalMeshError, match="used up"):
        mesh.start_peer(bootstrap=False, extra=["--invite", once], timeout=60)
    # restarted with neither token nor bootstrap, it rejoins through the address its invite named
    used.process.terminate()
    used.process.wait(timeout=30)
    again = mesh.start_peer(bootstrap=False, data_dir=used.data_dir, timeout=60)
    assert again.peer_id == used.peer_id and again.get("/status")["admission"]["member"]
    mesh.wait_until(lambda: again.peer_id in {p["peer_id"] for p in founder.get("/peers")["peers"]}, 30,
                    "the restarted member to be back")
    run = meshctl(founder, "invite", "--expires", "10m", "--uses", "3", "--json")
    assert run.returncode == 0, run.stderr
    assert '"uses": 3' in run.stdout and "meshd-invite-" in run.stdout
    member = mesh.peers[1]
    run = meshctl(member, "invite")  # only the holder of the admission key can
    assert run.returncode == 1 and "admission key" in run.stderr


async def test_a_revoked_member_is_dropped_everywhere_and_refused(mesh):
    founder, member = mesh.peers[:2]
    async with Transport(Identity.generate()) as insider:
        await join_mesh(insider, founder)
        ping = rpb.PeerRequest(gossip=cpb.GossipMessage(ping=cpb.Ping(seq=1)))
        await rpc_call(insider, member.peer_id, member.listen, ping, timeout=10)  # a member: heard
        run = meshctl(founder, "revoke", insider.identity.peer_id, "--reason", "test")
        assert run.returncode == 0, run.stderr

        def refused_everywhere() -> bool:
            return all(p.get("/status")["admission"]["revoked_peers"] == 1 for p in mesh.live())

        mesh.wait_until(refused_everywhere, 30, "the revocation to reach every member")
        with pytest.raises(RpcFailed) as refused:
            await rpc_call(insider, member.peer_id, member.listen, ping, timeout=10)
        assert refused.value.code.value == "not_member" and "revoked" in str(refused.value)
    assert "revoked from mesh" in member.log_path.read_text()
    assert api_chat(member) == api_chat(founder)


def test_bad_control_requests_are_400_and_sign_nothing(mesh):
    """Bodies the control API cannot read, numbers no int holds, and a peer id that is not one are
    refused in a clear 400: a typo must not sign a lasting revocation of nobody."""
    founder = mesh.peers[0]
    before = founder.get("/status")["admission"]
    for path, body in (("/invite", b'{"uses": 1e999}'), ("/invite", b"[" * 100_000 + b"]" * 100_000),
                       ("/revoke", b"[" * 100_000 + b"]" * 100_000),
                       ("/revoke", b'{"peer_id": "NOT-A-PEER-ID-0123456789ABCDEFGH"}')):
        request = urllib.request.Request(f"http://{founder.control}{path}", data=body, method="POST",
                                         headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400, (path, body[:40])
        assert json.loads(refused.value.read())["error"]
    assert founder.get("/status")["admission"] == before
