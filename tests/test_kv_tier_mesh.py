"""The KV tier on real daemons: a hop restarted without its prefixes imports the one the next turn
needs from a tier peer and the reply is unchanged; a tier peer that dies mid-import leaves the route
to prefill in full, with the same reply."""

from __future__ import annotations

import signal

import pytest

from meshd.daemon.local_mesh import LocalMesh
from meshd.models.text import TextCodec
from tests.test_prefix_mesh import FIRST, SPLIT, one_process, reply_tokens, second_turn

pytestmark = pytest.mark.slow

HOP = "tests.small_chunks_hop"  # snapshots of the tiny model in several chunks


def mesh_with_tier(mesh: LocalMesh, model, tier_module: str):
    mesh.start_peers([dict(model=model, layers=r, module=HOP) for r in SPLIT])
    tier = mesh.start_peer(extra=["--kv-tier", "64MiB"], module=tier_module)
    mesh.wait_covered("tiny")
    return tier


def restart(mesh: LocalMesh, index: int, model):
    """Kill peer ``index`` (its prefixes go with it) and start it again with the same identity."""
    old = mesh.peers[index]
    mesh.kill(old, signal.SIGKILL)
    old.process.wait(timeout=10)
    new = mesh.start_peer(model=model, layers=SPLIT[index], module=HOP, data_dir=old.data_dir)
    mesh.wait_covered("tiny")  # every live peer, the restarted one too, sees the model covered and the tier
    return new


def all_published(hops) -> bool:
    """Whether every hop has published each prefix it kept (to the one tier peer there is)."""
    for hop in hops:
        stats = hop.get("/stats")
        if stats["kv_tier"]["published"] < stats["prefix_kv"]["kept"]:
            return False
    return True


def first_turn_published(mesh: LocalMesh, codec: TextCodec, model, tier) -> list[str]:
    first = reply_tokens(mesh.peers[0], FIRST, codec)
    mesh.wait_until(lambda: all_published(mesh.peers[:len(SPLIT)]), 30, "every hop's prefixes in the tier")
    return first


def test_a_hop_that_lost_its_prefixes_imports_the_next_turns_from_the_tier(tiny_model, tmp_path):
    codec = TextCodec.load(tiny_model)
    with LocalMesh(tmp_path) as mesh:
        tier = mesh_with_tier(mesh, tiny_model, "meshd.cli.meshd_main")
        first = first_turn_published(mesh, codec, tiny_model, tier)
        restarted = restart(mesh, 1, tiny_model)
        assert restarted.get("/stats")["prefix_kv"]["snapshots"] == 0
        messages = second_turn(first, "And the longest?")
        assert reply_tokens(mesh.peers[0], messages, codec) == one_process(tiny_model, messages, codec)
        assert mesh.peers[0].get("/stats")["prefix_reuse"]["reused"] == 1
        stats = restarted.get("/stats")
        assert stats["kv_tier"]["imported"] == 1 and stats["prefix_kv"]["hits"] == 1
        assert tier.get("/stats")["kv_tier"]["lent"]["gets"] > 1, "the snapshot came in several chunks"


def test_a_tier_peer_dying_mid_import_leaves_the_route_to_prefill_in_full(tiny_model, tmp_path):
    codec = TextCodec.load(tiny_model)
    with LocalMesh(tmp_path) as mesh:
        tier = mesh_with_tier(mesh, tiny_model, "tests.dying_tier")
        first = first_turn_published(mesh, codec, tiny_model, tier)
        restarted = restart(mesh, 1, tiny_model)
        messages = second_turn(first, "And the longest?")
        assert reply_tokens(mesh.peers[0], messages, codec) == one_process(tiny_model, messages, codec)
        assert tier.process.poll() == 17, "the tier died when asked for a second chunk"
        reuse = mesh.peers[0].get("/stats")["prefix_reuse"]
        assert reuse["asked"] == 1 and reuse["reused"] == 0
        stats = restarted.get("/stats")["kv_tier"]
        assert stats["imported"] == 0 and stats["import_failed"] >= 1
