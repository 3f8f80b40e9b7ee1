"""What ``meshctl sim`` measures for a mesh of N peers, each scenario on a fresh simulated mesh.

- **join**: every peer starts at once and joins through one seed. Converged is when every peer sees
  every other alive and all name one tracker; ``rounds`` is that time in push-pull intervals (each
  peer's full exchange with one random other), the unit in which epidemic spreading takes O(log N).
- **steady**: after converging, a window of ordinary running: the bytes each peer sends and receives
  per second, the verdicts that called a live peer suspect or dead (every peer is alive, so each is
  false), and tracker changes.
- **partition**: the mesh is cut in two halves; each half ends up with a tracker of its own (the
  other side's lease runs out and cannot be renewed there), and the cut stays until each side has
  declared the other dead; then it heals, and the sides find each other again (each peer tries a
  dead member's last address now and then) until one tracker remains everywhere.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from meshd.daemon.control_plane import gossip_config
from meshd.gossip import MemberState, dead_everywhere_bound
from meshd.sim.mesh import LinkModel, SimMesh
from meshd.stats import percentile

JOIN_LIMIT_S = 120.0


def _false_verdicts(mesh: SimMesh, since: float, alive: set[str]) -> dict[str, int]:
    out = {"suspect": 0, "dead": 0}
    for v in mesh.verdicts:
        if v.at >= since and v.peer_id in alive and v.new in (MemberState.SUSPECT, MemberState.DEAD):
            out[v.new.name.lower()] += 1
    return out


def _tracker_changes(mesh: SimMesh, since: float) -> int:
    """Times a peer saw the tracker change after ``since`` (summed over peers)."""
    return sum(1 for c in mesh.changes if c.at >= since)


def join_and_steady(n: int, link: LinkModel, steady_s: float, seed: int) -> dict[str, Any]:
    mesh = SimMesh(n, link, seed)
    interval = mesh.config.pushpull_interval_s
    started = time.monotonic()
    at = mesh.run(JOIN_LIMIT_S, mesh.converged)
    out: dict[str, Any] = {"peers": n, "loss": link.loss, "latency_ms": link.latency_s * 1000,
                           "converged": at is not None}
    if at is None:
        out["join_s"] = None
        return out
    out["join_s"] = round(at, 3)
    out["join_rounds"] = round(at / interval, 1)
    out["join_rounds_per_log2_n"] = round(at / interval / math.log2(n), 2)
    before = mesh.bytes_per_peer()
    mesh.run(steady_s)
    rates = [(b - a) / steady_s for a, b in zip(before, mesh.bytes_per_peer(), strict=True)]
    out["steady_s"] = steady_s
    out["bytes_per_peer_s"] = {"mean": round(sum(rates) / len(rates)), "p99": round(percentile(sorted(rates), 0.99)),
                               "max": round(max(rates))}
    out["false_verdicts"] = _false_verdicts(mesh, at, set(mesh.ids))
    out["tracker_changes"] = _tracker_changes(mesh, at)
    out["trackers_at_end"] = len(mesh.trackers())
    out["wall_s"] = round(time.monotonic() - started, 1)
    return out


def partition_and_heal(n: int, link: LinkModel, seed: int) -> dict[str, Any]:
    mesh = SimMesh(n, link, seed)
    out: dict[str, Any] = {"peers": n, "loss": link.loss}
    at = mesh.run(JOIN_LIMIT_S, mesh.converged)
    if at is None:
        return out | {"converged": False}
    halves = {p: (0 if i < n // 2 else 1) for i, p in enumerate(mesh.ids)}
    sides = [[p for p in mesh.ids if halves[p] == s] for s in (0, 1)]
    mesh.partition(halves)
    cut_at = mesh.elapsed

    def both() -> bool:  # each side names one tracker of its own
        return len(mesh.trackers()) == 2 and all(len(mesh.trackers(s)) == 1 and None not in mesh.trackers(s)
                                                 for s in sides)

    split = mesh.run(60.0, both)
    out["trackers_while_cut"] = len(mesh.trackers())
    out["split_s"] = None if split is None else round(split - cut_at, 3)
    # keep the cut until each side has declared the other dead: the hard case for the heal
    hold = dead_everywhere_bound(gossip_config(mesh.config), n) + 2.0
    mesh.run(max(2.0, cut_at + hold - mesh.elapsed))
    out["cut_s"] = round(mesh.elapsed - cut_at, 3)
    out["dead_across_the_cut"] = all(mesh.peers[p].gossip.members().get(q) == MemberState.DEAD
                                     for p in sides[0][:3] for q in sides[1][:3])
    mesh.heal()
    healed_at = mesh.elapsed
    one = mesh.run(60.0, mesh.converged)
    out["heal_s"] = None if one is None else round(one - healed_at, 3)
    out["trackers_after_heal"] = len(mesh.trackers())
    out["lease_duration_s"] = mesh.config.lease_duration_s
    return out


def simulate(sizes: list[int], losses: list[float], steady_s: float = 10.0, seed: int = 1,
             latency_ms: float = 10.0, partition: bool = True,
             say: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    runs = []
    for n in sizes:
        for loss in losses:
            say(f"simulating {n} peers at {loss:.0%} loss")
            runs.append(join_and_steady(n, LinkModel(latency_ms / 1000, latency_ms / 2000, loss), steady_s, seed))
        if partition:
            say(f"simulating a partition of {n} peers")
            runs[-1]["partition"] = partition_and_heal(n, LinkModel(latency_ms / 1000, latency_ms / 2000), seed)
    return {"kind": "meshd-sim", "seed": seed, "steady_s": steady_s, "runs": runs}
