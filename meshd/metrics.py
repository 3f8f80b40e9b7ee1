"""A peer's Prometheus metrics, and the ASGI app that serves a registry (the peer's and the relay's).

Events (tokens, requests, seam crossings, repairs, gossip, tracker changes) are counted where they
happen; levels (sessions, KV bytes, queue depth, cards, term, links) are read from the peer when a
scrape asks, through :meth:`PeerMetrics.watch`, so they are never stale and cost nothing between scrapes.
Each peer has a registry of its own: several peers can share a process in tests.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# seconds; a seam crossing is sub-millisecond on loopback and tens of ms over a WAN
SEAM_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
RECENT_EVENTS = 100
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 30.0)


@dataclass
class Levels:
    """What a peer is holding right now, read at scrape time."""

    hop_sessions: int = 0
    entry_sessions: int = 0
    queued_steps: int = 0
    kv_bytes: int = 0
    kv_budget_bytes: int = 0
    decode_tok_s: float = 0.0
    cards: int = 0
    members: dict[str, int] = field(default_factory=dict)   # by state
    election_term: int = 0
    is_tracker: bool = False
    links: dict[str, int] = field(default_factory=dict)     # live outbound connections, by "direct" / "relay"
    relays_registered: int = 0
    decode_batches: dict[int, int] = field(default_factory=dict)  # by size, since the shard loaded
    rejected_cards: dict[str, int] = field(default_factory=dict)  # by reason, since start
    transport_refusals: dict[str, int] = field(default_factory=dict)  # connections and streams, by reason


class PeerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("meshd_requests", "API generations this peer was the entry of, by model and outcome",
                                ["model", "outcome"], registry=r)
        self.tokens = Counter("meshd_tokens_generated", "Tokens streamed to API clients, by model", ["model"],
                              registry=r)
        self.ttft = Histogram("meshd_time_to_first_token_seconds", "From a request's start to its first token",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.seam = Histogram("meshd_seam_latency_seconds", "A decode bundle's crossing into this hop, from the "
                              "sender starting to encode it to this hop having decoded it, by sender",
                              ["source"], buckets=SEAM_BUCKETS, registry=r)
        self.refusals = Counter("meshd_session_refusals", "Sessions this hop refused, by error code", ["code"],
                                registry=r)
        self.repairs = Counter("meshd_repairs", "Route failures the entry repaired or tried to, by cause", ["cause"],
                               registry=r)
        self.peer_refusals = Counter("meshd_peer_refusals", "Peer requests and streams refused, by kind and error "
                                     "code (rate_limited, not_member ...)", ["kind", "code"], registry=r)
        self.gossip = Counter("meshd_gossip_messages", "Gossip messages, by direction", ["direction"], registry=r)
        self.tracker_changes = Counter("meshd_tracker_changes", "Times this peer saw the tracker change", registry=r)
        self.speed_checks = Counter("meshd_speed_checks", "Speed checks of peers' card claims, by verdict (met, "
                                    "demoted, unanswered)", ["verdict"], registry=r)
        self.events: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)  # for the status page

    def event(self, kind: str, **fields: Any) -> None:
        """Remember a notable event (a repair, a refusal) for the status page, newest last."""
        self.events.append({"time": round(time.time(), 3), "kind": kind, **fields})

    def watch(self, read: Callable[[], Levels]) -> None:
        """Report the levels ``read`` returns at every scrape."""
        self.registry.register(_LevelsCollector(read))

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (0 when absent); for tests."""
        got = self.registry.get_sample_value(name, labels or None)
        return 0.0 if got is None else got


class _LevelsCollector(Collector):
    def __init__(self, read: Callable[[], Levels]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        now = self.read()
        yield _gauge("meshd_hop_sessions", "Sessions whose KV this peer's shard holds", now.hop_sessions)
        yield _gauge("meshd_entry_sessions", "Generations running with this peer as the entry", now.entry_sessions)
        yield _gauge("meshd_compute_queue_depth", "Steps waiting for this peer's compute", now.queued_steps)
        yield _gauge("meshd_kv_bytes", "KV bytes held across sessions", now.kv_bytes)
        yield _gauge("meshd_kv_budget_bytes", "KV bytes this peer may hold (--kv-budget)", now.kv_budget_bytes)
        yield _gauge("meshd_decode_tokens_per_second", "This peer's measured decode speed for its range",
                     now.decode_tok_s)
        yield _gauge("meshd_live_cards", "Capability cards this peer holds", now.cards)
        yield _gauge("meshd_election_term", "The tracker lease's term", now.election_term)
        yield _gauge("meshd_is_tracker", "1 while this peer holds the tracker role", int(now.is_tracker))
        yield _gauge("meshd_relays_registered", "meshd-relays this peer is registered with", now.relays_registered)
        yield _labelled(GaugeMetricFamily("meshd_members", "Peers gossip knows, by state", labels=["state"]),
                        now.members.items())
        yield _labelled(GaugeMetricFamily("meshd_links", "Live outbound peer connections, by route",
                                          labels=["route"]), now.links.items())
        batches = CounterMetricFamily("meshd_decode_batches", "Decode batches this peer computed, by size "
                                      "(since its range loaded)", labels=["size"])
        for size, count in sorted(now.decode_batches.items()):
            batches.add_metric([str(size)], count)
        yield batches
        yield _counted("meshd_cards_rejected", "Capability cards refused, by reason (bad_signature, replayed, "
                       "store_full, not_member ...)", "reason", now.rejected_cards)
        yield _counted("meshd_transport_refusals", "Inbound connections and streams the transport refused, by "
                       "reason (handshake_timeout, handshakes_full, buffer_full ...)", "reason", now.transport_refusals)


def _counted(name: str, text: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=[label])
    for key, count in sorted(values.items()):
        family.add_metric([key], count)
    return family


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


def _labelled(family: GaugeMetricFamily, values: Iterable[tuple[str, int]]) -> GaugeMetricFamily:
    for label, value in sorted(values):
        family.add_metric([label], value)
    return family


def metrics_app(registry: CollectorRegistry) -> Callable:
    """An ASGI app answering ``GET /metrics`` (any path) from ``registry``.

    prometheus-client's app answers only HTTP; the server's lifespan events are acknowledged here.
    """
    app = make_asgi_app(registry)

    async def wrapped(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    return wrapped
