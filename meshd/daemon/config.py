"""One typed configuration for a peer, from a TOML file, then environment, then flags.

Every setting has a default that makes a single local peer work; an operator overrides what they
need. The object is built once at start-up and passed down; nothing reads settings from globals.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from meshd.address import Address
from meshd.capture.records import CAPTURE_MODES
from meshd.election.lease import MAX_LEASE_MS
from meshd.links.profiles import parse_link_shape
from meshd.logs import FORMATS, LEVELS
from meshd.session import SPECULATIVE_MODES
from meshd.settings import layered_settings, parse_size, setting, setting_list
from meshd.wire.limits import MAX_DRAFT_TOKENS

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "int8")  # --dtype; int8: meshd.runtime.int8


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
    """Every setting of a peer, with what it means: ``meshd init`` writes them all into a commented
    TOML file and docs/configuration.md lists them, both generated from these fields."""

    data_dir: Path = setting(Path("meshd-data"), "identity key and state of this peer")
    name: str = setting("", "a label for this peer in meshctl peers (default: the start of its peer id)")
    listen: str = setting("127.0.0.1:7700", "peer transport listener (HTTP/2 over TLS); other peers dial this")
    advertise: str = setting("", "the address other peers should dial, when it differs from listen")
    api: str = setting("127.0.0.1:8000", "OpenAI API listener")
    control: str = setting("127.0.0.1:7701", "meshctl's control API listener; keep it on loopback")
    metrics: str = setting("127.0.0.1:7702", "Prometheus /metrics listener (loopback unless told); \"\" turns it off")
    bootstrap: list[str] = setting_list("peers to join through (HOST:PORT each)")
    invite: str = setting("", "an invite token (from `meshctl invite` on a member) to join a private mesh with; "
                          "redeemed once, the membership is kept in the data directory")
    open_mesh: bool = setting(False, "take part in an open mesh: admit any peer that can reach this one, and show "
                              "no membership (not with an invite; default: a private mesh; a peer with neither "
                              "bootstrap nor invite founds one)")
    model: Path | None = setting(None, "the model this peer can serve: a Hugging Face directory or a GGUF file")
    model_id: str = setting("", "the model's name in the API (default: the directory's name, or the GGUF file's); "
                            "without model: serve this model by fetching the layers placed here from peers that "
                            "serve it")
    backend: str = setting("auto", "what computes the layers: auto (llama.cpp for a GGUF file when installed, else "
                           "torch), torch or llama.cpp")
    layers: tuple[int, int] | None = setting(None, "pin this half-open layer range (\"START:END\") instead of "
                                             "letting the tracker place one (with model, or model_id)")
    dtype: str = setting("auto", "dtype of weights, activations and the seam: auto (the checkpoint's), float32, "
                         "bfloat16, float16, or int8 (on the CPU, torch backend: the linears' weights int8 with a "
                         "scale per output channel, activations, KV and the seam float32). With model only, as are "
                         "backend and numerics: a peer fetching model_id computes as the peers it fetches from")
    numerics: str = setting("", "pin the numerics class (as meshctl status shows it, e.g. "
                            "cpu/float32/prefill-native/decode-native-rows1) instead of measuring the fastest here: "
                            "peers in different classes never share a route, and measurements vary from peer to peer "
                            "(a measured class gives way, in a peer's first two minutes, to the class of the peer "
                            "that has served the model longest, when this peer computes that class alike)")
    device: str = setting("auto", "auto (cuda:0, else mps, else cpu), cpu, cuda, cuda:N or mps")
    memory_budget: int = setting(8 * 1024**3, "bytes of weights this peer may load (e.g. \"6GiB\")")
    kv_budget: int = setting(1024**3, "bytes of KV state across sessions (e.g. \"1GiB\")")
    prefix_kv: int = setting(256 * 1024**2, "bytes of KV this peer keeps of prompt prefixes (the end of a chat's "
                             "first and last message), that later prompts starting with them reuse instead of "
                             "prefilling again; inside kv_budget, giving way to running sessions; 0 keeps none")
    kv_tier: int = setting(0, "bytes of memory this peer lends to the KV tier: hops publish the prefix KV they keep "
                           "there, and a hop that lost a prefix imports it instead of prefilling again (e.g. "
                           "\"4GiB\"); 0: lends none. A tier peer needs no model")
    prefix_reuse: bool = setting(True, "as the entry, start a prompt after the longest prefix of it that the route's "
                                 "hops kept of an earlier one (and favour routes through those hops); replies are "
                                 "the same either way")
    prefill_only: bool = setting(False, "serve the pinned range (--layers) only as a prefill worker: entries may "
                                 "have it prefill long prompts for routes through other peers, but no route "
                                 "decodes through it (a machine with compute to spare and a slow link)")
    prefill_workers: int = setting(1024, "as the entry, a prompt of this many tokens or more whose route runs other "
                                   "sessions may have its prefill computed by idle peers serving the same layers, "
                                   "whose KV the route's hops import before the first token (when the cost model "
                                   "says that is faster; replies are the same either way); 0: never")
    chunk_tokens: int = setting(512, "prefill chunk size in tokens (see docs/benchmarks.md)")
    torch_threads: int = setting(0, "threads for model compute; 0: every CPU this process may use")
    compression: str = setting("auto", "zstd for large prefill bundles: auto (per link, where measured to pay), "
                               "off or always")
    link_shape: str = setting("", "for testing and benchmarks: delay this peer's outgoing peer-to-peer traffic (every "
                              "connection to another peer, dialled or accepted; not the API) as if it crossed a link "
                              "of this shape: lan, wifi, wan or DELAY[±JITTER]/RATE, e.g. 10ms/100Mbit "
                              "(docs/benchmarks.md); \"\": not shaped")
    tracker_eligible: bool = setting(True, "whether this peer may take the tracker role")
    probe_interval_s: float = setting(0.5, "seconds between gossip probes of a random peer")
    probe_timeout_s: float = setting(0.4, "seconds a probe waits for its answer")
    suspect_timeout_s: float = setting(2.0, "seconds a suspected peer has to refute before it is declared dead")
    pushpull_interval_s: float = setting(0.5, "seconds between full card exchanges with a random peer")
    lease_duration_s: float = setting(3.0, "seconds a tracker lease lasts unless renewed (at most 600)")
    card_ttl_s: float = setting(30.0, "seconds a capability card lives unless its peer re-issues it")
    card_budget: int = setting(2048, "bytes per second of capability cards from the whole mesh, which is what each "
                               "peer receives: in a large mesh a peer re-issues its card only every peers x card "
                               "size / card_budget seconds (load shown in cards ages accordingly), e.g. \"2KiB\"")
    speculative: str = setting("auto", "speculative decoding as the entry of a request: each step also sends tokens "
                               "guessed ahead, which the route verifies in the same traversal (replies stay exactly "
                               "the same): auto (draft_model when it shares the model's tokenizer, else n-gram "
                               "lookup over prompt and reply), ngram, model or off")
    draft_model: Path | None = setting(None, "a small model directory with the served model's tokenizer, run on this "
                                       "peer to guess tokens ahead with speculative auto or model")
    max_draft_tokens: int = setting(8, "most tokens one step guesses ahead (how many is measured per session, up to "
                                    "this; at most 15)")
    step_timeout_s: float = setting(30.0, "a hop that sends nothing for this many seconds has failed")
    request_timeout_s: float = setting(600.0, "a whole request's deadline in seconds")
    repair_attempts: int = setting(5, "routes tried for one generation before giving up")
    repair_budget_s: float = setting(60.0, "seconds spent repairing one generation before giving up")
    max_sessions: int = setting(64, "sessions this peer's shard admits at once")
    max_queue: int = setting(32, "steps waiting for compute before new sessions are refused")
    session_opens_per_s: float = setting(50.0, "sessions one peer may open on this one per second, in bursts of "
                                         "max_sessions (0: no limit)")
    batch_hold: float = setting(1.0, "hold a decode batch for sessions about to arrive while waiting costs less "
                                "than this many times what running them apart would (the hop's measured step "
                                "costs say; hops on a machine of their own wait at most this many one-session "
                                "steps; 0: never)")
    cpu_turn: bool = setting(True, "take turns computing with the other meshd peers computing on this machine's "
                             "CPUs (one lock file per machine), instead of competing for its cores")
    batch_latency_ms: float = setting(0.0, "largest decode step a batch may grow to, by this hop's measured step "
                                      "costs (0: no bound beyond max_batch sessions)")
    audit_rate: float = setting(0.02, "share of the requests this peer is the entry of after which a hop of the "
                                "route is audited: a short greedy replay of a synthetic prompt on three routes that "
                                "differ in that hop (0: never; accusations heard are checked all the same)")
    audit_tokens: int = setting(8, "tokens each audit replay generates")
    capture: str = setting("off", "record the requests this peer answers as the entry, for `meshctl replay`: off, "
                           "metadata (model, compat key, numerics class, route, sampling and the seed used, token "
                           "counts, timings, and keyed hashes of prompt and reply: no text, no token ids) or full "
                           "(also the request body and the reply's tokens and text, credential fields redacted; "
                           "keeps people's prompts on disk); in data_dir/capture, files mode 0600 "
                           "(docs/operations.md). The capture_max_* bounds apply with capture off too, to records "
                           "kept from before")
    capture_max_records: int = setting(10_000, "most capture records kept; the oldest go first")
    capture_max_bytes: int = setting(64 * 1024**2, "most bytes of capture records kept (e.g. \"64MiB\"); the oldest "
                                     "go first")
    capture_max_age_s: float = setting(7 * 86400.0, "seconds a capture record is kept at most (e.g. \"7d\" in the "
                                       "environment or with --capture-max-age)")
    drain_timeout_s: float = setting(30.0, "on SIGTERM: seconds running sessions may take to finish")
    relays: list[str] = setting_list("meshd-relays (HOST:PORT each) to register with when not directly dialable "
                                     "(reachability auto or relayed)")
    reachability: str = setting("auto", "auto (let other peers test whether we can be dialled), direct (always "
                                "advertise the direct address) or relayed (only relay addresses)")
    reachability_interval_s: float = setting(30.0, "seconds between auto's re-checks that others can dial us")
    log_level: str = setting("info", "debug, info, warning or error")
    log_format: str = setting("text", "text (lines for people) or json (one object per line with the peer, "
                              "session and route ids)")
    ready_file: Path | None = setting(None, "write this peer's status as JSON here once it listens (for scripts)")

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative is one of {', '.join(SPECULATIVE_MODES)}, not {self.speculative!r}")
        if not 0 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"max_draft_tokens is between 0 and {MAX_DRAFT_TOKENS}, not {self.max_draft_tokens}")
        if self.speculative == "model" and self.draft_model is None:
            raise ValueError("speculative = model needs draft_model")
        if self.draft_model is not None and self.speculative in ("off", "ngram"):
            raise ValueError(f"draft_model is for speculative = auto or model; with {self.speculative} it goes unused")
        if self.open_mesh and self.invite:
            raise ValueError("an invite joins a private mesh and open_mesh takes part in an open one: give one of them")
        if self.relays and self.reachability == "direct":
            raise ValueError("relays are registered with under reachability auto or relayed; direct never uses them")
        if not 0 <= self.audit_rate <= 1:
            raise ValueError(f"audit_rate is a share between 0 and 1, not {self.audit_rate}")
        if self.capture not in CAPTURE_MODES:
            raise ValueError(f"capture is one of {', '.join(CAPTURE_MODES)}, not {self.capture!r}")
        if self.prefill_only and (self.layers is None or (self.model is None and not self.model_id)):
            raise ValueError("prefill_only needs a model and a pinned range (--layers): a prefill worker is not placed")
        if self.model is None:
            self._refuse_model_settings()
        if self.lease_duration_s > MAX_LEASE_MS / 1000:
            raise ValueError(f"lease_duration_s is at most {MAX_LEASE_MS // 1000} seconds: peers refuse longer leases, "
                             f"not {self.lease_duration_s}")
        for name in ("chunk_tokens", "max_sessions", "max_queue", "repair_attempts", "audit_tokens", "card_budget",
                     "capture_max_records", "capture_max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        for name in ("memory_budget", "kv_budget", "prefix_kv", "kv_tier", "prefill_workers", "torch_threads",
                     "batch_hold", "batch_latency_ms", "session_opens_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} cannot be negative ({getattr(self, name)})")
        for f in fields(self):
            if f.name.endswith("_s") and getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name} must be a positive number of seconds, not {getattr(self, f.name)}")

    def _refuse_model_settings(self) -> None:
        """Without ``model``, the settings of how a model given here is computed would go unused: a peer
        with no model serves none, and one fetching ``model_id`` computes as the peers it fetches from."""
        given = [name for name, unset in (("layers", self.layers is None), ("dtype", self.dtype == "auto"),
                                          ("backend", self.backend == "auto"), ("numerics", not self.numerics))
                 if not unset]
        if not self.model_id and given:
            raise ValueError(f"{', '.join(given)}: for the model this peer serves, and it is given none (model, or "
                             "model_id to fetch one from the peers that serve it)")
        fetched = [name for name in given if name != "layers"]
        if fetched:
            raise ValueError(f"{', '.join(fetched)}: for a model given with model; a peer fetching model_id computes "
                             "it in the numerics class of the peers it fetches from (docs/models.md)")

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
    "listen": _address, "advertise": _address, "api": _address, "control": _address, "metrics": _address,
    "data_dir": Path, "model": lambda v: Path(v) if v else None,
    "ready_file": lambda v: Path(v) if v else None, "draft_model": lambda v: Path(v) if v else None,
    "layers": parse_range,
    "memory_budget": parse_size, "kv_budget": parse_size, "prefix_kv": parse_size, "kv_tier": parse_size,
    "card_budget": parse_size,
    "bootstrap": _addresses,
    "relays": _addresses, "reachability": lambda v: _choice(v, ("auto", "direct", "relayed")),
    "compression": lambda v: _choice(v, ("auto", "off", "always")),
    "dtype": lambda v: _choice(v, DTYPE_CHOICES),
    "backend": lambda v: _choice(v, ("auto", "torch", "llama.cpp")),
    "device": _device,
    "capture": lambda v: _choice(v, CAPTURE_MODES), "capture_max_bytes": parse_size,
    "capture_max_age_s": lambda v: parse_duration(v),
    "link_shape": lambda v: parse_link_shape(v).label if str(v).strip() else "",
    "log_level": lambda v: _choice(v, LEVELS),
    "log_format": lambda v: _choice(v, FORMATS),
}


def parse_duration(value: str | float) -> float:
    """``"90s"``, ``"30m"``, ``"12h"``, ``"7d"`` or a number of seconds -> seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip().lower()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        return float(number) * units[unit]
    except ValueError:
        raise ValueError(f"not a duration: {value!r} (e.g. 90s, 30m, 12h, 7d)") from None


def _choice(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
    return value


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> PeerConfig:
    """Defaults, then the TOML file, then ``MESHD_*`` environment variables, then ``overrides``."""
    return PeerConfig(**layered_settings(PeerConfig, path, "MESHD_", overrides, _CONVERTERS,
                                         list_fields=("bootstrap", "relays")))
