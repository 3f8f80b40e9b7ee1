"""The local control API that ``meshctl`` talks to: JSON over HTTP, bound to loopback by default."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from meshd.stats import percentiles
from meshd.tracker.routing import NoRouteError


def build_control_app(peer) -> Starlette:
    async def status(_request: Request) -> JSONResponse:
        return JSONResponse(peer.status())

    async def peers(_request: Request) -> JSONResponse:
        return JSONResponse({"peers": peer.peers_table()})

    async def route(request: Request) -> JSONResponse:
        model = request.query_params.get("model", "")
        if model not in peer.known_models():
            return JSONResponse({"error": f"unknown model {model!r}", "models": sorted(peer.known_models())},
                                status_code=404)
        try:
            chosen, _addresses, source = await peer.route_for(model)
        except NoRouteError as exc:
            return JSONResponse({"error": str(exc), "missing": exc.missing}, status_code=503)
        return JSONResponse({
            "model": chosen.model_id, "compat_key": chosen.compat_key, "epoch": chosen.epoch,
            "cost_ms": chosen.cost_ms, "planned_by": source,
            "hops": [dict(t) for t in chosen.terms],
        })

    async def stats(request: Request) -> JSONResponse:
        summary = peer.hops.stats.summary()
        summary["repair_ms"] = {pos: percentiles(v) for pos, v in peer.repair_ms.items()}
        if peer.host is not None:
            summary["batches"] = peer.host.batcher.stats.summary()
        if request.query_params.get("reset"):
            peer.hops.stats.reset()
            peer.repair_ms.clear()
            if peer.host is not None:
                peer.host.batcher.stats.reset()
        return JSONResponse(summary)

    return Starlette(routes=[
        Route("/stats", stats),
        Route("/status", status),
        Route("/peers", peers),
        Route("/route", route),
    ])
