"""Audits among real daemons: one of four peers computes its layers wrong; the entry's audits catch
it, exclude it from routes and accuse it by gossip; the others confirm by audits of their own; a
false accusation of an honest peer is not borne out and excludes nobody."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from meshd.audit.records import sign_accusation
from meshd.daemon.local_mesh import LocalMesh
from meshd.identity import Identity
from meshd.rpc import call as rpc_call
from meshd.transport import Transport
from meshd.wire import card_pb2 as cpb
from meshd.wire import rpc_pb2 as rpb
from tests.helpers import api_chat, chat_reference, join_mesh

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
QUESTION = "Who computed this?"
N_TOKENS = 12
MAX_REQUESTS = 6  # the stated bound: two audited requests convict; each request is audited here



def audit_of(observer, peer_id: str) -> dict | None:
    return next((p["audit"] for p in observer.get("/peers")["peers"] if p["peer_id"] == peer_id), None)


def audits_idle(peer) -> bool:
    return peer.get("/status")["audits"]["running"] == 0


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    with LocalMesh(tmp_path_factory.mktemp("audits"), env={"PYTHONPATH": str(REPO)}) as m:
        entry = m.start_peer(model=tiny_model, layers=(0, 2), extra=["--audit-rate", "1"])
        m.start_peer(model=tiny_model, layers=(2, 4), module="tests.corrupt_hop")
        m.start_peer(model=tiny_model, layers=(2, 4))
        m.start_peer(model=tiny_model, layers=(2, 4))
        m.wait_covered("tiny", timeout=60)
        assert entry is m.peers[0]
        yield m


def test_a_peer_computing_wrong_is_caught_excluded_and_accused(mesh, tiny_model):
    entry, liar, honest, other = mesh.peers
    reference = chat_reference(tiny_model, QUESTION, N_TOKENS)
    replies = []
    for _ in range(MAX_REQUESTS):
        replies.append(api_chat(entry, QUESTION, N_TOKENS, ignore_eos=True))
        mesh.wait_until(lambda: audits_idle(entry), 120, "the request's audit")
        if liar.peer_id in entry.get("/status")["audits"]["excluded"]:
            break
    assert liar.peer_id in entry.get("/status")["audits"]["excluded"], f"not caught in {MAX_REQUESTS} requests"
    wrong = sum(r != reference for r in replies)
    print(f"\nthe corrupt peer was excluded after {len(replies)} requests ({wrong} of them answered wrong, through it)")
    assert audit_of(entry, liar.peer_id)["state"] == "excluded"
    for peer in (honest, other):
        assert audit_of(entry, peer.peer_id)["state"] == "passed"
    for _ in range(4):  # every later reply is right
        assert api_chat(entry, QUESTION, N_TOKENS, ignore_eos=True) == reference
    assert "audit: " + liar.peer_id[:12] + " computed tiny wrong" in entry.log_path.read_text()

    # the accusation spreads by gossip; each of the others believes it only once its own audits agree
    for peer in (honest, other):
        mesh.wait_until(lambda p=peer: (audit_of(p, liar.peer_id) or {}).get("state") == "excluded", 120,
                        f"peer{peer.index} to confirm the accusation")
        assert "checking it with an audit of our own" in peer.log_path.read_text()


async def test_a_false_accusation_of_an_honest_peer_excludes_nobody(mesh):
    entry, _liar, honest, other = mesh.peers
    accuser = Identity.generate()
    async with Transport(accuser) as transport:
        await join_mesh(transport, entry)  # a member in good standing, who lies about another
        status = entry.get("/status")
        prompt = [5, 17, 42, 99, 7, 3]
        lie = sign_accusation(accuser, honest.peer_id, "tiny", status["compat_key"], prompt, [1, 2, 3], [4, 5, 6],
                              int(time.time() * 1000))
        for target in (entry, other):
            message = cpb.GossipMessage(push_pull=cpb.PushPull(reply=True, accusations=[lie]))
            await rpc_call(transport, target.peer_id, target.listen, rpb.PeerRequest(gossip=message), timeout=10)

    def judged(observer) -> bool:
        audit = audit_of(observer, honest.peer_id) or {}
        return audit.get("unconfirmed_accusations", 0) >= 1

    for observer in (entry, other):
        await trio.to_thread.run_sync(lambda o=observer: mesh.wait_until(lambda: judged(o), 120,
                                                                          "the accusation to be checked"))
        audit = audit_of(observer, honest.peer_id)
        assert audit["state"] != "excluded" and accuser.peer_id in audit["accused_by"]
        assert honest.peer_id not in observer.get("/status")["audits"]["excluded"]
        assert "was not borne out here" in observer.log_path.read_text()
