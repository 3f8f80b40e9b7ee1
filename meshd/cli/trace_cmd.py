"""``meshctl trace-parity``: one request through the mesh, compared seam by seam with one process.

The local daemon runs it (``POST /trace-parity`` of its control API, :mod:`meshd.trace.parity`);
this prints its report as a table, or as JSON with ``--json`` (schema:
``meshd/cli/schemas/trace-parity.json``). Exit status 0 when every comparison is within the
tolerance, 1 when one is not, when a hop gave no trace, or when the daemon refused the request.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from meshd.cli.mesh_cmd import DEFAULT_CONTROL, control_get, print_table
from meshd.trace.limits import DEFAULT_DECODE_STEPS, DEFAULT_TOLERANCE, MAX_TRACE_DECODE_STEPS

DEFAULT_TIMEOUT_S = 600.0  # the daemon loads and runs the whole model for the reference first


def _number(value: float | None) -> str:
    if value is None:
        return "not finite"
    return "0" if value == 0 else f"{value:.3g}"


def _at(row: dict) -> str:
    if row["what"] == "layer":
        return f"layer {row['layer']}"
    return "seam" if row["what"] == "seam" else "logits"


def print_report(report: dict) -> None:
    """The report as people read it: what was traced, one row per comparison, and the verdict."""
    hops = report["route"]
    print(f"trace parity of {report['model']} over {len(hops)} hop{'s' if len(hops) != 1 else ''} "
          f"(compat {report['compat_key'][:12]}, {report['numerics']}), route by {report['planned_by']}")
    print(f"{report['prompt_tokens']} prompt tokens + {report['decode_steps']} decode steps; tolerance "
          f"{report['tolerance']:g} relative error; one process from {report['reference']['model_dir']} "
          f"({report['reference']['ms']:.0f} ms)")
    rows = [[str(c["hop"]), c["peer_id"][:12], f"[{c['start']},{c['end']})", _at(c), _number(c["max_abs_diff"]),
             _number(c["rel_error"]), "-" if c["worst_position"] is None else str(c["worst_position"]),
             "ok" if c["ok"] else "OUT"] for c in report["comparisons"]]
    if rows:
        print_table(rows, ["HOP", "PEER", "LAYERS", "AT", "MAX ABS DIFF", "REL ERROR", "WORST POS", "VERDICT"])
    tokens = report["tokens"]
    if tokens["mesh"] is not None:
        same = "identical" if tokens["identical"] else "DIFFERENT"
        print(f"greedy tokens: one process {tokens['reference']}, mesh {tokens['mesh']} ({same})")
    if report["error"] is not None:
        print(f"TRACE INCOMPLETE: {report['error']['message']}")
    first = report["first_failure"]
    if first is not None:
        print(f"PARITY FAILS first at {first['where']}: relative error {_number(first['rel_error'])} (tolerance "
              f"{report['tolerance']:g}), max abs diff {_number(first['max_abs_diff'])}"
              + ("" if first["worst_position"] is None else f", worst at position {first['worst_position']}"))
    elif report["passed"]:
        print(f"parity holds: every {'layer and ' if report['layers'] else ''}seam within {report['tolerance']:g} "
              "of one process")


def _cmd_trace_parity(args: argparse.Namespace) -> int:
    body: dict = {"model": args.model, "prompt": args.prompt, "raw": args.raw, "layers": args.layers,
                  "decode_steps": args.decode_steps}
    if args.tolerance is not None:
        body["tolerance"] = args.tolerance
    if args.route:
        body["route"] = args.route
    if args.model_dir:
        body["model_dir"] = str(Path(args.model_dir).expanduser().resolve())
    report = control_get(args, "/trace-parity", body)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["passed"] else 1


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"a tolerance is a finite number, 0 or more, not {text!r}")
    return value


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_TRACE_DECODE_STEPS:
        raise argparse.ArgumentTypeError(f"decode steps go from 0 to {MAX_TRACE_DECODE_STEPS}, not {value}")
    return value


def add_trace_parser(sub: argparse._SubParsersAction) -> None:
    defaults = ", ".join(f"{k} {v:g}" for k, v in DEFAULT_TOLERANCE.items())
    p = sub.add_parser(
        "trace-parity", help="run one request through the mesh and compare every seam's hidden states with one "
        "process",
        description="Ask the local daemon to run one request through a route of the mesh with the hidden states "
        "read at every seam (with --layers, after every layer inside each hop) and to compare them with one "
        "process computing the whole model in the same numerics class, from local files that must be the "
        "route's model (same compat key). The prompt is encoded as the API encodes a user's chat message; the "
        "one process then generates --decode-steps greedy tokens, and every hop computes the prompt as a "
        "prefill and those tokens as decode steps, each hop on what the hop before it actually sent. The report "
        "gives the max abs difference and the relative error (L2 norm of the difference over the reference's) "
        "of each seam, layer and the tail's logits, and the first hop and layer whose output leaves the "
        "tolerance. Each hop computes in a throw-away session: no other session is touched. Exit status 0 when "
        "parity holds, 1 when it fails, a hop gave no trace, or the daemon refused.",
        epilog="example: meshctl trace-parity --model tiny --prompt 'Who computed this?' --layers")
    p.add_argument("--model", required=True, help="model id, as listed by /v1/models")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the request's text")
    p.add_argument("--raw", action="store_true",
                   help="encode the prompt as plain text (as /v1/completions does), not as a chat message")
    p.add_argument("--layers", action="store_true",
                   help="also compare every layer's output inside each hop, to name the exact layer")
    p.add_argument("--decode-steps", type=_steps, default=DEFAULT_DECODE_STEPS, metavar="N",
                   help=f"greedy tokens traced as decode steps after the prompt's prefill, 0 to "
                   f"{MAX_TRACE_DECODE_STEPS} (default {DEFAULT_DECODE_STEPS})")
    p.add_argument("--tolerance", type=_tolerance, metavar="REL",
                   help=f"the largest relative error that passes (default by the class's dtype: {defaults})")
    p.add_argument("--route", metavar="PEER,PEER,...",
                   help="trace exactly these hops, head first (peer ids or unique starts of them, optionally "
                   "PEER:START:END); default: the route the tracker picks")
    p.add_argument("--model-dir", metavar="PATH",
                   help="the model's files for the one-process reference (default: the daemon's own, when it "
                   "serves the model from complete files)")
    p.add_argument("--json", action="store_true",
                   help="machine-readable report (JSON Schema: meshd/cli/schemas/trace-parity.json)")
    p.add_argument("--control", default=os.environ.get("MESHD_CONTROL", DEFAULT_CONTROL), metavar="HOST:PORT",
                   help=f"the local daemon's control API (default {DEFAULT_CONTROL}, or $MESHD_CONTROL)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to wait for the daemon (default {DEFAULT_TIMEOUT_S:g})")
    p.set_defaults(func=_cmd_trace_parity)
