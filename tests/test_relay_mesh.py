"""Real daemons and a real meshd-relay, each its own process: a peer that cannot be dialled directly
holds a range and serves in a route through the relay (token-identical output); a peer with a relay
and a dialable address turns direct after the dial-back test; the relay restarts and peers
re-register by themselves."""

from __future__ import annotations

import json
import time

import pytest

from meshd.daemon.local_mesh import LocalMesh
from tests.helpers import chat_reference
from tests.test_mesh import N_TOKENS, QUESTION, chat, meshctl
from tests.test_repair import Generation, References

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def relayed(tiny_model, tmp_path_factory):
    with LocalMesh(tmp_path_factory.mktemp("relayed")) as mesh:
        relay = mesh.start_relay()
        mesh.start_peer(model=tiny_model, layers=(0, 2))  # auto, no relays: direct
        mesh.start_peer(model=tiny_model, layers=(2, 4),
                        extra=["--reachability", "relayed", "--relay", relay.address])
        mesh.wait_covered("tiny", timeout=60)
        yield mesh, relay


@pytest.fixture(scope="module")
def reference(tiny_model):
    return chat_reference(tiny_model, QUESTION, N_TOKENS)


def peer_row(viewer, peer_id: str) -> dict | None:
    """The viewer's row for ``peer_id``; None while the viewer does not know it yet."""
    return next((r for r in viewer.get("/peers")["peers"] if r["peer_id"] == peer_id), None)


def test_a_relayed_peer_serves_its_range_token_identical(relayed, reference):
    mesh, relay = relayed
    direct, hidden = mesh.peers[0], mesh.peers[1]
    row = peer_row(direct, hidden.peer_id)
    assert row is not None and row["addresses"] == [] and row["relays"] == [f"relay:{relay.address}"]
    assert row["relayed_via"] == row["relays"]
    table = meshctl(direct, "peers")
    assert f"relay {relay.address}" in table.stdout, table.stdout

    route = json.loads(meshctl(direct, "route", "tiny", "--json").stdout)
    assert [h["peer_id"] for h in route["hops"]] == [direct.peer_id, hidden.peer_id]

    for entry in (direct, hidden):  # entry before the relayed hop, and the relayed peer as entry
        for stream in (False, True):
            text, usage = chat(entry, stream)
            assert text == reference, f"entry peer{entry.index} stream={stream}"
            assert usage.completion_tokens == N_TOKENS
    metrics = relay.metrics()
    assert metrics["meshd_relay_registered_peers"] >= 1
    assert metrics["meshd_relay_circuits_total"] >= 1
    assert metrics['meshd_relay_bytes_relayed_total{direction="to_peer"}'] > 0
    assert (peer_row(direct, hidden.peer_id) or {}).get("link") == "relay"


def test_a_peer_that_passes_the_dial_back_test_goes_direct(relayed):
    mesh, relay = relayed
    auto = mesh.start_peer(extra=["--relay", relay.address])  # auto with a relay: relayed until verified
    mesh.wait_until(lambda: (peer_row(mesh.peers[0], auto.peer_id) or {}).get("addresses") == [auto.listen], 60,
                    "the auto peer to advertise its verified address")
    status = auto.get("/status")["reachability"]
    assert status["mode"] == "auto" and status["dialable"] is True
    assert status["relays"][0]["registered"] is True  # the registration stays up as a fallback


def test_relay_restart_peers_re_register_and_sessions_succeed(relayed, reference):
    mesh, relay = relayed
    direct, hidden = mesh.peers[0], mesh.peers[1]
    mesh.stop_relay(relay)
    mesh.wait_until(lambda: not hidden.get("/status")["reachability"]["relays"][0]["registered"], 20,
                    "the relayed peer to notice the relay is gone")
    again = mesh.start_relay(port=relay.port)
    mesh.wait_until(lambda: again.metrics()["meshd_relay_registered_peers"] >= 1, 30, "re-registration")
    mesh.wait_until(lambda: (peer_row(direct, hidden.peer_id) or {}).get("relays") == [f"relay:{again.address}"]
                    and "tiny" in direct.get("/status")["models_covered"], 30, "the relay address back in the card")
    assert hidden.get("/status")["reachability"]["relays"][0]["registrations"] >= 2
    text, _ = chat(direct, stream=False)
    assert text == reference
    assert again.metrics()["meshd_relay_circuits_total"] >= 1


def test_a_relay_killed_mid_stream_and_restarted_costs_a_pause_not_the_reply(relayed, tiny_model):
    mesh, _relay = relayed
    direct, hidden = mesh.peers[0], mesh.peers[1]
    relay = mesh.relays[-1]  # the live one: an earlier test may have restarted it
    n = 600
    expected = References(tiny_model).text(0, n)
    repairs = direct.log_path.read_text().count("repaired (")
    generation = Generation(direct.api, 0, n)
    generation.start()
    mesh.wait_until(lambda: generation.chunks >= 20 or not generation.is_alive(), 60, "the reply to start")
    mesh.kill_relay(relay)
    cut_at = generation.chunks
    time.sleep(1.0)
    mesh.start_relay(port=relay.port)
    generation.join(180)
    assert not generation.is_alive() and generation.error is None, generation.error
    assert cut_at < n, "the reply was complete before the relay went"
    assert generation.text == expected
    assert generation.usage is not None and generation.usage.completion_tokens == n
    assert direct.log_path.read_text().count("repaired (") > repairs
    assert hidden.get("/status")["reachability"]["relays"][0]["registered"] is True


def test_bench_relay_writes_seam_percentiles_and_the_compression_tradeoff(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "bench-relay.json"
    run = subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", "bench-relay", "--samples", "10",
                          "--compression", "--compression-tokens", "384", "--compression-samples", "2",
                          "--link-caps", "4MB", "--out", str(out), "--workdir", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=180, check=False)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    for link in ("direct", "relayed"):
        for size in ("decode_step", "prefill_chunk"):
            row = report["seam"][link][size]
            assert row["n"] == 10 and 0 < row["p50_ms"] <= row["p95_ms"]
    assert report["seam"]["relay_metrics"]['meshd_relay_bytes_relayed_total{direction="to_peer"}'] > 0
    assert "relayed" in run.stdout
    tradeoff = report["compression"]
    assert set(tradeoff) == {"chunk_bytes", "samples", "direct", "relayed", "relayed, capped at 4MB/s"}
    for link in ("direct", "relayed", "relayed, capped at 4MB/s"):
        row = tradeoff[link]
        assert row["zstd"]["bytes"] < row["raw"]["bytes"] and row["raw"]["n"] == row["zstd"]["n"] == 2
    # 1.5 MiB at 4 MB/s is 0.4 s on the link; compressing it costs milliseconds: the policy compresses
    assert tradeoff["relayed, capped at 4MB/s"]["policy_compresses"] is True
