"""``meshctl replay``: re-run captured requests through the local daemon on a chosen route and say
whether the replies are still the same, and where each first differs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from meshd.capture.records import CapturedRequest, CaptureFormatError
from meshd.capture.replay import (
    DIFFERS,
    FAILED,
    IDENTICAL,
    UNMATCHED,
    ReplayError,
    exit_code,
    parse_route_spec,
    summarize,
)
from meshd.capture.store import read_capture
from meshd.cli.mesh_cmd import ControlError, _add_control, control_get

EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
REPLAY_TIMEOUT_S = 900.0  # one replay may take as long as a request may (request_timeout_s, 600 s by default)

DESCRIPTION = """\
Re-run captured requests (a capture directory such as meshd-data/capture, or one of its JSONL files)
through the local daemon, each exactly as it ran: the same seed (the one drawn when the request gave
none), sampling, token limit and stop settings, on one route and without repair, so a hop that fails
fails the replay instead of being replaced. Replies are compared token by token: for a full capture
the first differing token's index and both tokens' text are shown; a metadata capture keeps no
reply, so its replies are compared by their keyed hash and length (identical or not).

A metadata capture keeps no request either: give the requests again with --requests (a JSONL file of
OpenAI request bodies, one per line); each is matched to its records by its prompt's keyed hash,
which only the daemon that captured them can compute, so replay them through that daemon.

The route: --route pins every hop; --peers/--through require peers on it (the best route through
them); otherwise the best route of the captured compat key now. As a gate before a peer with new
software, dtype or quantization serves: meshctl replay CAPTURE --through PEER.

Exit status: 0 every reply identical; 1 some reply differs; 2 bad arguments or capture file; 3 none
differs but some could not be replayed (no route, a request not re-supplied, the daemon unreachable).
"""


def _peer_list(text: str) -> list[str]:
    peers = [p.strip() for p in text.split(",") if p.strip()]
    if not peers:
        raise argparse.ArgumentTypeError("expected peer ids (or their starts), comma-separated")
    return peers


def add_replay_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="re-run captured requests on a chosen route and compare the replies",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("capture", metavar="CAPTURE",
                   help="a capture directory (DATA_DIR/capture of the daemon that captured) or a JSONL file of records")
    route = p.add_mutually_exclusive_group()
    route.add_argument("--route", metavar="HOPS",
                       help="run every replay on exactly this route, head first: PEER:START:END,PEER:START:END (or "
                       "PEER,PEER: each hop runs the layers its peer holds; a peer id's start is enough)")
    route.add_argument("--peers", type=_peer_list, action="append", metavar="PEER[,PEER...]",
                       help="run every replay on the best route that has all of these peers on it")
    p.add_argument("--through", action="append", metavar="PEER",
                   help="the gate: replay on routes through PEER and say whether it changes replies (as --peers; "
                   "repeatable)")
    p.add_argument("--exclude", type=_peer_list, action="append", metavar="PEER[,PEER...]",
                   help="keep these peers off the route (not with --route)")
    p.add_argument("--requests", metavar="FILE",
                   help="for metadata captures: the requests again, as JSONL of OpenAI request bodies "
                        "(refused when no record selected is a metadata one)")
    p.add_argument("--limit", type=int, metavar="N", help="replay only the newest N records")
    p.add_argument("--model", help="replay only records of this model")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output (JSON Schema: meshd/cli/schemas/replay.json)")
    _add_control(p)
    p.set_defaults(func=_cmd_replay, timeout=REPLAY_TIMEOUT_S)


def _usage(message: str) -> int:
    print(f"meshctl replay: {message}", file=sys.stderr)
    return EXIT_USAGE


def _read_requests(path: Path) -> list[dict[str, Any]]:
    bodies = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise ValueError(f"{path}:{number}: not a JSON object (an OpenAI request body)")
        bodies.append(body)
    return bodies


def _cmd_replay(args: argparse.Namespace) -> int:
    peers = [p for group in args.peers or [] for p in group] + list(args.through or [])
    exclude = [p for group in args.exclude or [] for p in group]
    if args.route and (args.through or exclude):
        return _usage("--route names the whole route: it takes neither --through nor --exclude")
    if args.route:
        try:
            parse_route_spec(args.route)
        except ReplayError as exc:
            return _usage(str(exc))
    if args.limit is not None and args.limit < 1:
        return _usage("--limit is at least 1")
    try:
        capture = read_capture(Path(args.capture))
        bodies = _read_requests(Path(args.requests)) if args.requests else []
    except PermissionError as exc:
        return _usage(f"{exc}: capture files are private to the daemon's user; run meshctl as that user")
    except (OSError, ValueError) as exc:
        return _usage(str(exc))
    for warning in capture.warnings:
        print(f"meshctl replay: {warning}", file=sys.stderr)
    docs = [d for d in capture.records if args.model is None or d.get("model") == args.model]
    if args.limit is not None:
        docs = docs[-args.limit:]
    results: list[dict[str, Any] | None] = [None] * len(docs)
    records: dict[int, CapturedRequest] = {}
    for i, doc in enumerate(docs):
        try:
            records[i] = CapturedRequest.from_json(doc)
        except CaptureFormatError as exc:
            results[i] = {"id": doc.get("id"), "status": FAILED, "error": str(exc)}
    if bodies and not any(r.mode == "metadata" for r in records.values()):
        return _usage(f"--requests gives metadata records their requests again, and none of the {len(docs)} "
                      "records selected is one (a full capture keeps its own requests)")
    try:
        requests = _matched_requests(args, docs, records, bodies)
        for i, doc in enumerate(docs):
            result = results[i]
            if result is None:
                record = records[i]
                if record.mode == "metadata" and i not in requests:
                    result = {"id": record.id, "status": UNMATCHED, "error": "none of the requests given has this "
                              "record's prompt" if bodies else "no request given for this metadata record "
                              "(--requests: the requests again, matched by prompt)"}
                else:
                    result = _replay(args, doc, requests.get(i), peers, exclude)
                results[i] = result
            _print_result(args, result)
    except _Unreachable as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return EXIT_INCOMPLETE
    done = [r for r in results if r is not None]
    summary = summarize(done)
    if args.json:
        print(json.dumps({"summary": summary, "results": done, "warnings": capture.warnings}, indent=2))
    else:
        _print_summary(summary, args.through or [])
    return exit_code(summary)


class _Unreachable(Exception):
    pass


def _ask(args: argparse.Namespace, path: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        return control_get(args, path, body)
    except ControlError as exc:
        if "cannot reach" in str(exc):
            raise _Unreachable(str(exc)) from None
        raise


def _matched_requests(args: argparse.Namespace, docs: list[dict[str, Any]], records: dict[int, CapturedRequest],
                      bodies: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Record index -> its re-supplied request, for the metadata records (matched by the daemon)."""
    metadata = {i: r for i, r in records.items() if r.mode == "metadata"}
    if not metadata or not bodies:
        return {}
    try:
        answer = _ask(args, "/replay/match", {"records": [docs[i] for i in metadata], "requests": bodies})
    except ControlError as exc:
        raise _Unreachable(f"the requests could not be matched: {exc}") from None
    for error in answer.get("errors", []):
        where = f"request {error['body'] + 1}" if "body" in error else f"record {error.get('record')}"
        print(f"meshctl replay: {where}: {error['error']}", file=sys.stderr)
    by_id: dict[str, list[int]] = {}
    for i, r in metadata.items():
        by_id.setdefault(r.id, []).append(i)
    out = {}
    for match in answer.get("matches", []):
        for i in by_id.get(match["record"], []):
            out[i] = bodies[match["body"]]
    return out


def _replay(args: argparse.Namespace, doc: dict[str, Any], body: dict[str, Any] | None, peers: list[str],
            exclude: list[str]) -> dict[str, Any]:
    request: dict[str, Any] = {"record": doc, "route": args.route or "", "peers": peers, "exclude": exclude}
    if body is not None:
        request["request"] = body
    try:
        return _ask(args, "/replay", request)
    except ControlError as exc:
        return {"id": doc.get("id"), "status": FAILED, "error": str(exc)}


def _route_text(route: dict[str, Any] | list[dict[str, Any]] | None) -> str:
    hops = route.get("hops", []) if isinstance(route, dict) else route or []
    return " -> ".join(f"{h['peer_id'][:8]}[{h['start']},{h['end']})" for h in hops) or "-"


def _print_result(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.json:
        return
    rid = str(result.get("id"))[:16]
    status = result["status"]
    replayed = result.get("replayed") or {}
    line = f"{rid:<16}  {status:<16}"
    if replayed:
        captured = (result.get("captured") or {}).get("tokens")
        count = f"{replayed.get('tokens')} tokens" + ("" if replayed.get("tokens") == captured else
                                                       f" (captured {captured})")
        line += f" {count}  on {_route_text(replayed)}"
        if result.get("same_route"):
            line += " (the captured route)"
    if result.get("error"):
        line += f"  {result['error']}"
    print(line, flush=True)
    diff = result.get("first_difference")
    if status == DIFFERS and diff:
        print(f"{'':<18}first difference at token {diff['index']}: captured {_said(diff['captured'])}, "
              f"replayed {_said(diff['replayed'])}", flush=True)
    elif status == DIFFERS:
        print(f"{'':<18}the reply's hash or length differs (a metadata capture keeps no tokens to say where)",
              flush=True)


def _said(token: dict[str, Any] | None) -> str:
    return "(end of reply)" if token is None else f"{token['text']!r} (id {token['token']})"


def _print_summary(summary: dict[str, Any], through: list[str]) -> None:
    print(f"{summary['records']} records: {summary[IDENTICAL]} identical, {summary[DIFFERS]} differ, "
          f"{summary['not_replayed']} not replayed")
    if through:
        who = ", ".join(through)
        if summary[DIFFERS]:
            print(f"gate: routes through {who} change {summary[DIFFERS]} of {summary['compared']} replies; do not "
                  "let it serve until that is understood")
        elif summary["compared"] and not summary["not_replayed"]:
            print(f"gate: routes through {who} reproduce all {summary['compared']} replies")
        else:
            print(f"gate: inconclusive: only {summary['compared']} of {summary['records']} records were replayed "
                  f"through {who}")
