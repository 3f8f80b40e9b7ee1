"""Relayed links: relay addresses, the relay's registration protocol, and the peer's side of it.

A peer that cannot be dialled directly keeps a *control* WebSocket open to a ``meshd-relay``. It
registers by signing a fresh challenge from the relay with its identity key, which proves it owns
its peer id. A dialer opens a WebSocket to ``/v1/dial/<peer id>``; the relay tells the registered
peer ``incoming <circuit id>`` on its control socket, the peer opens a data WebSocket to
``/v1/accept/<circuit id>``, and the relay pipes the two data sockets together, bytes untouched.
The peers then run the ordinary transport inside: TLS 1.3 with the identity certificate, client
authentication, HTTP/2. The relay only ever carries ciphertext, and cannot pose as either peer,
because the dialer checks the certificate key against the peer id it meant to reach.

Messages on the control socket are JSON text frames:

    relay -> peer   {"type": "challenge", "nonce": HEX}
    peer -> relay   {"type": "register", "public_key": HEX, "nonce": HEX, "signature": HEX}
    relay -> peer   {"type": "registered", "peer_id": ID}            (or a close with a reason)
    relay -> peer   {"type": "incoming", "circuit": HEX}

The signature covers ``CONTEXT | nonce | public key``. Each nonce is issued once, for one socket,
and consumed by the first registration that names it; a captured registration is therefore
worthless anywhere else (``replayed_challenge``). Refusals close the WebSocket with a code from
``CLOSE_CODES`` and the reason as the close text.

Addresses: a peer reachable through a relay advertises ``relay:HOST:PORT``, the relay's own address
marked as a relay (:class:`meshd.address.Address` with ``relay=True``). ``Transport`` dials either.
"""

from __future__ import annotations

import base64
import enum
import json
import logging
import random
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection, connect_websocket

from meshd.address import Address, relay_address
from meshd.errors import first_leaf
from meshd.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_from_public_key, verify
from meshd.limits import parse_json
from meshd.transport.websocket import WebSocketStream, close_description

log = logging.getLogger("meshd.relay.client")

REGISTER_PATH = "/v1/register"
DIAL_PREFIX = "/v1/dial/"
ACCEPT_PREFIX = "/v1/accept/"
CONTEXT = b"meshd-relay-register-v1"
NONCE_BYTES = 32
CIRCUIT_ID_BYTES = 16
CONTROL_MESSAGE_LIMIT = 4096
DATA_RECEIVE_BUFFER = 64 * 1024


class Reason(enum.StrEnum):
    """Why a relay refused or ended something; the label of ``meshd_relay_rejections_total``."""

    BAD_SIGNATURE = "bad_signature"
    REPLAYED_CHALLENGE = "replayed_challenge"
    BAD_CHALLENGE = "bad_challenge"
    MALFORMED = "malformed"
    NOT_ALLOWED = "not_allowed"
    RELAY_FULL = "relay_full"
    UNKNOWN_PEER = "unknown_peer"
    CIRCUIT_LIMIT = "circuit_limit"
    BANDWIDTH_LIMIT = "bandwidth_limit"
    MESSAGE_TOO_LARGE = "message_too_large"
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    NOT_ACCEPTED = "not_accepted"
    UNKNOWN_CIRCUIT = "unknown_circuit"
    BAD_PATH = "bad_path"
    NOT_MEMBER = "not_member"


CLOSE_CODES: dict[Reason, int] = {reason: 4000 + i for i, reason in enumerate(Reason)}
_BY_CODE = {code: reason for reason, code in CLOSE_CODES.items()}


class RelayRejected(Exception):
    """The relay refused us, with one of the ``Reason`` values."""

    def __init__(self, reason: Reason | str, detail: str = "") -> None:
        super().__init__(f"relay refused: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


def reason_of_close(code: int | None, text: str) -> str:
    if code in _BY_CODE:
        return _BY_CODE[code].value
    return text or f"closed ({code})"


# -- the registration protocol (sans-IO) -----------------------------------------------------------


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def new_circuit_id() -> str:
    return secrets.token_hex(CIRCUIT_ID_BYTES)


def signed_payload(nonce: bytes, public_key: bytes) -> bytes:
    return CONTEXT + nonce + public_key


def challenge_message(nonce: bytes) -> str:
    return json.dumps({"type": "challenge", "nonce": nonce.hex()})


def registration_message(identity: Identity, nonce: bytes, membership: bytes = b"") -> str:
    """``membership``: the peer's serialized credential, for a relay that serves one private mesh."""
    signature = identity.sign(signed_payload(nonce, identity.public_key))
    doc = {"type": "register", "public_key": identity.public_key.hex(), "nonce": nonce.hex(),
           "signature": signature.hex()}
    if membership:
        doc["membership"] = base64.b64encode(membership).decode("ascii")
    return json.dumps(doc)


def registered_message(peer_id: str) -> str:
    return json.dumps({"type": "registered", "peer_id": peer_id})


def incoming_message(circuit_id: str) -> str:
    return json.dumps({"type": "incoming", "circuit": circuit_id})


def parse_message(message: str | bytes, expected_type: str | None = None) -> dict:
    """A control message as a dict; ``RelayRejected(MALFORMED)`` for anything else."""
    if isinstance(message, bytes) or len(message) > CONTROL_MESSAGE_LIMIT:
        raise RelayRejected(Reason.MALFORMED, "control messages are short JSON text")
    try:
        doc = parse_json(message)
    except ValueError as exc:
        raise RelayRejected(Reason.MALFORMED, f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("type"), str):
        raise RelayRejected(Reason.MALFORMED, "no message type")
    if expected_type is not None and doc["type"] != expected_type:
        raise RelayRejected(Reason.MALFORMED, f"expected {expected_type!r}, got {doc['type']!r}")
    return doc


def _hex_field(doc: dict, name: str, size: int) -> bytes:
    value = doc.get(name)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise RelayRejected(Reason.MALFORMED, f"{name} must be {size} bytes of hex")
    return raw


@dataclass(frozen=True)
class Registration:
    peer_id: str
    public_key: bytes
    nonce: bytes
    membership: bytes = b""  # a serialized SignedMembership, when the peer showed one


def read_registration(doc: dict) -> Registration:
    """Parse a registration; the caller checks the nonce (``check_registration``)."""
    if doc.get("type") != "register":
        raise RelayRejected(Reason.MALFORMED, "expected a registration")
    public_key = _hex_field(doc, "public_key", PUBLIC_KEY_BYTES)
    nonce = _hex_field(doc, "nonce", NONCE_BYTES)
    signature = _hex_field(doc, "signature", SIGNATURE_BYTES)
    if not verify(public_key, signed_payload(nonce, public_key), signature):
        raise RelayRejected(Reason.BAD_SIGNATURE, "signature does not verify for this key and nonce")
    shown = doc.get("membership", "")
    try:
        membership = base64.b64decode(shown, validate=True) if isinstance(shown, str) else b""
    except ValueError:
        raise RelayRejected(Reason.MALFORMED, "membership must be base64") from None
    return Registration(peer_id=peer_id_from_public_key(public_key), public_key=public_key, nonce=nonce,
                        membership=membership)


# -- the peer's side -------------------------------------------------------------------------------


async def connect_guarded(parent: trio.Nursery, host: str, port: int, path: str,
                          **options: Any) -> WebSocketConnection:
    """``connect_websocket``, with the WebSocket's reader task in a nursery of its own under ``parent``.
    The reader fails on what the other end may send at any time (a bad upgrade answer, a PING while
    closing); in ``parent`` itself that would end every task there (a peer's transport, or its
    registration). Here it ends this WebSocket only, and its user sees it closed. Failing to connect
    raises as ``connect_websocket`` does."""

    async def hold(*, task_status: trio.TaskStatus[WebSocketConnection] = trio.TASK_STATUS_IGNORED) -> None:
        connected = False
        try:
            async with trio.open_nursery() as own:
                ws = await connect_websocket(own, host, port, path, use_ssl=False, **options)
                connected = True
                task_status.started(ws)
        except Exception as exc:
            leaf = first_leaf(exc)
            if connected:
                log.info("relay %s:%d: a WebSocket failed: %s", host, port, leaf)
            elif isinstance(leaf, OSError | HandshakeError | ConnectionClosed | trio.TooSlowError):
                raise leaf from None
            else:  # the answer broke the HTTP or WebSocket protocol: a failed handshake all the same
                raise HandshakeError(f"{host}:{port} did not answer as a WebSocket relay: "
                                     f"{type(leaf).__name__}: {leaf}") from None

    ws: WebSocketConnection = await parent.start(hold)
    return ws


async def dial(nursery: trio.Nursery, relay: Address, peer_id: str, *, max_chunk: int) -> WebSocketStream:
    """A byte stream to ``peer_id`` through a relay; the WebSocket's reader task runs under ``nursery``."""
    endpoint = relay.endpoint
    ws = await connect_guarded(nursery, endpoint.host, endpoint.port, DIAL_PREFIX + peer_id,
                               receive_buffer_size=DATA_RECEIVE_BUFFER)
    return WebSocketStream(ws, max_chunk=max_chunk)


CircuitHandler = Callable[[WebSocketStream, str], Awaitable[None]]


class RelayRegistration:
    """Keeps this peer registered with one relay and hands each incoming circuit to ``on_circuit``.

    ``run`` reconnects after any failure (relay restart, network loss, a refusal) with exponential
    backoff and jitter, starting again from ``backoff_initial`` once a registration succeeded.
    ``on_change`` is called whenever ``registered`` flips, so the peer can re-issue its card.
    """

    def __init__(self, identity: Identity, relay: Address | str, on_circuit: CircuitHandler,
                 on_change: Callable[[], None] | None = None, *, backoff_initial: float = 0.25,
                 backoff_max: float = 8.0, keepalive_s: float = 10.0, max_chunk: int = 64 * 1024,
                 membership: Callable[[], bytes] | None = None) -> None:
        self.identity = identity
        self.membership = membership  # this peer's credential when in a private mesh, read at each registration
        self.relay = Address.coerce(relay).endpoint
        self.address = str(relay_address(self.relay))  # what the card advertises while registered
        self.on_circuit = on_circuit
        self.on_change = on_change
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.keepalive_s = keepalive_s
        self.max_chunk = max_chunk
        self.registered = False
        self.registrations = 0
        self.last_error = ""
        self._nursery: trio.Nursery | None = None

    def _set_registered(self, value: bool) -> None:
        if value != self.registered:
            self.registered = value
            if self.on_change is not None:
                self.on_change()

    async def run(self) -> None:
        backoff = self.backoff_initial
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            while True:
                before = self.registrations
                try:
                    await self._session(nursery)
                    self.last_error = "relay closed the control socket"
                except RelayRejected as exc:
                    self.last_error = str(exc)
                except (OSError, HandshakeError, ConnectionClosed, trio.BrokenResourceError,
                        trio.TooSlowError) as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
                except Exception as exc:  # whatever went wrong with this relay costs this session only
                    log.exception("relay %s: the control session failed", self.relay)
                    self.last_error = f"{type(exc).__name__}: {exc}"
                self._set_registered(False)
                if self.registrations > before:
                    backoff = self.backoff_initial
                log.info("relay %s: not registered (%s); retrying in %.2fs", self.relay, self.last_error, backoff)
                await trio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self.backoff_max)

    async def _session(self, nursery: trio.Nursery) -> None:
        host, port = self.relay.host, self.relay.port
        with trio.fail_after(10):
            ws = await connect_guarded(nursery, host, port, REGISTER_PATH)
        try:
            with trio.fail_after(10):
                challenge = parse_message(await _get(ws), "challenge")
                nonce = _hex_field(challenge, "nonce", NONCE_BYTES)
                shown = self.membership() if self.membership is not None else b""
                await ws.send_message(registration_message(self.identity, nonce, shown))
                reply = parse_message(await _get(ws), "registered")
            if reply.get("peer_id") != self.identity.peer_id:
                raise RelayRejected(Reason.MALFORMED, "relay registered another peer id")
            self.registrations += 1
            self._set_registered(True)
            log.info("registered with relay %s", self.relay)
            while True:
                message = None
                with trio.move_on_after(self.keepalive_s):
                    message = await _get(ws)
                if message is None:
                    with trio.fail_after(self.keepalive_s):
                        await ws.ping()
                    continue
                doc = parse_message(message)
                if doc["type"] == "incoming" and isinstance(doc.get("circuit"), str):
                    nursery.start_soon(self._accept_circuit, doc["circuit"])
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await ws.aclose()

    async def _accept_circuit(self, circuit_id: str) -> None:
        assert self._nursery is not None
        try:
            with trio.fail_after(10):
                ws = await connect_guarded(self._nursery, self.relay.host, self.relay.port, ACCEPT_PREFIX + circuit_id,
                                           receive_buffer_size=DATA_RECEIVE_BUFFER)
        except (OSError, HandshakeError, trio.TooSlowError) as exc:
            log.warning("relay %s: cannot accept circuit %s: %s", self.relay, circuit_id[:8], exc)
            return
        stream = WebSocketStream(ws, max_chunk=self.max_chunk)
        try:
            await self.on_circuit(stream, f"relay {self.relay} circuit {circuit_id[:8]}")
        finally:
            await trio.aclose_forcefully(stream)


async def _get(ws: WebSocketConnection) -> str | bytes:
    try:
        message: str | bytes = await ws.get_message()
        return message
    except ConnectionClosed as exc:
        code, text = close_description(exc)
        if code is not None and code >= 4000:
            raise RelayRejected(reason_of_close(code, text)) from exc
        raise
