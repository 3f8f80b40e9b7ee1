"""The relay's Prometheus metrics, in a registry of its own (several relays can share a process in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class RelayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.registered_peers = Gauge("meshd_relay_registered_peers", "Peers registered now", registry=self.registry)
        self.open_circuits = Gauge("meshd_relay_open_circuits", "Circuits open now", registry=self.registry)
        self.registrations = Counter("meshd_relay_registrations", "Successful registrations",
                                     registry=self.registry)
        self.circuits = Counter("meshd_relay_circuits", "Circuits spliced", registry=self.registry)
        self.circuits_closed = Counter("meshd_relay_circuits_closed", "Circuits closed, by why", ["reason"],
                                       registry=self.registry)
        self.bytes_relayed = Counter("meshd_relay_bytes_relayed", "Bytes piped, by direction", ["direction"],
                                     registry=self.registry)
        self.rejections = Counter("meshd_relay_rejections", "Refused registrations, dials and circuits, by reason",
                                  ["reason"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (0 when absent); for tests and the CLI."""
        got = self.registry.get_sample_value(name, labels or None)
        return 0.0 if got is None else got
