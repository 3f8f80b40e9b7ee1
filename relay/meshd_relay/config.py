"""The relay's one typed configuration: defaults, then a TOML file, then ``MESHD_RELAY_*`` variables, then flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshd.address import Address
from meshd.logs import FORMATS, LEVELS
from meshd.settings import layered_settings, parse_size, setting, setting_list


@dataclass
class RelayConfig:
    """Every setting of a relay, with what it means (``meshctl service install --relay`` writes them
    into a commented TOML file; docs/configuration.md lists them)."""

    listen: str = setting("0.0.0.0:7800", "WebSocket listener peers and dialers connect to")
    metrics: str = setting("127.0.0.1:7801", "Prometheus /metrics listener; \"\" turns it off")
    max_peers: int = setting(1000, "registered peers at once")
    max_circuits_per_peer: int = setting(32, "open circuits to one registered peer")
    bandwidth_bytes_per_s: int = setting(8 * 1024**2, "bytes per second per registered peer, both directions "
                                         "together (e.g. \"8MiB\"); 0: no cap")
    bandwidth_burst_bytes: int = setting(4 * 1024**2, "bytes a peer may send at once above its rate (with a cap "
                                         "only)")
    bandwidth_max_delay_s: float = setting(2.0, "seconds traffic is slowed down at most before the circuit is cut "
                                           "(with a cap only)")
    idle_timeout_s: float = setting(300.0, "a circuit with no bytes either way for this many seconds is closed")
    handshake_timeout_s: float = setting(10.0, "seconds a registration has to complete")
    accept_timeout_s: float = setting(10.0, "seconds a registered peer has to pick up a circuit")
    max_message_bytes: int = setting(256 * 1024, "largest WebSocket message accepted from anyone")
    allow_peers: list[str] = setting_list("peer ids allowed to register; empty: anyone")
    mesh_key: str = setting("", "serve one private mesh: only its members may register (its admission key in hex, "
                            "as `meshctl status` shows it); empty: any peer")
    log_level: str = setting("info", "debug, info, warning or error")
    log_format: str = setting("json", "json (one object per line) or text")
    ready_file: Path | None = setting(None, "write the bound ports as JSON here once listening (for scripts)")

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
        if self.mesh_key and (len(self.mesh_key) != 64 or any(c not in "0123456789abcdef" for c in self.mesh_key)):
            raise ValueError("mesh_key is the 64 hex characters of a mesh's admission key (meshctl status)")
        if self.log_format not in FORMATS:
            raise ValueError(f"log_format is one of {', '.join(FORMATS)}, not {self.log_format!r}")
        if self.log_level not in LEVELS:
            raise ValueError(f"log_level is one of {', '.join(LEVELS)}, not {self.log_level!r}")


_CONVERTERS: dict[str, Any] = {
    "listen": lambda v: str(Address.parse(v)), "metrics": lambda v: str(Address.parse(v)) if v else "",
    "bandwidth_bytes_per_s": parse_size, "bandwidth_burst_bytes": parse_size, "max_message_bytes": parse_size,
    "ready_file": lambda v: Path(v) if v else None,
    "mesh_key": lambda v: str(v).strip().lower(),
    "allow_peers": lambda v: [p.strip() for p in (v.split(",") if isinstance(v, str) else v) if p.strip()],
}


CAP_SHAPE = ("bandwidth_burst_bytes", "bandwidth_max_delay_s")  # settings of a bandwidth cap, used only with one


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> RelayConfig:
    """The relay's configuration from every layer. A cap's burst or delay given while
    ``bandwidth_bytes_per_s`` is 0 (no cap) is refused: it would shape nothing."""
    given = layered_settings(RelayConfig, path, "MESHD_RELAY_", overrides, _CONVERTERS)
    config = RelayConfig(**given)
    shaping = [name for name in CAP_SHAPE if name in given]
    if shaping and not config.bandwidth_bytes_per_s:
        verb, them = ("shapes", "it") if len(shaping) == 1 else ("shape", "them")
        raise ValueError(f"{' and '.join(shaping)} {verb} a bandwidth cap, and bandwidth_bytes_per_s is 0 (no cap): "
                         f"set a cap, or leave {them} out")
    return config
