"""The relay server: registrations, dials, circuits, and the operator's limits.

One WebSocket listener serves three paths (see ``meshd.transport.relay`` for the protocol):

- ``/v1/register``: a peer's control socket; it signs a fresh challenge, then waits for circuits;
- ``/v1/dial/<peer id>``: a dialer; the relay asks the registered peer to pick up a new circuit;
- ``/v1/accept/<circuit id>``: the peer's data socket for that circuit.

Once both data sockets of a circuit are there, the relay copies binary messages between them, as
they are. What it copies is the peers' own TLS, so it can count bytes and enforce limits but never
read or alter what the peers say. Every refusal closes only the offending socket, with a reason
(as the WebSocket close text and as a label of ``meshd_relay_rejections_total``); everything else
keeps running.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from google.protobuf.message import DecodeError
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, WebSocketServer

from meshd.address import Address
from meshd.admission.records import check_membership
from meshd.api.openai_server import serve_asgi, start_listener
from meshd.errors import MeshError, first_leaf
from meshd.files import write_atomically
from meshd.limits import TokenBucket
from meshd.transport.relay import (
    ACCEPT_PREFIX,
    CLOSE_CODES,
    DIAL_PREFIX,
    REGISTER_PATH,
    Reason,
    Registration,
    RelayRejected,
    challenge_message,
    incoming_message,
    new_circuit_id,
    new_nonce,
    parse_message,
    read_registration,
    registered_message,
)
from meshd.wire.admission_pb2 import SignedMembership
from meshd_relay.config import RelayConfig
from meshd_relay.metrics import RelayMetrics

log = logging.getLogger("meshd.relay")

NONCE_MEMORY = 100_000
Tap = Callable[[str, str, bytes], None]  # (circuit id, direction, message) for every message piped


class _ConnectionsApart(WebSocketServer):
    """trio-websocket runs each connection's reader in the connection's own task, whose failure it
    passes on to the server's nursery: a client that sends garbage and resets, or answers a close with a
    PING, would end the relay for everybody. Here a connection's failure ends that connection only."""

    async def _handle_connection(self, stream: trio.abc.Stream) -> None:
        try:
            await super()._handle_connection(stream)
        except Exception as exc:
            log.debug("a connection failed: %r", first_leaf(exc))
        finally:
            await trio.aclose_forcefully(stream)


@dataclass
class _Registered:
    peer_id: str
    control: WebSocketConnection
    bucket: TokenBucket
    remote: str
    circuits: set[str] = field(default_factory=set)  # shared by its registrations: see RelayServer._allowance
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    gone: trio.Event = field(default_factory=trio.Event)


@dataclass
class _Circuit:
    circuit_id: str
    peer: _Registered
    accepted: trio.Event = field(default_factory=trio.Event)
    peer_side: WebSocketConnection | None = None
    done: trio.Event = field(default_factory=trio.Event)


class RelayServer:
    """``await nursery.start(server.serve)`` returns once listening; ``port`` and ``metrics_port`` say where.

    ``tap``, when given, sees every message the relay pipes (tests use it to show that only
    ciphertext passes through). It is not configurable in a deployment.
    """

    def __init__(self, config: RelayConfig, *, tap: Tap | None = None) -> None:
        self.config = config
        self.metrics = RelayMetrics()
        self.tap = tap
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._peers: dict[str, _Registered] = {}
        self._circuits: dict[str, _Circuit] = {}
        self._nonces: OrderedDict[bytes, None] = OrderedDict()
        self._allow = frozenset(config.allow_peers)
        self._allowances: dict[str, tuple[set[str], TokenBucket]] = {}  # per peer: see _allowance

    @property
    def registered(self) -> list[str]:
        return sorted(self._peers)

    async def serve(self, *, task_status: trio.TaskStatus[RelayServer] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        listen = Address.parse(cfg.listen)
        async with trio.open_nursery() as nursery:
            server = await start_listener(nursery, "the relay", listen, self._listen, listen, nursery)
            self.port = int(server.port)
            metrics: Address | None = None
            if cfg.metrics:
                from meshd.metrics import metrics_app

                metrics = Address.parse(cfg.metrics)
                app = metrics_app(self.metrics.registry)
                self.metrics_port = await start_listener(nursery, "metrics", metrics, serve_asgi, app, metrics,
                                                         "meshd.relay.metrics")
                metrics = metrics.with_port(self.metrics_port)
            _event("info", "relay listening", listen=str(listen.with_port(self.port)),
                   metrics=str(metrics) if metrics is not None else None)
            if cfg.ready_file is not None:
                write_atomically(cfg.ready_file, json.dumps({"port": self.port, "metrics_port": self.metrics_port}))
            task_status.started(self)

    async def _listen(self, listen: Address, nursery: trio.Nursery, *,
                      task_status: trio.TaskStatus[WebSocketServer] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        listeners = await trio.open_tcp_listeners(listen.port, host=listen.host)
        server = _ConnectionsApart(self._handle, listeners, handler_nursery=nursery,
                                   max_message_size=cfg.max_message_bytes, receive_buffer_size=64 * 1024,
                                   connect_timeout=cfg.handshake_timeout_s)
        await server.run(task_status=task_status)

    # -- dispatch ----------------------------------------------------------------------------------

    async def _handle(self, request: WebSocketRequest) -> None:
        path = request.path
        try:
            if path == REGISTER_PATH:
                await self._register(request)
            elif path.startswith(DIAL_PREFIX):
                await self._dial(request, path[len(DIAL_PREFIX):])
            elif path.startswith(ACCEPT_PREFIX):
                await self._accept(request, path[len(ACCEPT_PREFIX):])
            else:
                self._count(Reason.BAD_PATH, path=path[:80])
                await request.reject(404, body=b"unknown relay path\n")
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            # One misbehaving socket must never take the listener (and everybody else) down with it.
            log.exception("handler failed", extra={"fields": {"path": path[:80]}})

    def _count(self, reason: Reason, **fields: object) -> None:
        self.metrics.rejections.labels(reason.value).inc()
        _event("warning", "refused", reason=reason.value, **fields)

    async def _refuse(self, ws: WebSocketConnection, reason: Reason, **fields: object) -> None:
        self._count(reason, **fields)
        with trio.move_on_after(1):
            await ws.aclose(CLOSE_CODES[reason], reason.value)

    # -- registration ------------------------------------------------------------------------------

    def _issue_nonce(self) -> bytes:
        nonce = new_nonce()
        self._nonces[nonce] = None
        while len(self._nonces) > NONCE_MEMORY:
            self._nonces.popitem(last=False)
        return nonce

    async def _register(self, request: WebSocketRequest) -> None:
        cfg = self.config
        ws = await request.accept()
        remote = str(ws.remote)
        nonce = self._issue_nonce()
        await ws.send_message(challenge_message(nonce))
        try:
            with trio.fail_after(cfg.handshake_timeout_s):
                message = await ws.get_message()
            registration = read_registration(parse_message(message, "register"))
            if registration.nonce != nonce:
                replayed = registration.nonce in self._nonces
                raise RelayRejected(Reason.REPLAYED_CHALLENGE if replayed else Reason.BAD_CHALLENGE)
        except trio.TooSlowError:
            await self._refuse(ws, Reason.HANDSHAKE_TIMEOUT, remote=remote)
            return
        except RelayRejected as exc:
            await self._refuse(ws, Reason(exc.reason), remote=remote)
            return
        except ConnectionClosed as exc:
            if exc.reason is not None and exc.reason.code == 1009:
                self._count(Reason.MESSAGE_TOO_LARGE, remote=remote, during="registration")
            return
        finally:
            self._nonces.pop(nonce, None)
            self._nonces[nonce] = None  # consumed: remembered only so that a replay is recognised
        peer_id = registration.peer_id
        if self._allow and peer_id not in self._allow:
            await self._refuse(ws, Reason.NOT_ALLOWED, peer=peer_id, remote=remote)
            return
        if cfg.mesh_key and not _is_member(registration, bytes.fromhex(cfg.mesh_key)):
            await self._refuse(ws, Reason.NOT_MEMBER, peer=peer_id, remote=remote)
            return
        if peer_id not in self._peers and len(self._peers) >= cfg.max_peers:
            await self._refuse(ws, Reason.RELAY_FULL, peer=peer_id, remote=remote)
            return
        previous = self._peers.get(peer_id)
        circuits, bucket = self._allowance(peer_id)
        peer = _Registered(peer_id, ws, bucket, remote, circuits)
        self._peers[peer_id] = peer
        self.metrics.registered_peers.set(len(self._peers))
        self.metrics.registrations.inc()
        if previous is not None:
            previous.gone.set()
            with trio.move_on_after(1):
                await previous.control.aclose(1000, "registered again")
        _event("info", "registered", peer=peer_id, remote=remote, replaced=previous is not None)
        try:
            await ws.send_message(registered_message(peer_id))
            while True:
                await ws.get_message()  # a peer says nothing after registering; pings are answered below us
        except ConnectionClosed as exc:
            if exc.reason is not None and exc.reason.code == 1009:
                self._count(Reason.MESSAGE_TOO_LARGE, peer=peer_id, during="control")
        finally:
            if self._peers.get(peer_id) is peer:
                del self._peers[peer_id]
                self.metrics.registered_peers.set(len(self._peers))
                _event("info", "unregistered", peer=peer_id)
                self._release_allowance(peer_id)
            peer.gone.set()

    def _allowance(self, peer_id: str) -> tuple[set[str], TokenBucket]:
        """A peer's open circuits and bandwidth bucket, the same across its registrations while any of
        its circuits is open: registering again (after a drop, or over a live registration) neither
        clears its circuit count nor refills its allowance."""
        held = self._allowances.get(peer_id)
        if held is None:
            cfg = self.config
            held = self._allowances[peer_id] = (set(), TokenBucket(
                cfg.bandwidth_bytes_per_s, cfg.bandwidth_burst_bytes, cfg.bandwidth_max_delay_s, trio.current_time()))
        return held

    def _release_allowance(self, peer_id: str) -> None:
        """Forget a peer's allowance once it is neither registered nor has a circuit open."""
        held = self._allowances.get(peer_id)
        if held is not None and not held[0] and peer_id not in self._peers:
            del self._allowances[peer_id]

    # -- circuits ----------------------------------------------------------------------------------

    async def _dial(self, request: WebSocketRequest, peer_id: str) -> None:
        cfg = self.config
        ws = await request.accept()
        remote = str(ws.remote)
        peer = self._peers.get(peer_id)
        if peer is None:
            await self._refuse(ws, Reason.UNKNOWN_PEER, peer=peer_id[:64], remote=remote)
            return
        if len(peer.circuits) >= cfg.max_circuits_per_peer:
            await self._refuse(ws, Reason.CIRCUIT_LIMIT, peer=peer_id, remote=remote, open=len(peer.circuits))
            return
        circuit = _Circuit(new_circuit_id(), peer)
        self._circuits[circuit.circuit_id] = circuit
        peer.circuits.add(circuit.circuit_id)
        try:
            try:
                async with peer.send_lock:
                    await peer.control.send_message(incoming_message(circuit.circuit_id))
            except ConnectionClosed:
                await self._refuse(ws, Reason.NOT_ACCEPTED, peer=peer_id, detail="control socket closed")
                return
            with trio.move_on_after(cfg.accept_timeout_s):
                await circuit.accepted.wait()
            if circuit.peer_side is None:
                await self._refuse(ws, Reason.NOT_ACCEPTED, peer=peer_id, remote=remote)
                return
            self.metrics.circuits.inc()
            self.metrics.open_circuits.inc()
            _event("info", "circuit opened", circuit=circuit.circuit_id[:8], peer=peer_id, remote=remote)
            try:
                reason, moved = await self._splice(circuit, ws, circuit.peer_side)
            finally:
                self.metrics.open_circuits.dec()
            self.metrics.circuits_closed.labels(reason).inc()
            _event("info", "circuit closed", circuit=circuit.circuit_id[:8], peer=peer_id, reason=reason,
                   to_peer=moved["to_peer"], from_peer=moved["from_peer"])
        finally:
            del self._circuits[circuit.circuit_id]
            peer.circuits.discard(circuit.circuit_id)
            self._release_allowance(peer_id)
            circuit.done.set()

    async def _accept(self, request: WebSocketRequest, circuit_id: str) -> None:
        circuit = self._circuits.get(circuit_id)
        ws = await request.accept()
        if circuit is None or circuit.accepted.is_set():
            await self._refuse(ws, Reason.UNKNOWN_CIRCUIT, circuit=circuit_id[:8])
            return
        circuit.peer_side = ws
        circuit.accepted.set()
        await circuit.done.wait()

    async def _splice(self, circuit: _Circuit, dialer: WebSocketConnection,
                      peer_side: WebSocketConnection) -> tuple[str, dict[str, int]]:
        """Pipe both ways until either side closes, a limit is hit, or the circuit idles out."""
        cfg = self.config
        moved = {"to_peer": 0, "from_peer": 0}
        ended: list[tuple[str, Reason | None]] = []
        last_activity = trio.current_time()

        async def pump(src: WebSocketConnection, dst: WebSocketConnection, direction: str,
                       cancel: trio.CancelScope) -> None:
            nonlocal last_activity
            while True:
                try:
                    message = await src.get_message()
                except ConnectionClosed as exc:
                    if exc.reason is not None and exc.reason.code == 1009:
                        self._count(Reason.MESSAGE_TOO_LARGE, circuit=circuit.circuit_id[:8], direction=direction,
                                    peer=circuit.peer.peer_id)
                        ended.append(("message_too_large", Reason.MESSAGE_TOO_LARGE))
                    else:
                        ended.append(("closed", None))
                    break
                if isinstance(message, str):
                    self._count(Reason.MALFORMED, circuit=circuit.circuit_id[:8], detail="text on a circuit")
                    ended.append(("malformed", Reason.MALFORMED))
                    break
                delay = circuit.peer.bucket.take(len(message), trio.current_time())
                if delay is None:
                    self._count(Reason.BANDWIDTH_LIMIT, circuit=circuit.circuit_id[:8], peer=circuit.peer.peer_id,
                                direction=direction)
                    ended.append(("bandwidth_limit", Reason.BANDWIDTH_LIMIT))
                    break
                if delay:
                    await trio.sleep(delay)
                if self.tap is not None:
                    self.tap(circuit.circuit_id, direction, message)
                try:
                    await dst.send_message(message)
                except ConnectionClosed:
                    ended.append(("closed", None))
                    break
                moved[direction] += len(message)
                self.metrics.bytes_relayed.labels(direction).inc(len(message))
                last_activity = trio.current_time()
            cancel.cancel()

        async def watchdog(cancel: trio.CancelScope) -> None:
            while True:
                idle = trio.current_time() - last_activity
                if idle >= cfg.idle_timeout_s:
                    ended.append(("idle_timeout", None))
                    cancel.cancel()
                    return
                await trio.sleep(cfg.idle_timeout_s - idle)

        async with trio.open_nursery() as nursery:
            scope = nursery.cancel_scope
            nursery.start_soon(pump, dialer, peer_side, "to_peer", scope)
            nursery.start_soon(pump, peer_side, dialer, "from_peer", scope)
            nursery.start_soon(watchdog, scope)
        reason_text, reason = ended[0] if ended else ("closed", None)
        code, text = (CLOSE_CODES[reason], reason.value) if reason is not None else (1000, reason_text)
        for ws in (dialer, peer_side):
            with trio.move_on_after(1):
                await ws.aclose(code, text)
        return reason_text, moved


def _is_member(registration: Registration, mesh_key: bytes) -> bool:
    signed = SignedMembership()
    try:
        signed.ParseFromString(registration.membership)
        check_membership(signed, mesh_key, registration.peer_id)
    except (DecodeError, MeshError):
        return False
    return True


def _event(level: str, message: str, **fields: object) -> None:
    log.log(logging.getLevelName(level.upper()), message, extra={"fields": fields})

