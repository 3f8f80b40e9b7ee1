"""One typed configuration for a peer, from a TOML file, then environment, then flags.

Every setting has a default that makes a single local peer work; an operator overrides what they
need. The object is built once at start-up and passed down; nothing reads settings from globals.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "ki": 1024, "kib": 1024, "m": 1e6, "mb": 1e6, "mi": 1024**2,
          "mib": 1024**2, "g": 1e9, "gb": 1e9, "gi": 1024**3, "gib": 1024**3, "t": 1e12, "tb": 1e12,
          "ti": 1024**4, "tib": 1024**4}


def parse_size(text: str | int) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1048576"`` -> bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GB, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_range(text: str | None) -> tuple[int, int] | None:
    """``"4:8"`` -> ``(4, 8)``, the half-open layer range ``[4, 8)``."""
    if text is None or text == "":
        return None
    try:
        start_s, end_s = str(text).split(":")
        start, end = int(start_s), int(end_s)
    except ValueError:
        raise ValueError(f"not a layer range: {text!r} (expected START:END, e.g. 4:8)") from None
    if not 0 <= start < end:
        raise ValueError(f"layer range {text!r} is empty or negative")
    return start, end


@dataclass
class PeerConfig:
    data_dir: Path = Path("meshd-data")
    name: str = ""
    listen: str = "127.0.0.1:7700"          # transport (HTTP/2 + TLS) listener
    advertise: str = ""                     # address others dial; defaults to `listen`
    api: str = "127.0.0.1:8000"             # OpenAI API
    control: str = "127.0.0.1:7701"         # meshctl control API (loopback only unless told)
    bootstrap: list[str] = field(default_factory=list)
    model: Path | None = None               # model directory this peer can serve
    model_id: str = ""                      # name clients use; defaults to the directory name
    layers: tuple[int, int] | None = None   # pinned range; otherwise the tracker places one
    memory_budget: int = 8 * 1024**3        # bytes of weights this peer may load
    kv_budget: int = 1024**3                # bytes of KV state across sessions
    chunk_tokens: int = 128                 # prefill chunk size
    tracker_eligible: bool = True
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 0.4
    suspect_timeout_s: float = 2.0
    pushpull_interval_s: float = 0.5
    lease_duration_s: float = 3.0
    card_ttl_s: float = 30.0
    step_timeout_s: float = 30.0
    log_level: str = "info"
    ready_file: Path | None = None          # written (JSON status) once every listener is up

    @property
    def advertised(self) -> str:
        return self.advertise or self.listen


_CONVERTERS: dict[str, Any] = {
    "data_dir": Path, "model": lambda v: Path(v) if v else None,
    "ready_file": lambda v: Path(v) if v else None, "layers": parse_range,
    "memory_budget": parse_size, "kv_budget": parse_size, "bootstrap": lambda v: list(v) if v else [],
}


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> PeerConfig:
    """Defaults, then the TOML file, then ``MESHD_*`` environment variables, then ``overrides``."""
    values: dict[str, Any] = {}
    if path is not None:
        with Path(path).open("rb") as f:
            values.update(tomllib.load(f))
    known = {f.name for f in fields(PeerConfig)}
    for name in known:
        env = os.environ.get(f"MESHD_{name.upper()}")
        if env is not None:
            values[name] = env.split(",") if name == "bootstrap" else env
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    config = PeerConfig()
    for name, value in values.items():
        default = getattr(config, name)
        convert = _CONVERTERS.get(name)
        if convert is not None:
            value = convert(value)
        elif isinstance(default, bool) and isinstance(value, str):
            value = value.lower() in ("1", "true", "yes", "on")
        elif isinstance(default, float):
            value = float(value)
        elif isinstance(default, int) and not isinstance(default, bool):
            value = int(value)
        setattr(config, name, value)
    return config
