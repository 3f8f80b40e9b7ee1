"""Prefill workers on real daemons: while the route serves another session, a long prompt's prefill
runs on an idle replica of a busy hop, the hop imports the KV before the first token, and the reply
is the one a single process gives; a worker whose KV does not check out leaves the route to prefill
in full, with the same reply."""

from __future__ import annotations

import threading

import pytest

from meshd.daemon.local_mesh import LocalMesh
from meshd.models.text import TextCodec
from meshd.runtime.chain import LocalChain
from meshd.runtime.shard import Shard
from tests.test_prefix_mesh import FIRST, SPLIT, client, one_process, reply_tokens

pytestmark = pytest.mark.slow

CLAIMS = "tests.claimed_speeds_hop"
BUSY_TOKENS = 400  # the other session's reply: several times longer than the long prompt takes
BUSY = [{"role": "user", "content": "Tell me everything."}]


def start_mesh(mesh: LocalMesh, model, *worker_flags: str) -> None:
    # the route's hops claim a slow prefill, so that the prefill-only replica is worth its transfers
    # whatever the tiny model's real speeds are
    slow = ["--prefill-tok-s", "20"]
    first = mesh.start_peer(model=model, layers=SPLIT[0], module=CLAIMS, extra=[*slow, "--prefill-workers", "64"])
    # one numerics class for all: a peer measuring its own on a loaded machine may find another one,
    # and a replica of another class is no worker for the route
    pinned = ["--numerics", first.get("/status")["numerics"]]
    mesh.start_peers([dict(model=model, layers=r, module=CLAIMS, extra=[*slow, *pinned]) for r in SPLIT[1:]])
    worker = mesh.start_peer(model=model, layers=SPLIT[1], module=CLAIMS,
                             extra=["--prefill-only", "--prefill-tok-s", "100000", *pinned, *worker_flags])
    mesh.wait_covered("tiny")
    # the model is covered without the worker, whose card offers its range only once it has loaded and
    # measured it: until the entry sees that, it has no replica to prefill on
    mesh.wait_until(lambda: any(row["peer_id"] == worker.peer_id and row["models"][0]["end"] == SPLIT[1][1]
                                for row in first.get("/peers")["peers"]), 60, "the entry to see the worker's range")


class BusySession(threading.Thread):
    """A long streamed reply through the entry, started before and running through the test."""

    def __init__(self, peer) -> None:
        super().__init__(daemon=True)
        self.peer = peer
        self.started_streaming = threading.Event()
        self.tokens: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for chunk in client(self.peer).chat.completions.create(
                    model="tiny", messages=BUSY, max_tokens=BUSY_TOKENS, temperature=0, stream=True, logprobs=True,
                    extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                    self.tokens += [e.token for e in chunk.choices[0].logprobs.content]
                    self.started_streaming.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.started_streaming.set()


def long_prompt_while_busy(mesh: LocalMesh, codec: TextCodec) -> tuple[list[str], BusySession]:
    entry = mesh.peers[0]
    busy = BusySession(entry)
    busy.start()
    assert busy.started_streaming.wait(60) and busy.error is None
    reply = reply_tokens(entry, FIRST, codec)
    assert busy.is_alive(), "the other session ended before the long prompt was sent"
    busy.join(120)
    assert busy.error is None and len(busy.tokens) == BUSY_TOKENS
    return reply, busy


def busy_reply(model, codec: TextCodec) -> list[str]:
    out = LocalChain([Shard(model, 0, 4)]).generate(codec.encode_chat(BUSY), BUSY_TOKENS)
    return [codec.token_text(t) for t in out.tokens]


def test_a_long_prompt_is_prefilled_on_an_idle_replica_while_the_route_serves_another(tiny_model, tmp_path):
    codec = TextCodec.load(tiny_model)
    with LocalMesh(tmp_path) as mesh:
        start_mesh(mesh, tiny_model)
        reply, busy = long_prompt_while_busy(mesh, codec)
        assert reply == one_process(tiny_model, FIRST, codec), "prefilling on a worker changed the reply"
        assert busy.tokens == busy_reply(tiny_model, codec), "the other session's reply changed"
        workers = mesh.peers[0].get("/stats")["prefill_workers"]
        replica = mesh.peers[3]
        assert workers["planned"] == 1 and workers["used"] == 1 and workers["failed"] == 0, workers
        assert workers["last"]["workers"][1] == replica.peer_id
        assert workers["tokens"] == workers["last"]["cut"] >= len(codec.encode_chat(FIRST)) - 8
        assert replica.get("/stats")["prefix_kv"]["kept"] == 1
        assert mesh.peers[1].get("/stats")["kv_tier"]["from_workers"] == 1  # the busy middle hop imported it
        for hop in mesh.peers[:3]:
            assert hop.get("/stats")["prefix_kv"]["hits"] == 1  # every hop started after the workers' prefix


def test_kv_from_a_worker_that_does_not_check_out_leaves_the_route_to_prefill(tiny_model, tmp_path):
    codec = TextCodec.load(tiny_model)
    with LocalMesh(tmp_path) as mesh:
        start_mesh(mesh, tiny_model, "--corrupt-kv")
        reply, _busy = long_prompt_while_busy(mesh, codec)
        assert reply == one_process(tiny_model, FIRST, codec)
        workers = mesh.peers[0].get("/stats")["prefill_workers"]
        assert workers["planned"] == 1 and workers["used"] == 0, workers
        assert mesh.peers[1].get("/stats")["kv_tier"]["from_workers_failed"] == 1
        assert mesh.peers[1].get("/stats")["prefix_kv"]["hits"] == 0
