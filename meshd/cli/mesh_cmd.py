"""``meshctl`` commands that ask the local daemon, through its control API: peers, status, models,
route, sessions, logs, chat. Human tables by default, ``--json`` for scripts (schemas in
``meshd/cli/schemas/``, docs/operations.md), exit status 1 with one line when the daemon cannot be
asked."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

DEFAULT_CONTROL = "127.0.0.1:7701"


class ControlError(Exception):
    pass


def control_get(args: argparse.Namespace, path: str, body: dict | None = None) -> dict:
    """GET ``path`` from the daemon's control API, or POST ``body`` as JSON to it."""
    url = f"http://{args.control}{path}"
    request = urllib.request.Request(url) if body is None else urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("error", "")
        except ValueError:
            detail = ""
        raise ControlError(f"{url}: HTTP {exc.code} {detail}".strip()) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        raise ControlError(f"cannot reach the daemon's control API at {args.control}: {exc}. "
                           "Is meshd running? (set --control or MESHD_CONTROL)") from None
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise ControlError(f"{url} answered, but not as meshd's control API (no JSON object): is --control "
                           "the daemon's control address?")
    return answer


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def print_table(rows: list[list[str]], header: list[str]) -> None:
    """Print a table with rich: aligned columns on a terminal, never wrapped or cut when piped."""
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    for name in header:
        table.add_column(name, no_wrap=True, overflow="ignore")
    for row in rows:
        table.add_row(*(str(v) for v in row))
    console = Console()
    if not console.is_terminal:
        console = Console(width=100_000, no_color=True, highlight=False)
    console.print(table)


def _print_json(doc: object) -> int:
    print(json.dumps(doc, indent=2))
    return 0


def _reach(peer: dict) -> str:
    """``direct``, or ``relay HOST:PORT`` for a peer reached only through a relay."""
    via = peer.get("relayed_via") or []
    if via:
        return "relay " + ",".join(v.removeprefix("relay:") for v in via)
    return "direct" if peer.get("addresses") else "-"


def _audit(audit: dict | None) -> str:
    """``-``, or what this peer's audits found: ``passed 3``, ``EXCLUDED (2 failed)``, ``accused by 1``."""
    if not audit:
        return "-"
    state = audit["state"]
    if state == "excluded":
        return f"EXCLUDED ({audit['guilty']} failed)"
    if state == "suspect":
        return f"suspect ({audit['guilty']} failed)"
    if state == "accused":
        return f"accused by {len(audit['accused_by'])}" + (
            f", not borne out {audit['unconfirmed_accusations']}" if audit["unconfirmed_accusations"] else "")
    return f"{state} {audit['passed']}" if state == "passed" else state


def _cmd_peers(args: argparse.Namespace) -> int:
    peers = control_get(args, "/peers")["peers"]
    if args.json:
        return _print_json(peers)
    rows = []
    for p in peers:
        models = ", ".join(f"{m['model_id']}[{m['start']},{m['end']})" if m.get("end") else f"{m['model_id']}[-]"
                           for m in p["models"]) or "-"
        rows.append([
            p["peer_id"][:12] + ("*" if p.get("self") else ""), p.get("name") or "-",
            ",".join(p.get("addresses") or []) or "-", _reach(p), "tracker" if p.get("tracker") else "peer",
            p.get("state", "-"), models, f"{p.get('active_sessions', 0)}/{p.get('queued', 0)}",
            "-" if p.get("rtt_ms") is None else f"{p['rtt_ms']:.2f}ms",
            _age(p.get("last_seen_s")), _age(p.get("card_age_s")),
            "DEMOTED" if p.get("demoted") else _audit(p.get("audit")),
        ])
    print_table(rows, ["PEER", "NAME", "ADDRESSES", "REACH", "ROLE", "STATE", "MODEL[RANGE]", "LOAD", "RTT",
                        "LAST SEEN", "CARD AGE", "AUDIT"])
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    status = control_get(args, "/status")
    if args.json:
        return _print_json(status)
    for key, value in status.items():
        print(f"{key:>18}: {json.dumps(value) if isinstance(value, dict | list) else value}")
    return 0


def _rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.0f} bit/s"


def _link(crossing: dict | None, entry: str) -> list[str]:
    """A crossing's columns: where from, half its round trip, the transfer, and what they rest on."""
    if crossing is None:  # a tracker that does not say
        return ["-", "-", "-", "-"]
    source = crossing["from_peer"][:12] + (" (entry)" if crossing["from_peer"] == entry else "")
    if crossing["from_peer"] == crossing["to_peer"]:
        return [source, "0.000", "0.000", "same peer"]
    rtt = f"rtt {crossing['rtt_ms']:.2f}ms " + ("measured" if crossing["rtt_measured"] else
                                                   "default+relay" if crossing["relayed"] else "default")
    parts = [rtt + (" (relayed)" if crossing["relayed"] and crossing["rtt_measured"] else "")]
    if crossing["bytes"]:
        parts.append(f"{crossing['bytes']} B at {_rate(crossing['rate_bps'])} "
                     + ("measured" if crossing["rate_measured"] else "default"))
    return [source, f"{crossing['latency_ms']:.3f}", f"{crossing['transfer_ms']:.3f}", ", ".join(parts)]


def _cmd_route(args: argparse.Namespace) -> int:
    route = control_get(args, f"/route?model={urllib.parse.quote(args.model)}")
    if args.json:
        return _print_json(route)
    entry = route.get("entry") or ""
    hops, back = route["hops"], route.get("back")
    compute = sum(h["compute_ms"] for h in hops)
    links = sum(h["seam_ms"] for h in hops) + (back["latency_ms"] + back["transfer_ms"] if back else 0.0)
    print(f"model {route['model']} (compat {route['compat_key']}), epoch {route['epoch']}, "
          f"planned by {route['planned_by']} for entry {entry[:12] or '-'}")
    print(f"estimated {route['cost_ms']:.3f} ms/token = compute {compute:.3f} + links {links:.3f} "
          f"+ per hop {sum(h['hop_ms'] for h in hops):.3f}")
    rows = [[h["peer_id"][:12], f"[{h['start']},{h['end']})", f"{h['compute_ms']:.3f}", f"{h['load_factor']:.2f}",
             f"{h['hop_ms']:.3f}", *_link(h.get("crossing"), entry)] for h in hops]
    if back is not None:
        rows.append(["entry", "-", "-", "-", "-", *_link(back, entry)])
    print_table(rows, ["PEER", "LAYERS", "COMPUTE MS", "LOAD", "HOP MS", "FROM", "RTT/2 MS", "XFER MS", "LINK"])
    return 0


def _listing(args: argparse.Namespace, name: str, empty: str) -> list[dict] | None:
    """The daemon's list ``name``; printed as JSON, or said to be empty, it is handled here (None)."""
    items: list[dict] = control_get(args, f"/{name}")[name]
    if args.json:
        _print_json(items)
        return None
    if not items:
        print(empty, file=sys.stderr)
        return None
    return items


def _cmd_models(args: argparse.Namespace) -> int:
    models = _listing(args, "models", "the mesh offers no model yet")
    if models is None:
        return 0
    for m in models:
        gaps = ", ".join(f"[{a},{b})" for a, b in m["missing"])
        state = "covered" if m["covered"] else f"NOT COVERED, missing {gaps}"
        print(f"{m['model']}: {m['n_layers']} layers, {state}, {len(m['holders'])} peers")
        print(f"  {_coverage_bar(m)}")
        rows = [[h["peer_id"][:12], h["name"], "-" if h["start"] is None else f"[{h['start']},{h['end']})",
                 h["backend"] or "-", h["numerics"] or "-", h["compat_key"][:12]] for h in m["holders"]]
        print_table(rows, ["PEER", "NAME", "LAYERS", "BACKEND", "NUMERICS", "COMPAT"])
    return 0


def _coverage_bar(model: dict, width: int = 48) -> str:
    """One character per slice of layers: how many peers hold it (``.`` none, ``1``-``9``, ``+`` more)."""
    n = model["n_layers"]
    counts = [0] * n
    for h in model["holders"]:
        if h["start"] is not None:
            for layer in range(h["start"], h["end"]):
                counts[layer] += 1
    cells = min(width, n)
    marks = []
    for i in range(cells):
        lo, hi = i * n // cells, max(i * n // cells + 1, (i + 1) * n // cells)
        held = min(counts[lo:hi])
        marks.append("." if held == 0 else str(held) if held < 10 else "+")
    return f"layers 0..{n}: [{''.join(marks)}]"


def _cmd_sessions(args: argparse.Namespace) -> int:
    sessions = _listing(args, "sessions", "no live sessions on this peer")
    if sessions is None:
        return 0
    rows = [[s["session_id"][:16], s["role"], s["model"], str(s["tokens"]), f"{s['tok_s']:.2f}", str(s["hops"]),
             str(s["epoch"]), f"{s['age_s']:.1f}s"] for s in sessions]
    print_table(rows, ["SESSION", "ROLE", "MODEL", "TOKENS", "TOK/S", "HOPS", "EPOCH", "AGE"])
    return 0


def _cmd_logs(args: argparse.Namespace) -> int:
    query = urllib.parse.urlencode({"lines": args.lines, **({"session": args.session} if args.session else {})})
    records = control_get(args, f"/logs?{query}")["records"]
    if args.json:
        return _print_json(records)
    for r in records:
        ids = " ".join(f"{k}={r[k]}" for k in ("session", "route") if r.get(k))
        print(f"{r['time']} {r['level']:<7} {r['logger']}: {r['message']}" + (f" [{ids}]" if ids else ""))
    return 0


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {value}")
    return value


def parse_duration(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"1h"``, ``"7d"`` or plain seconds -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 1h, 7d)") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError("a duration is more than zero")
    return seconds


def _cmd_invite(args: argparse.Namespace) -> int:
    made = control_get(args, "/invite", {"expires_s": args.expires, "uses": args.uses})
    if args.json:
        return _print_json(made)
    expires = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(made["expires_at_ms"] / 1000))
    print(made["token"])
    print(f"mesh {made['mesh']}: admits {made['uses']} peer{'s' if made['uses'] > 1 else ''} until {expires}; "
          "join with `meshd join TOKEN` (or --invite TOKEN)", file=sys.stderr)
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    done = control_get(args, "/revoke", {"peer_id": args.peer, "reason": args.reason})
    if args.json:
        return _print_json(done)
    print(f"revoked {done['revoked']} from mesh {done['mesh']}; the revocation spreads by gossip")
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from openai import APIError, OpenAI

    status = control_get(args, "/status")
    api = status["api"]
    client = OpenAI(base_url=f"http://{api}/v1", api_key="meshd", timeout=args.timeout)
    model = args.model or (status.get("models_covered") or [None])[0]
    if model is None:
        print("meshctl: the mesh covers no model completely yet", file=sys.stderr)
        return 1
    started = time.monotonic()
    try:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": args.message}],
                                                stream=True, max_tokens=args.max_tokens,
                                                temperature=args.temperature)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
    except APIError as exc:  # refused (unknown model, bad parameter, no route) or failed on the way
        body = exc.body if isinstance(exc.body, dict) else {}
        code = getattr(exc, "status_code", None)
        print(f"meshctl: the API at {api} {'answered ' + str(code) if code else 'failed'}: "
              f"{body.get('message') or exc.message}", file=sys.stderr)
        return 1
    print(f"\n[{model} via {api}, {time.monotonic() - started:.2f}s]", file=sys.stderr)
    return 0


def _add_control(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control", default=os.environ.get("MESHD_CONTROL", DEFAULT_CONTROL), metavar="HOST:PORT",
                   help=f"the local daemon's control API (default {DEFAULT_CONTROL}, or $MESHD_CONTROL)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the daemon")


def _daemon_command(sub: argparse._SubParsersAction, name: str, text: str, func: Callable[..., int],
                    description: str | None = None) -> argparse.ArgumentParser:
    """A command that asks the daemon: --control, --timeout, and --json (its schema: schemas/NAME.json)."""
    p = sub.add_parser(name, help=text, description=description or text[0].upper() + text[1:] + ".")
    _add_control(p)
    p.add_argument("--json", action="store_true",
                   help=f"machine-readable output (JSON Schema: meshd/cli/schemas/{name}.json)")
    p.set_defaults(func=func)
    return p


def add_mesh_parsers(sub: argparse._SubParsersAction) -> None:
    _daemon_command(sub, "peers", "list the peers this daemon knows, with role, ranges, load and RTT", _cmd_peers)
    _daemon_command(sub, "status", "this daemon's identity, tracker, model and load", _cmd_status)
    route = _daemon_command(sub, "route", "the route the tracker would pick for a model, with its cost terms",
                            _cmd_route)
    route.add_argument("model", help="model id, as listed by /v1/models")
    _daemon_command(sub, "models", "the models the mesh serves: coverage per model, who holds which layers",
                    _cmd_models)
    _daemon_command(sub, "sessions", "live sessions this peer takes part in: model, tokens, tok/s, hops",
                    _cmd_sessions)
    logs = _daemon_command(sub, "logs", "this daemon's recent log records (with session and route ids)", _cmd_logs,
                           "The daemon keeps its last 2000 log records in memory; this prints them. --session "
                           "follows one request's records (on every peer of its route, ask each).")
    logs.add_argument("-n", "--lines", type=_at_least_one, default=100, help="how many records (default 100)")
    logs.add_argument("--session", metavar="ID", help="only records of this session (request) id")

    invite = sub.add_parser(
        "invite", help="make an invite token for a peer to join this private mesh",
        description="Ask the local daemon (it must hold the mesh's admission key: the peer that founded the "
        "mesh) for a signed invite. The token names this peer's address; a peer joins with `meshd join TOKEN` "
        "and receives a membership bound to its own identity. Print the token on stdout.")
    invite.add_argument("--expires", type=parse_duration, default=3600.0, metavar="DURATION",
                        help="how long the invite can be redeemed: 90s, 30m, 1h (default), 7d")
    invite.add_argument("--uses", type=int, default=1, help="how many peers may join with it (default 1)")
    invite.add_argument("--json", action="store_true", help="print the token and its terms as JSON")
    _add_control(invite)
    invite.set_defaults(func=_cmd_invite)
    revoke = sub.add_parser(
        "revoke", help="expel a member from this private mesh",
        description="Sign a revocation of PEER with the mesh's admission key (the local daemon must hold it) and "
        "spread it by gossip: every member drops the peer and refuses its requests, cards and seams from then on.")
    revoke.add_argument("peer", help="the peer id, or enough of its start to name one known peer")
    revoke.add_argument("--reason", default="", help="said in every member's log")
    revoke.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_control(revoke)
    revoke.set_defaults(func=_cmd_revoke)

    chat = sub.add_parser("chat", help="send one chat message through the local daemon's OpenAI API")
    chat.add_argument("message", help="what to say")
    chat.add_argument("--model", help="model id (default: the first the mesh covers)")
    chat.add_argument("--max-tokens", type=int, default=64, help="longest reply in tokens (default 64)")
    chat.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    _add_control(chat)
    chat.set_defaults(func=_cmd_chat)
