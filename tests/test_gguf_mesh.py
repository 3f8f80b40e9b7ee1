"""A GGUF file served by real daemons: whole on one peer through llama.cpp, and split across peers,
answering the official ``openai`` client."""

from __future__ import annotations

import pytest
from openai import OpenAI

from meshd.daemon.local_mesh import LocalMesh
from meshd.models.gguf_export import write_gguf
from meshd.models.gguf_model import gguf_model_dir
from meshd.models.text import TextCodec
from meshd.runtime.backends import open_shard
from meshd.runtime.chain import LocalChain
from meshd.runtime.model_info import choose_numerics, describe_model
from tests.test_gguf import native

pytestmark = [pytest.mark.slow, native]
QUESTION = [{"role": "user", "content": "Which layers do you hold?"}]


@pytest.fixture(scope="module")
def gguf_file(tiny_model, tmp_path_factory):
    return write_gguf(tiny_model, tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf", "q8_0")


@pytest.fixture(scope="module")
def expected(gguf_file, tmp_path_factory):
    """What llama.cpp computes in one process for the question, greedy."""
    model_dir = gguf_model_dir(gguf_file, tmp_path_factory.mktemp("cache"))
    numerics = choose_numerics(model_dir, backend="llama.cpp").numerics
    info = describe_model(model_dir, numerics=numerics)
    codec = TextCodec.load(model_dir)
    chain = LocalChain([open_shard(model_dir, 0, 4, numerics=numerics, manifest=info.manifest)])
    tokens = chain.generate(codec.encode_chat(QUESTION), 16).tokens
    return codec.tokenizer.decode([t for t in tokens if t not in codec.stop_token_ids], skip_special_tokens=True)


def ask(peer, model: str, stream: bool) -> str:
    client = OpenAI(base_url=f"http://{peer.api}/v1", api_key="x", timeout=60, max_retries=0)
    if stream:
        chunks = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True})
    return reply.choices[0].message.content or ""


def test_one_peer_serves_the_whole_gguf_through_llama_cpp(gguf_file, expected, tmp_path):
    with LocalMesh(tmp_path) as mesh:
        peer = mesh.start_peers([dict(model=gguf_file)])[0]
        mesh.wait_covered("tiny-q8", timeout=60)
        status = peer.get("/status")
        assert status["backend"] == "llama.cpp" and status["range"] == [0, 4]
        [row] = [r for r in peer.get("/peers")["peers"] if r["self"]]
        assert row["models"][0]["backend"] == "llama.cpp" and row["models"][0]["quantization"] == "q8_0"
        assert ask(peer, "tiny-q8", stream=True) == expected
        assert ask(peer, "tiny-q8", stream=False) == expected


def test_a_gguf_split_over_three_peers_answers_as_one_process(gguf_file, expected, tmp_path):
    with LocalMesh(tmp_path) as mesh:
        peers = mesh.start_peers([dict(model=gguf_file, layers=r) for r in ((0, 1), (1, 3), (3, 4))])
        mesh.wait_covered("tiny-q8", timeout=60)
        assert {p.get("/status")["numerics"] for p in peers} == {"llama.cpp/cpu/gguf-q8_0"}
        assert ask(peers[1], "tiny-q8", stream=True) == expected


def test_the_tracker_prefers_the_peer_that_holds_the_whole_model(gguf_file, tmp_path):
    with LocalMesh(tmp_path) as mesh:
        # the whole-model peer first, alone: each peer measures its decode speed as it loads, and the
        # routes compare those figures, so the split peers must not measure on an idler machine than it
        first = mesh.start_peer(model=gguf_file, layers=(0, 4))
        mesh.wait_until(lambda: first.get("/status")["decode_tok_s"] > 0, 60, "the whole model measured")
        peers = [first, *mesh.start_peers([dict(model=gguf_file, layers=r) for r in ((0, 2), (2, 4))])]
        mesh.wait_covered("tiny-q8", timeout=60)
        whole = peers[0].peer_id
        route = mesh.wait_until(lambda: _route_through(peers[1], whole), 30, "a one-hop route")
        assert [h["peer_id"] for h in route["hops"]] == [whole]


def _route_through(peer, peer_id):
    """The route the peer plans now, if it is the one hop through ``peer_id`` (cards of speeds settle
    a moment after coverage)."""
    route = peer.get("/route?model=tiny-q8")
    return route if [h["peer_id"] for h in route["hops"]] == [peer_id] else None


def test_the_llama_cpp_route_honours_seeds_stops_and_cancellation(gguf_file, expected, tmp_path):
    import json
    import subprocess
    import sys

    import httpx2 as httpx

    with LocalMesh(tmp_path) as mesh:
        peer = mesh.start_peers([dict(model=gguf_file)])[0]
        mesh.wait_covered("tiny-q8", timeout=60)
        client = OpenAI(base_url=f"http://{peer.api}/v1", api_key="x", timeout=60, max_retries=0)

        def sampled(seed: int) -> str:
            reply = client.chat.completions.create(model="tiny-q8", messages=QUESTION, max_tokens=16,
                                                   temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
            return reply.choices[0].message.content or ""

        assert sampled(7) == sampled(7), "a seed gives the same reply every time"
        assert len({sampled(s) for s in range(1, 5)}) > 1, "different seeds sample differently"

        cut = expected[4:7]
        assert len(expected) >= 8 and cut
        stopped = client.chat.completions.create(model="tiny-q8", messages=QUESTION, max_tokens=16, temperature=0,
                                                 stop=[cut], extra_body={"ignore_eos": True})
        assert stopped.choices[0].message.content == expected[:expected.index(cut)]
        assert stopped.choices[0].finish_reason == "stop"

        with httpx.Client(timeout=60) as http, http.stream(
                "POST", f"http://{peer.api}/v1/chat/completions",
                json={"model": "tiny-q8", "messages": QUESTION, "stream": True, "max_tokens": 1500,
                      "temperature": 0, "ignore_eos": True}) as reply:
            request_id = reply.headers["x-request-id"]
            for index, _line in enumerate(reply.iter_lines()):
                if index == 4:
                    break  # the client goes away mid-generation

        def released() -> bool:
            run = subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", "sessions", "--json",
                                  "--control", peer.control], capture_output=True, text=True, check=True)
            return not any(s["session_id"] == request_id for s in json.loads(run.stdout)) and \
                peer.get("/status")["active_sessions"] == 0

        mesh.wait_until(released, timeout=30, what="the cancelled session to free its llama.cpp sequence")
        assert ask(peer, "tiny-q8", stream=True) == expected, "the peer serves on after a cancellation"
