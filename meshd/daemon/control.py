"""The local control API that ``meshctl`` talks to: JSON over HTTP, bound to loopback by default."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from meshd.admission import NotAdmitter
from meshd.daemon.status import models_table, peer_status, peers_table, route_as_json, sessions_table
from meshd.limits import parse_json
from meshd.stats import percentiles
from meshd.trace.parity import trace_parity_endpoint
from meshd.tracker.routing import NoRouteError

# the status page: the mesh at a glance, drawn in the browser from the JSON below (no build step)
STATUS_PAGE = Path(__file__).with_name("status_page.html")

if TYPE_CHECKING:
    from meshd.daemon.peer import Peer


def build_control_app(peer: Peer) -> Starlette:
    async def status(_request: Request) -> JSONResponse:
        return JSONResponse(peer_status(peer))

    async def peers(_request: Request) -> JSONResponse:
        return JSONResponse({"peers": peers_table(peer)})

    async def models(_request: Request) -> JSONResponse:
        return JSONResponse({"models": models_table(peer)})

    async def sessions(_request: Request) -> JSONResponse:
        return JSONResponse({"sessions": sessions_table(peer)})

    page_html = STATUS_PAGE.read_text()

    async def page(_request: Request) -> HTMLResponse:
        return HTMLResponse(page_html)

    async def events(_request: Request) -> JSONResponse:
        return JSONResponse({"events": list(peer.metrics.events)})

    async def logs(request: Request) -> JSONResponse:
        try:
            lines = min(int(request.query_params.get("lines", "100")), 10_000)
        except ValueError:
            return JSONResponse({"error": "lines is a number"}, status_code=400)
        session = request.query_params.get("session") or None
        return JSONResponse({"records": peer.recent_logs.latest(lines, session)})

    async def route(request: Request) -> JSONResponse:
        model = request.query_params.get("model", "")
        known = peer.control.view.known_models()
        if model not in known:
            return JSONResponse({"error": f"unknown model {model!r}", "models": sorted(known)}, status_code=404)
        try:
            planned = await peer.routes.route_for(model)
        except NoRouteError as exc:
            return JSONResponse({"error": str(exc), "missing": exc.missing}, status_code=503)
        return JSONResponse(route_as_json(planned.route, planned.source))

    async def stats(request: Request) -> JSONResponse:
        summary = peer.hops.stats.summary()
        repair_ms = peer.entry.repair_ms if peer.entry is not None else {}
        summary["repair_ms"] = {pos: percentiles(v) for pos, v in repair_ms.items()}
        if peer.served is not None:
            summary["batches"] = peer.served.host.batcher.stats.summary()
            shard = peer.served.host.shard
            if shard is not None:
                summary["prefix_kv"] = shard.kv.prefixes.summary()
        if peer.entry is not None:
            summary["speculation"] = peer.entry.draft_summary()
            summary["prefix_reuse"] = {**peer.entry.prefix_stats, "remembered": len(peer.entry.prefix_map)}
            summary["prefill_workers"] = peer.entry.worker_stats.summary()
        summary["kv_tier"] = {**peer.tier.stats, "lent": peer.tier_store.summary() if peer.tier_store else None}
        if request.query_params.get("reset"):
            peer.hops.stats.reset()
            repair_ms.clear()
            if peer.entry is not None:
                peer.entry.drafts.clear()
            if peer.served is not None:
                peer.served.host.batcher.stats.reset()
        return JSONResponse(summary)

    async def body_of(request: Request) -> dict:
        try:
            doc = parse_json(await request.body() or b"{}")
        except ValueError:
            raise ValueError("the body is not JSON this daemon can read") from None
        if not isinstance(doc, dict):
            raise ValueError("the body is a JSON object")
        return doc

    async def invite(request: Request) -> JSONResponse:
        try:
            doc = await body_of(request)
            expires_s, uses = float(doc.get("expires_s", 3600)), int(doc.get("uses", 1))
            token, expires_at_ms = peer.membership.issue_invite(expires_s, uses, peer.invite_addresses())
        except NotAdmitter as exc:
            return JSONResponse({"error": str(exc)}, status_code=403)
        except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: uses of 1e999
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"token": token, "mesh": peer.membership.mesh, "expires_at_ms": expires_at_ms,
                             "uses": uses})

    async def revoke(request: Request) -> JSONResponse:
        try:
            doc = await body_of(request)
            target = peer.known_peer(str(doc.get("peer_id", "")))
            signed = peer.membership.revoke(target, str(doc.get("reason", "")))
        except NotAdmitter as exc:
            return JSONResponse({"error": str(exc)}, status_code=403)
        except (TypeError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        peer.control.revoke(signed)
        return JSONResponse({"revoked": target, "mesh": peer.membership.mesh})

    async def replay(request: Request) -> JSONResponse:
        """One captured record re-run on a chosen route and compared (``meshctl replay``)."""
        try:
            doc = await body_of(request)
            if peer.replayer is None:
                return JSONResponse({"error": "this peer is still starting"}, status_code=503)
            record, body = doc.get("record"), doc.get("request")
            route, peers, exclude = doc.get("route") or "", doc.get("peers") or [], doc.get("exclude") or []
            if not isinstance(record, dict) or not (body is None or isinstance(body, dict)) \
                    or not isinstance(route, str) or not _strings(peers) or not _strings(exclude):
                raise ValueError("the body is {record: {...}, request?: {...}, route?: str, peers?: [str], "
                                 "exclude?: [str]}")
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse(await peer.replayer.replay(record, body, route, peers, exclude))

    async def replay_match(request: Request) -> JSONResponse:
        """Which re-supplied request bodies are the requests of which metadata records."""
        try:
            doc = await body_of(request)
            if peer.replayer is None:
                return JSONResponse({"error": "this peer is still starting"}, status_code=503)
            records, bodies = doc.get("records"), doc.get("requests")
            if not isinstance(records, list) or not isinstance(bodies, list):
                raise ValueError("the body is {records: [...], requests: [...]}")
            return JSONResponse(await peer.replayer.match(records, bodies))
        except (ValueError, OSError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)

    return Starlette(routes=[
        Route("/replay", replay, methods=["POST"]),
        Route("/replay/match", replay_match, methods=["POST"]),
        Route("/trace-parity", trace_parity_endpoint(peer), methods=["POST"]),
        Route("/invite", invite, methods=["POST"]),
        Route("/revoke", revoke, methods=["POST"]),
        Route("/stats", stats),
        Route("/status", status),
        Route("/peers", peers),
        Route("/route", route),
        Route("/models", models),
        Route("/sessions", sessions),
        Route("/logs", logs),
        Route("/events", events),
        Route("/", page),
    ])


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
