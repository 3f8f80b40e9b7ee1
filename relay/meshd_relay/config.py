"""The relay's one typed configuration: defaults, then a TOML file, then ``MESHD_RELAY_*`` variables, then flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.address import Address
from meshd.settings import layered_settings, parse_size


@dataclass
class RelayConfig:
    listen: str = "0.0.0.0:7800"              # WebSocket listener peers and dialers connect to
    metrics: str = "127.0.0.1:7801"           # Prometheus /metrics; "" turns it off
    max_peers: int = 1000                     # registered peers at once
    max_circuits_per_peer: int = 32           # open circuits to one registered peer
    bandwidth_bytes_per_s: int = 8 * 1024**2  # per registered peer, both directions together; 0 = no cap
    bandwidth_burst_bytes: int = 4 * 1024**2  # what a peer may send at once above its rate
    bandwidth_max_delay_s: float = 2.0        # traffic is slowed down this far, then the circuit is cut
    idle_timeout_s: float = 300.0             # a circuit with no bytes either way for this long is closed
    handshake_timeout_s: float = 10.0         # a registration must complete within this
    accept_timeout_s: float = 10.0            # a registered peer must pick up a circuit within this
    max_message_bytes: int = 256 * 1024       # largest WebSocket message accepted from anyone
    allow_peers: list[str] = field(default_factory=list)  # peer ids allowed to register; empty = anyone
    log_level: str = "info"
    log_format: str = "json"                  # "json" (one object per line) or "text"
    ready_file: Path | None = None            # written (JSON: ports) once listening, for scripts and tests

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.max_peers < 1 or self.max_circuits_per_peer < 1:
            raise ValueError("max_peers and max_circuits_per_peer must be at least 1")
        if self.bandwidth_bytes_per_s < 0 or self.bandwidth_burst_bytes < 0:
            raise ValueError("bandwidth settings cannot be negative")
        if self.bandwidth_bytes_per_s and self.bandwidth_burst_bytes < self.max_message_bytes:
            raise ValueError("bandwidth_burst_bytes must hold at least one message of max_message_bytes")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be at least 1024")
        if self.log_format not in ("json", "text"):
            raise ValueError("log_format is 'json' or 'text'")


_CONVERTERS: dict[str, Any] = {
    "listen": lambda v: str(Address.parse(v)), "metrics": lambda v: str(Address.parse(v)) if v else "",
    "bandwidth_bytes_per_s": parse_size, "bandwidth_burst_bytes": parse_size, "max_message_bytes": parse_size,
    "ready_file": lambda v: Path(v) if v else None,
    "allow_peers": lambda v: [p.strip() for p in (v.split(",") if isinstance(v, str) else v) if p.strip()],
}


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> RelayConfig:
    return RelayConfig(**layered_settings(RelayConfig, path, "MESHD_RELAY_", overrides, _CONVERTERS))
