"""The peer's metrics: levels read at scrape time, events counted, served over HTTP by the shared app."""

from __future__ import annotations

import httpx2 as httpx
import trio

from meshd.api.openai_server import serve_asgi
from meshd.metrics import Levels, PeerMetrics, metrics_app


def test_levels_are_read_at_every_scrape() -> None:
    metrics = PeerMetrics()
    now = Levels(hop_sessions=2, kv_bytes=4096, kv_budget_bytes=1 << 30, members={"alive": 3, "suspect": 1},
                 links={"direct": 2, "relay": 1}, decode_batches={1: 5, 4: 2}, is_tracker=True, election_term=7)
    metrics.watch(lambda: now)
    assert metrics.value("meshd_hop_sessions") == 2
    assert metrics.value("meshd_members", state="suspect") == 1
    assert metrics.value("meshd_links", route="relay") == 1
    assert metrics.value("meshd_decode_batches_total", size="4") == 2
    assert metrics.value("meshd_is_tracker") == 1 and metrics.value("meshd_election_term") == 7
    now.hop_sessions = 0
    assert metrics.value("meshd_hop_sessions") == 0


async def test_the_endpoint_serves_the_registry_over_http() -> None:
    metrics = PeerMetrics()
    metrics.repairs.labels("STEP_TIMEOUT").inc()
    metrics.seam.labels("hop").observe(0.0004)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_asgi, metrics_app(metrics.registry), "127.0.0.1:0", "test.metrics")
        async with httpx.AsyncClient() as http:
            reply = await http.get(f"http://127.0.0.1:{port}/metrics")
        nursery.cancel_scope.cancel()
    assert reply.status_code == 200
    assert 'meshd_repairs_total{cause="STEP_TIMEOUT"} 1.0' in reply.text
    assert 'meshd_seam_latency_seconds_bucket{le="0.0005",source="hop"} 1.0' in reply.text
