"""``meshctl sim``: the control plane of N peers simulated in this process (:mod:`meshd.sim`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from meshd.cli.mesh_cmd import print_table
from meshd.files import write_atomically


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not values or any(not 0 <= v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"loss rates are fractions in [0, 1), got {text!r}")
    return values


def _sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected peer counts separated by commas, got {text!r}") from None
    if not values or any(v < 2 for v in values):
        raise argparse.ArgumentTypeError(f"a simulated mesh has at least 2 peers, got {text!r}")
    return values


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"a positive number, not {text!r}")
    return value


def _cmd_sim(args: argparse.Namespace) -> int:
    from meshd.sim.scenarios import simulate

    report = simulate(list(args.peers), list(args.loss), steady_s=args.seconds, seed=args.seed,
                      latency_ms=args.latency_ms, partition=not args.no_partition,
                      say=lambda line: print(line, file=sys.stderr, flush=True))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, json.dumps(report, indent=2) + "\n")
    converged = all(r["converged"] for r in report["runs"])
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if converged else 1
    rows = []
    for r in report["runs"]:
        b = r.get("bytes_per_peer_s", {})
        part = r.get("partition", {})
        rows.append([str(r["peers"]), f"{r['loss']:.0%}", "-" if r["join_s"] is None else f"{r['join_s']:.2f}",
                     str(r.get("join_rounds", "-")), str(b.get("mean", "-")), str(b.get("max", "-")),
                     str(r.get("false_verdicts", {}).get("dead", "-")), str(r.get("tracker_changes", "-")),
                     f"{part.get('trackers_while_cut', '-')} -> {part.get('trackers_after_heal', '-')}"
                     if part else "-"])
    print_table(rows, ["PEERS", "LOSS", "JOIN S", "ROUNDS", "B/PEER/S", "MAX", "FALSE DEAD", "TRACKER CHANGES",
                  "PARTITION TRACKERS"])
    print(f"report: {out}")
    return 0 if converged else 1


def add_sim_parser(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser(
        "sim", help="simulate the gossip, failure detection and election of N peers in this process",
        description="Run the real sans-IO gossip and election of N peers over a simulated network (latency, "
        "jitter, loss, a partition) on a fake clock, and report per mesh size and loss rate: time and rounds to "
        "converge from a cold start through one seed, bytes per peer per second once converged, false suspect "
        "and dead verdicts, tracker changes, and a partition's two trackers healing into one. Takes seconds at "
        "100 peers and minutes at 1000. Exits 1 when a mesh did not converge.")
    sim.add_argument("--peers", type=_sizes, default=(100, 300, 1000), metavar="LIST",
                     help="mesh sizes (default 100,300,1000)")
    sim.add_argument("--loss", type=_float_list, default=(0.0, 0.05), metavar="LIST",
                     help="message loss rates (default 0,0.05)")
    sim.add_argument("--seconds", type=_positive, default=10.0, metavar="S",
                     help="simulated seconds of steady running measured after converging (default 10)")
    sim.add_argument("--latency-ms", type=_positive, default=10.0, metavar="MS",
                     help="one-way latency of every link, plus up to half of it as jitter (default 10)")
    sim.add_argument("--seed", type=int, default=1, help="seed of the run (default 1): a run is reproducible")
    sim.add_argument("--no-partition", action="store_true", help="skip the partition scenario")
    sim.add_argument("--out", default="bench-out/sim.json", metavar="FILE",
                     help="JSON report (default bench-out/sim.json)")
    sim.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    sim.set_defaults(func=_cmd_sim)
