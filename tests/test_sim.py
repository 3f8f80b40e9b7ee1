"""The control plane of many peers simulated in one process (meshd.sim): convergence, false
verdicts under loss, one tracker, a partition's two trackers healing into one, and meshctl sim."""

from __future__ import annotations

import json
import subprocess
import sys

from meshd.sim.mesh import LinkModel, SimMesh
from meshd.sim.scenarios import join_and_steady, partition_and_heal


def test_a_cold_mesh_converges_to_one_tracker_and_stays_quiet():
    run = join_and_steady(40, LinkModel(), steady_s=5.0, seed=3)
    assert run["converged"] and run["join_rounds"] < 20
    assert run["false_verdicts"] == {"suspect": 0, "dead": 0}
    assert run["tracker_changes"] == 0 and run["trackers_at_end"] == 1
    assert 0 < run["bytes_per_peer_s"]["mean"] <= run["bytes_per_peer_s"]["max"]


def test_lost_probes_are_answered_by_indirect_ones_even_with_coarse_ticks():
    """The daemon ticks every 0.25 s, coarser than the window between a probe's timeout and its end:
    a lost ping or ack must still leave the indirect probes their window instead of suspecting at once
    (which, at 5 % loss, made live peers suspects more than once a second in a mesh of 30)."""
    mesh = SimMesh(30, LinkModel(loss=0.05), seed=2)
    at = mesh.run(60.0, mesh.converged)
    assert at is not None
    mesh.run(20.0)
    false = [v for v in mesh.verdicts if v.at >= at and v.new.name in ("SUSPECT", "DEAD")]
    assert len(false) <= 30, f"{len(false)} suspect or dead verdicts about live peers in 20 s"


def test_a_partition_elects_a_tracker_on_each_side_and_the_heal_leaves_one():
    run = partition_and_heal(20, LinkModel(), seed=5)
    assert run["trackers_while_cut"] == 2 and run["split_s"] is not None
    assert run["dead_across_the_cut"], "the cut lasted until each side had declared the other dead"
    assert run["trackers_after_heal"] == 1 and run["heal_s"] is not None


def test_meshctl_sim_writes_its_report(tmp_path):
    out = tmp_path / "sim.json"
    done = subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", "sim", "--peers", "12", "--loss", "0",
                           "--seconds", "2", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["kind"] == "meshd-sim" and report["runs"][0]["peers"] == 12
    assert "PARTITION TRACKERS" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", "sim", "--loss", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "loss rates are fractions" in bad.stderr
