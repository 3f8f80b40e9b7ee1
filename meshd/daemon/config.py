"""One typed configuration for a peer, from a TOML file, then environment, then flags.

Every setting has a default that makes a single local peer work; an operator overrides what they
need. The object is built once at start-up and passed down; nothing reads settings from globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.address import Address
from meshd.settings import layered_settings, parse_size


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
    model: Path | None = None               # model this peer can serve: a Hugging Face directory or a GGUF file
    model_id: str = ""                      # name clients use; defaults to the directory (or file) name
    backend: str = "auto"                   # what computes the layers: auto (llama.cpp for GGUF when
                                            # installed, else torch), torch or llama.cpp
    layers: tuple[int, int] | None = None   # pinned range; otherwise the tracker places one
    dtype: str = "auto"                     # weights, activations, seam: auto (the checkpoint's), float32,
                                            # bfloat16 or float16
    device: str = "auto"                    # auto (cuda:0, else mps, else cpu), cpu, cuda[:N] or mps
    memory_budget: int = 8 * 1024**3        # bytes of weights this peer may load
    kv_budget: int = 1024**3                # bytes of KV state across sessions
    chunk_tokens: int = 512                 # prefill chunk size (tokens per bundle; see docs/benchmarks.md)
    torch_threads: int = 0                  # compute threads (torch intra-op); 0: every CPU we may use
    compression: str = "auto"               # large prefill bundles: "auto" (where measured to pay), "off", "always"
    tracker_eligible: bool = True
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 0.4
    suspect_timeout_s: float = 2.0
    pushpull_interval_s: float = 0.5
    lease_duration_s: float = 3.0
    card_ttl_s: float = 30.0
    step_timeout_s: float = 30.0            # a hop that sends nothing for this long has failed
    request_timeout_s: float = 600.0        # a whole request's deadline
    repair_attempts: int = 5                # routes tried for one generation before giving up
    repair_budget_s: float = 60.0           # time spent repairing one generation before giving up
    max_sessions: int = 64                  # sessions this peer's shard admits at once
    max_queue: int = 32                     # steps waiting for compute before new sessions are refused
    batch_hold: float = 1.0                 # hold a decode batch for sessions due within this many
                                            # one-session steps (0: never); see meshd/runtime/batching.py
    drain_timeout_s: float = 30.0           # on SIGTERM: how long running sessions may take to finish
    relays: list[str] = field(default_factory=list)  # meshd-relay servers ("host:port") to register with
    reachability: str = "auto"              # "auto" (dial-back test), "direct" or "relayed"
    reachability_interval_s: float = 30.0   # how often "auto" re-checks that others can dial us
    log_level: str = "info"
    ready_file: Path | None = None          # written (JSON status) once every listener is up

    @property
    def advertised(self) -> str:
        return self.advertise or self.listen


def _address(value: str) -> str:
    return str(Address.parse(value)) if value else ""


def _addresses(values: list[str] | None) -> list[str]:
    return [_address(v) for v in values or []]


def _device(value: str) -> str:
    kind, _, index = str(value).partition(":")
    if kind not in ("auto", "cpu", "cuda", "mps") or (index and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"device {value!r} is not one of auto, cpu, cuda, cuda:N, mps")
    return str(value)


_CONVERTERS: dict[str, Any] = {
    "listen": _address, "advertise": _address, "api": _address, "control": _address,
    "data_dir": Path, "model": lambda v: Path(v) if v else None,
    "ready_file": lambda v: Path(v) if v else None, "layers": parse_range,
    "memory_budget": parse_size, "kv_budget": parse_size, "bootstrap": _addresses,
    "relays": _addresses, "reachability": lambda v: _choice(v, ("auto", "direct", "relayed")),
    "compression": lambda v: _choice(v, ("auto", "off", "always")),
    "dtype": lambda v: _choice(v, ("auto", "float32", "bfloat16", "float16")),
    "backend": lambda v: _choice(v, ("auto", "torch", "llama.cpp")),
    "device": _device,
}


def _choice(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
    return value


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> PeerConfig:
    """Defaults, then the TOML file, then ``MESHD_*`` environment variables, then ``overrides``."""
    return PeerConfig(**layered_settings(PeerConfig, path, "MESHD_", overrides, _CONVERTERS,
                                         list_fields=("bootstrap", "relays")))
