"""Prefix KV on real daemons: a conversation's next turn starts after the prefix every hop kept of
the last one, and its reply is token for token the one a whole prefill gives; a hop that keeps
nothing makes the route prefill in full, with the same reply."""

from __future__ import annotations

import pytest
from openai import OpenAI

from meshd.daemon.local_mesh import LocalMesh
from meshd.models.text import TextCodec
from meshd.runtime.chain import LocalChain
from meshd.runtime.shard import Shard

pytestmark = pytest.mark.slow

SPLIT = [(0, 1), (1, 3), (3, 4)]
SYSTEM = ("You answer questions about rivers, bridges, harbors and the weather of small island towns, in plain "
          "words, briefly, and you never make up a name or a number that you were not told. ") * 3
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which bridge is the oldest?"}]


def client(peer) -> OpenAI:
    return OpenAI(base_url=f"http://{peer.api}/v1", api_key="x", timeout=120, max_retries=0)


def reply_tokens(peer, messages, codec: TextCodec) -> list[str]:
    reply = client(peer).chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, extra_body={"ignore_eos": True})
    return [c.token for c in reply.choices[0].logprobs.content]


def one_process(model, messages, codec: TextCodec) -> list[str]:
    out = LocalChain([Shard(model, 0, 4)]).generate(codec.encode_chat(messages), 8)
    return [codec.token_text(t) for t in out.tokens]


def second_turn(first_reply: list[str], question: str) -> list[dict]:
    return [*FIRST, {"role": "assistant", "content": "".join(first_reply)}, {"role": "user", "content": question}]


def run_two_turns(mesh: LocalMesh, model, codec: TextCodec, question: str) -> tuple[list[str], list[dict]]:
    entry = mesh.peers[0]
    first = reply_tokens(entry, FIRST, codec)
    assert first == one_process(model, FIRST, codec)
    messages = second_turn(first, question)
    return reply_tokens(entry, messages, codec), messages


def test_the_next_turn_starts_after_the_kept_prefix_with_the_same_reply(tiny_model, tmp_path):
    codec = TextCodec.load(tiny_model)
    with LocalMesh(tmp_path) as mesh:
        mesh.start_peers([dict(model=tiny_model, layers=r) for r in SPLIT])
        mesh.wait_covered("tiny")
        second, messages = run_two_turns(mesh, tiny_model, codec, "And the longest?")
        assert second == one_process(tiny_model, messages, codec), "prefix reuse changed the reply"
        reuse = mesh.peers[0].get("/stats")["prefix_reuse"]
        assert reuse["reused"] == 1 and reuse["reused_tokens"] >= len(codec.encode_chat(FIRST)) - 8
        for peer in mesh.peers:
            kept = peer.get("/stats")["prefix_kv"]
            assert kept["hits"] == 1 and kept["kept"] >= 1 and kept["bytes"] <= kept["max_bytes"]


def test_a_hop_that_keeps_no_prefixes_makes_the_route_prefill_in_full(tiny_model, tmp_path):
    codec = TextCodec.load(tiny_model)
    with LocalMesh(tmp_path) as mesh:
        mesh.start_peers([dict(model=tiny_model, layers=r, extra=["--prefix-kv", "0"] if r == (1, 3) else None)
                          for r in SPLIT])
        mesh.wait_covered("tiny")
        second, messages = run_two_turns(mesh, tiny_model, codec, "And the longest?")
        assert second == one_process(tiny_model, messages, codec)
        reuse = mesh.peers[0].get("/stats")["prefix_reuse"]
        assert reuse["asked"] == 1 and reuse["reused"] == 0, "a prefix one hop lacks is not used"
        assert mesh.peers[1].get("/stats")["prefix_kv"]["kept"] == 0
