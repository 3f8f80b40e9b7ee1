"""What ``meshctl status``, ``peers``, ``models``, ``route`` and ``sessions`` show, as JSON."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from meshd import __version__
from meshd.gossip import MemberState
from meshd.tracker.view import Route, relayed_through

if TYPE_CHECKING:
    from meshd.daemon.peer import Peer


def peer_status(peer: Peer) -> dict[str, Any]:
    now = time.time()
    control = peer.control
    tracker = control.election.tracker(now)
    served = peer.served
    host = served.host if served is not None else None
    return {
        "peer_id": peer.peer_id, "name": peer.config.name or peer.peer_id[:8], "version": __version__,
        "listen": peer.bound.advertise, "api": peer.bound.api, "control": peer.bound.control,
        "metrics": peer.bound.metrics or None,
        "tracker": tracker, "tracker_term": control.election.term(now), "is_tracker": tracker == peer.peer_id,
        "lease_duration_s": peer.config.lease_duration_s, "takeover_bound_s": control.takeover_bound_s(),
        "model": served.info.model_id if served else None,
        "compat_key": served.info.compat_key if served else None,
        "range": list(served.range) if served and served.range else None,
        "active_sessions": host.active_sessions if host else 0,
        "decode_tok_s": round(served.decode_tok_s, 2) if served else 0.0,
        "device": served.info.numerics.device if served else None,
        "dtype": served.info.numerics.dtype_setting if served else None,
        "numerics": served.info.numerics.name if served else None,
        "backend": served.info.numerics.backend if served else None,
        "numerics_measured_ms": served.measured_ms if served else {},
        "numerics_from": (served.class_from or None) if served else None,
        "shard_error": (served.error or None) if served else (peer.model_error or None),
        "shard_checks": [c.__dict__ for c in served.checks] if served else [],
        "weights_fetch": peer.joining.status() if peer.joining is not None else None,
        "members": {p: s.name for p, s in control.gossip.members().items()},
        "models_covered": control.view.covered_models(),
        "rejected_cards": {str(k): v for k, v in control.gossip.rejected_cards.items()},
        "rate_limited_requests": dict(peer.rpc.rate_limited),
        "admission": peer.membership.describe(),
        "transport_refusals": dict(peer.transport.refusals),
        "speed_checks": {"pending": peer.speed.pending},
        "audits": {"rate": peer.config.audit_rate, "outcomes": dict(peer.audits.audits),
                   "excluded": sorted(peer.audits.excluded()), "running": peer.auditor.running if peer.auditor else 0},
        "capture": {**peer.capture.status(),
                    "replays": peer.replayer.status() if peer.replayer is not None else None},
        "uptime_s": round(now - control.started_at, 1),
        "reachability": peer.reachability.status(),
        "link_shape": link.spec if (link := peer.transport.config.link_shape) else None,
    }


def peers_table(peer: Peer) -> list[dict[str, Any]]:
    now = time.time()
    control = peer.control
    view = control.view
    tracker = control.election.tracker(now)
    members = control.gossip.members()
    demoted = peer.speed.demoted() | view.demoted()
    rows = []
    for peer_id, card in sorted(view.cards().items()):
        rows.append({
            "peer_id": peer_id, "self": peer_id == peer.peer_id, "name": card.name,
            "addresses": list(card.addresses), "relays": list(card.relay_addresses), "api": card.api_address,
            "relayed_via": relayed_through(card), "link": peer.transport.connection_route(peer_id),
            "tracker": peer_id == tracker,
            "state": "self" if peer_id == peer.peer_id else members.get(peer_id, MemberState.ALIVE).name,
            "models": [{"model_id": m.model_id, "start": m.range_start, "end": m.range_end,
                        "n_layers": m.n_layers, "compat_key": m.compat_key, "numerics": m.numerics,
                        "backend": m.backend or "torch", "quantization": m.quantization or None,
                        "decode_tok_s": round(m.decode_tok_s, 2), "shard_error": m.shard_error or None}
                       for m in card.models],
            "device": card.hardware.device, "device_memory_bytes": card.hardware.device_memory_bytes,
            "active_sessions": card.load.active_sessions, "queued": card.load.queued,
            "rtt_ms": None if peer_id == peer.peer_id else view.meter.rtt_ms(peer_id),
            "last_seen_s": None if (seen := view.last_seen(peer_id)) is None else round(now - seen, 2),
            "card_age_s": round(now - card.issued_at_ms / 1000, 2), "sequence": card.sequence,
            "audit": peer.audits.of(peer_id), "demoted": demoted.get(peer_id), "speed": peer.speed.of(peer_id),
        })
    return rows


def route_as_json(route: Route, planned_by: str) -> dict[str, Any]:
    """A planned route with its cost terms (schema: meshd/cli/schemas/route.json)."""
    return {
        "model": route.model_id, "compat_key": route.compat_key, "epoch": route.epoch, "cost_ms": route.cost_ms,
        "planned_by": planned_by, "entry": route.entry, "hops": [asdict(t) for t in route.terms],
        "back": None if route.back is None else asdict(route.back),
    }


def models_table(peer: Peer) -> list[dict[str, Any]]:
    """Every model the mesh offers: who holds which layers, and whether a complete route exists."""
    from meshd.tracker.routing import NoRouteError, plan_route

    view = peer.control.view
    cards = view.cards()
    offers = view.offers()
    rows = []
    for model_id in sorted({o.model_id for o in offers}):
        mine = [o for o in offers if o.model_id == model_id]
        n_layers = max(o.n_layers for o in mine)
        try:
            plan_route(model_id, offers, view.links())
            missing: list[list[int]] = []
        except NoRouteError as exc:
            missing = [list(r) for r in exc.missing]
        holders = []
        for o in sorted(mine, key=lambda o: (o.range or (n_layers, n_layers), o.peer_id)):
            served = next((m for m in cards[o.peer_id].models if m.model_id == model_id), None)
            holders.append({"peer_id": o.peer_id, "name": cards[o.peer_id].name or o.peer_id[:8],
                            "start": o.range[0] if o.range else None, "end": o.range[1] if o.range else None,
                            "compat_key": o.compat_key,
                            "backend": (served.backend or "torch") if served else None,
                            "numerics": served.numerics if served else None})
        rows.append({"model": model_id, "n_layers": n_layers, "covered": not missing, "missing": missing,
                     "compat_keys": sorted({o.compat_key for o in mine}), "holders": holders})
    return rows


def sessions_table(peer: Peer) -> list[dict[str, Any]]:
    """The live sessions this peer takes part in: as the entry, and as a hop of a route."""
    now = time.monotonic()
    rows = [g.as_json(now) for g in (peer.entry.live.values() if peer.entry is not None else [])]
    rows += [h.as_json(now) for h in peer.hops.live.values()]
    return rows
