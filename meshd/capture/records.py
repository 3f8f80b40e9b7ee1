"""One capture record per answered request: what each mode keeps, the keyed hashes that let a
replay tell whether a reply changed without keeping it, and the redaction of credentials.

``metadata`` keeps no content at all: the prompt and the reply appear only as HMACs under a key
of this peer's own (``capture.key`` in the data directory, mode 0600), so the hashes say nothing to
anyone without that key, and nothing across peers. ``full`` also keeps the request body and the
reply (token ids and text), with every credential-bearing field redacted first. Everything here is
pure: the daemon's writer (:mod:`meshd.capture.recorder`) calls it off the request path.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import re
import secrets
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshd.api.backend import BackendEvent, Finished, GenerationRequest, TokenEvent
from meshd.identity.private_files import PrivateFileError, load_or_create_private
from meshd.tracker.view import Route
from meshd.wire import card_pb2 as cpb

if TYPE_CHECKING:
    from meshd.session.entry import LiveGeneration

CAPTURE_MODES = ("off", "metadata", "full")
RECORD_VERSION = 1
KEY_FILE = "capture.key"
KEY_BYTES = 32
REDACTED = "[REDACTED]"
MAX_EMBEDDED_JSON = 1 << 20  # strings up to this long that hold JSON are redacted inside too

# a field whose name has one of these words (or word pairs) holds a credential
CREDENTIAL_WORDS = frozenset({
    "password", "passwd", "passphrase", "pwd", "secret", "secrets", "token", "tokens", "apikey", "apikeys",
    "authorization", "auth", "oauth", "credential", "credentials", "cookie", "cookies", "bearer", "privatekey",
    "accesskey", "jwt",
})
CREDENTIAL_PAIRS = frozenset({("api", "key"), ("private", "key"), ("access", "key"), ("secret", "key"),
                              ("signing", "key"), ("encryption", "key"), ("session", "key")})
# ...unless "token" is counted: max_tokens, prompt_tokens, completion_tokens are numbers of tokens
COUNT_WORDS = frozenset({"max", "min", "prompt", "completion", "total", "num", "count", "limit", "cached",
                         "reasoning", "ignore"})
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


class CaptureKeyError(Exception):
    """The capture key cannot be read or is not private to its owner."""


class CaptureFormatError(ValueError):
    """A capture record that is not one this version wrote."""


# -- the key ---------------------------------------------------------------------------------------


class CaptureKey:
    """The per-peer HMAC key of capture hashes; its ``key_id`` names it in records without revealing it."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise CaptureKeyError("a capture key has at least 16 bytes")
        self._secret = secret
        self.key_id = hmac.new(secret, b"meshd capture key id", hashlib.sha256).hexdigest()[:16]

    @classmethod
    def load_or_create(cls, data_dir: Path) -> CaptureKey:
        """``data_dir/capture.key``, created (mode 0600 from the start) on first use."""
        path = Path(data_dir) / KEY_FILE
        try:
            raw, _created = load_or_create_private(
                path, lambda: secrets.token_bytes(KEY_BYTES).hex().encode("ascii") + b"\n", "capture key")
        except PrivateFileError as exc:
            raise CaptureKeyError(str(exc)) from None
        try:
            return cls(bytes.fromhex(raw.decode("ascii").strip()))
        except (UnicodeDecodeError, ValueError):
            raise CaptureKeyError(f"capture key {path} is not hex (delete it to make a new one; earlier "
                                  "records' hashes then match nothing)") from None

    def tokens_hash(self, purpose: str, tokens: Sequence[int]) -> str:
        """HMAC-SHA256 of token ids (32-bit little-endian each), bound to ``purpose`` (prompt, reply)."""
        data = purpose.encode() + b"\0" + struct.pack(f"<{len(tokens)}I", *tokens)
        return hmac.new(self._secret, data, hashlib.sha256).hexdigest()

    def text_hash(self, purpose: str, text: str) -> str:
        return hmac.new(self._secret, purpose.encode() + b"\0" + text.encode(), hashlib.sha256).hexdigest()

    def stops_hash(self, stops: Sequence[str]) -> str:
        return self.text_hash("stop", json.dumps(list(stops)))


# -- redaction -------------------------------------------------------------------------------------


def is_credential_key(name: str) -> bool:
    """Whether a field called ``name`` holds a credential: api_key, apiKey, X-Api-Key, Authorization,
    access_token, password, client_secret... (not max_tokens or prompt_tokens, which count tokens)."""
    words = [w.lower() for w in _WORD.findall(name)]
    hits = {w for w in words if w in CREDENTIAL_WORDS}
    hits |= {f"{a} {b}" for a, b in itertools.pairwise(words) if (a, b) in CREDENTIAL_PAIRS}
    if hits and hits <= {"token", "tokens"} and any(w in COUNT_WORDS for w in words):
        return False
    return bool(hits)


def redact(value: Any) -> Any:
    """A copy of ``value`` with the value of every credential-bearing field replaced by
    ``[REDACTED]``, at any depth of dicts and lists, and inside strings that hold JSON (tool call
    arguments). Everything under a credential field goes, whatever its shape; the names of a JSON
    Schema's ``properties`` are parameter names, not fields, so a tool's schema stays intact."""
    return _redact(value, secret=False, names=False)


def _redact(value: Any, secret: bool, names: bool) -> Any:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            key = str(k)
            if names:
                out[key] = _redact(v, secret, False)
            elif secret or is_credential_key(key):
                out[key] = _redact(v, True, False)
            else:
                out[key] = _redact(v, False, key == "properties")
        return out
    if isinstance(value, list | tuple):
        return [_redact(v, secret, False) for v in value]
    if secret:
        return None if value is None else REDACTED
    if isinstance(value, str) and len(value) <= MAX_EMBEDDED_JSON and value.lstrip()[:1] in ("{", "["):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        if isinstance(parsed, dict | list):
            cleaned = _redact(parsed, False, False)
            if cleaned != parsed:
                return json.dumps(cleaned, ensure_ascii=False)
    return value


def request_body(req: GenerationRequest) -> dict[str, Any]:
    """The validated request as an OpenAI request body again: what a replay parses back."""
    body: dict[str, Any] = {"model": req.model}
    if req.kind == "chat":
        body["messages"] = req.messages or []
    else:
        body["prompt"] = req.prompt or ""
    if req.tools:
        body["tools"] = req.tools
        if not req.parallel_tool_calls:
            body["parallel_tool_calls"] = False
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    body["temperature"] = req.temperature
    body["top_p"] = req.top_p
    if req.seed is not None:
        body["seed"] = req.seed
    if req.stop:
        body["stop"] = list(req.stop)
    if req.ignore_eos:
        body["ignore_eos"] = True
    return body


# -- what the entry saw ----------------------------------------------------------------------------


@dataclass
class RequestObservation:
    """One request as the entry ran it, filled in while it runs; a record is made of it afterwards.

    ``reply`` holds exactly the tokens the API consumed: a reply cut by a stop string ends with the
    token that completed it, as the client's usage counts it."""

    request: GenerationRequest
    started: float                 # monotonic
    started_wall: float            # time.time()
    route: Route | None = None
    planned_by: str = ""
    numerics: str = ""
    prompt: list[int] = field(default_factory=list)
    seed: int = 0
    max_new_tokens: int = 0
    reply: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    ended_at: float | None = None
    finish_reason: str | None = None  # from the backend's Finished event, when it came
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    live: LiveGeneration | None = None  # the entry's view of the running generation: its last route, repairs

    def planned(self, route: Route, planned_by: str, numerics: str, prompt: Sequence[int], seed: int,
                max_new_tokens: int) -> None:
        self.route, self.planned_by, self.numerics = route, planned_by, numerics
        self.prompt, self.seed, self.max_new_tokens = list(prompt), seed, max_new_tokens

    def on_event(self, event: BackendEvent, now: float) -> None:
        if isinstance(event, TokenEvent):
            if self.first_token_at is None:
                self.first_token_at = now
            self.reply.append(event.token_id)
            self.text.append(event.text)
        elif isinstance(event, Finished):
            self.finish_reason = event.finish_reason
            self.text.append(event.text)
            self.tool_calls = list(event.tool_calls)

    def reply_text(self) -> str:
        return "".join(self.text)

    def ended_by(self) -> str | None:
        """How the reply ended as the client saw it: ``stop_string``, ``eos``, ``length`` or
        ``tool_calls``; None when it was not answered (the client went away, the route failed)."""
        if self.request.stop and any(s in self.reply_text() for s in self.request.stop):
            return "stop_string"
        return {"stop": "eos", "length": "length", "tool_calls": "tool_calls"}.get(self.finish_reason or "")


def numerics_of(cards: Mapping[str, cpb.CapabilityCard], route: Route) -> str:
    """The numerics class a route's hops compute in, as their cards say ("" when none says)."""
    for hop in route.hops:
        card = cards.get(hop.peer_id)
        for m in card.models if card is not None else []:
            if m.model_id == route.model_id and m.compat_key == route.compat_key and m.numerics:
                return str(m.numerics)
    return ""


def route_json(route: Route) -> dict[str, Any]:
    return {"epoch": route.epoch, "hops": [{"peer_id": h.peer_id, "start": h.start, "end": h.end}
                                           for h in route.hops]}


def build_record(seen: RequestObservation, mode: str, key: CaptureKey, entry_peer: str) -> dict[str, Any] | None:
    """The record of an answered request in ``mode`` (metadata or full); None when it was not answered."""
    ended_by = seen.ended_by()
    if ended_by is None or seen.route is None or mode not in ("metadata", "full"):
        return None
    req = seen.request
    ended_at = seen.ended_at if seen.ended_at is not None else seen.started
    record: dict[str, Any] = {
        "v": RECORD_VERSION, "id": req.request_id, "time_ms": int(seen.started_wall * 1000), "mode": mode,
        "key_id": key.key_id, "entry": entry_peer, "kind": req.kind, "model": req.model,
        "compat_key": seen.route.compat_key, "numerics": seen.numerics,
        "route": {**route_json(seen.route), "planned_by": seen.planned_by},
        "repairs": seen.live.repairs if seen.live is not None else 0,
        "final_route": ({"epoch": seen.live.epoch, "peers": list(seen.live.route)}
                        if seen.live is not None and seen.live.repairs else None),
        "sampling": {"temperature": req.temperature, "top_p": req.top_p, "seed": seen.seed,
                     "seed_drawn": req.seed is None},
        "max_tokens": req.max_tokens, "max_new_tokens": seen.max_new_tokens, "ignore_eos": req.ignore_eos,
        "stop": {"count": len(req.stop), "hash": key.stops_hash(req.stop)},
        "tools": len(req.tools or []),
        "prompt_tokens": len(seen.prompt), "completion_tokens": len(seen.reply),
        "prompt_hash": key.tokens_hash("prompt", seen.prompt), "reply_hash": key.tokens_hash("reply", seen.reply),
        "ttft_ms": None if seen.first_token_at is None else round((seen.first_token_at - seen.started) * 1000, 3),
        "total_ms": round((ended_at - seen.started) * 1000, 3),
        "finish_reason": "stop" if ended_by in ("stop_string", "eos") else ended_by, "ended_by": ended_by,
    }
    if mode == "full":
        try:
            record["request"] = redact(request_body(req))
            record["reply"] = {"tokens": list(seen.reply), "text": redact(seen.reply_text()),
                               "tool_calls": redact(seen.tool_calls)}
        except RecursionError:  # nested beyond what can be walked: no content rather than unredacted content
            record["request"] = None
            record["reply"] = None
            record["content_dropped"] = "the request is nested too deeply to redact"
    return record


# -- reading records back --------------------------------------------------------------------------


@dataclass(frozen=True)
class CapturedRequest:
    """A record read back, checked to have what a replay needs."""

    id: str
    mode: str
    key_id: str
    kind: str
    model: str
    compat_key: str
    numerics: str
    route: tuple[tuple[str, int, int], ...]
    epoch: int
    temperature: float
    top_p: float
    seed: int
    max_new_tokens: int
    ignore_eos: bool
    stop_count: int
    stop_hash: str
    prompt_tokens: int
    prompt_hash: str
    completion_tokens: int
    reply_hash: str
    ended_by: str
    time_ms: int
    request: dict[str, Any] | None = None
    reply_tokens: tuple[int, ...] | None = None

    @classmethod
    def from_json(cls, doc: object) -> CapturedRequest:
        if not isinstance(doc, dict):
            raise CaptureFormatError("a capture record is a JSON object")
        if doc.get("v") != RECORD_VERSION:
            raise CaptureFormatError(f"capture record version {doc.get('v')!r} is not {RECORD_VERSION}")
        try:
            route = doc["route"]
            hops = tuple((str(h["peer_id"]), _int(h["start"]), _int(h["end"])) for h in route["hops"])
            sampling = doc["sampling"]
            mode = str(doc["mode"])
            if mode not in ("metadata", "full"):
                raise CaptureFormatError(f"capture mode {mode!r} is neither metadata nor full")
            kind = str(doc["kind"])
            if kind not in ("chat", "completion"):
                raise CaptureFormatError(f"request kind {kind!r} is neither chat nor completion")
            request = doc.get("request")
            reply = doc.get("reply")
            tokens = None
            if mode == "full" and isinstance(reply, dict):
                tokens = tuple(_int(t) for t in reply["tokens"])
            return cls(
                id=str(doc["id"]), mode=mode, key_id=str(doc["key_id"]), kind=kind, model=str(doc["model"]),
                compat_key=str(doc["compat_key"]), numerics=str(doc.get("numerics") or ""), route=hops,
                epoch=_int(route.get("epoch", 0)), temperature=float(sampling["temperature"]),
                top_p=float(sampling["top_p"]), seed=_int(sampling["seed"]), max_new_tokens=_int(doc["max_new_tokens"]),
                ignore_eos=bool(doc["ignore_eos"]), stop_count=_int(doc["stop"]["count"]),
                stop_hash=str(doc["stop"]["hash"]), prompt_tokens=_int(doc["prompt_tokens"]),
                prompt_hash=str(doc["prompt_hash"]), completion_tokens=_int(doc["completion_tokens"]),
                reply_hash=str(doc["reply_hash"]), ended_by=str(doc["ended_by"]), time_ms=_int(doc["time_ms"]),
                request=request if mode == "full" and isinstance(request, dict) else None, reply_tokens=tokens,
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise CaptureFormatError(f"capture record {doc.get('id', '?')!r} lacks {exc}") from None
        except (ValueError, OverflowError) as exc:  # OverflowError: a number no float holds
            raise CaptureFormatError(f"capture record {doc.get('id', '?')!r}: {exc}") from None


def _int(value: object) -> int:
    """A whole number a record may hold: no token id, count or time is negative or past 64 bits."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise CaptureFormatError(f"{str(value)[:40]!r} is not a whole number from 0 to 2^64")
    return value
