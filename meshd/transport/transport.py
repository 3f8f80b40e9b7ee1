"""``Transport``: serve and dial authenticated HTTP/2 connections, one per peer, many streams each.

A connection runs over any Trio byte stream: a TCP socket, or a WebSocket through a ``meshd-relay``
(``meshd.transport.relay``). The TLS handshake, client authentication and HTTP/2 are the same on
both, so everything above the transport uses one code path whichever way a peer is reached.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from dataclasses import replace
from types import TracebackType
from typing import Any

import trio
from h2.errors import ErrorCodes
from trio_websocket import HandshakeError

from meshd.address import Address, AddressError
from meshd.identity import Identity
from meshd.links.stream import ShapedStream
from meshd.transport.config import TransportConfig
from meshd.transport.connection import Connection
from meshd.transport.errors import PeerAuthError, TransportError
from meshd.transport.handshake import client_handshake, server_handshake
from meshd.transport.memory import MemoryNetwork, MemoryOpener, MemoryStream
from meshd.transport.relay import dial as relay_dial
from meshd.transport.streams import MessageStream, StreamHandler
from meshd.transport.tls import Certificate, client_context, make_certificate, server_context

logger = logging.getLogger("meshd.transport")

# Where this peer's streams to itself are dialled on its in-memory loopback (never a real address).
_OWN = Address.coerce("127.0.0.1:1")


class Transport:
    """This peer's end of the mesh transport.

    Use as ``async with Transport(identity) as transport``: the transport owns the tasks of the
    connections it dials, and closing it closes every connection, dialled or accepted. Settings
    come as a ``TransportConfig`` and/or as keyword overrides of its fields.
    """

    def __init__(self, identity: Identity, config: TransportConfig | None = None, **settings: Any) -> None:
        self.identity = identity
        self.config = replace(config or TransportConfig(), **settings)
        self.listen_port: int | None = None
        self._client_context = client_context()
        self._certificate: Certificate | None = None
        self._server_context: ssl.SSLContext | None = None
        self._outbound: dict[str | Address, Connection] = {}  # by peer id, or by address when dialled unnamed
        self._outbound_via: dict[str | Address, Address] = {}
        self._dial_locks: dict[str | Address, trio.Lock] = {}
        self._inbound: set[Connection] = set()
        self._handshaking = 0
        self._handshaking_from: dict[str, int] = {}
        self.refusals: dict[str, int] = {}  # inbound connections and streams refused, by reason
        self.stream_headers: dict[str, str] = {}  # sent on every stream opened (a private mesh's membership)
        self._serve_scopes: set[trio.CancelScope] = set()
        self._exit_stack: contextlib.AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._links_shaped = 0
        self._own: MemoryOpener | None = None  # opens streams to this very peer in memory, while it serves

    async def __aenter__(self) -> Transport:
        self._exit_stack = contextlib.AsyncExitStack()
        self._nursery = await self._exit_stack.enter_async_context(trio.open_nursery())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._exit_stack is not None
        try:
            await self.aclose()
        finally:
            result = await self._exit_stack.__aexit__(exc_type, exc, tb)
        return result

    @property
    def connection_count(self) -> int:
        """Live connections this peer dialled."""
        return sum(1 for conn in self._outbound.values() if conn.is_alive)

    @property
    def inbound_connection_count(self) -> int:
        """Live connections other peers dialled to us."""
        return sum(1 for conn in self._inbound if conn.is_alive)

    # -- serving --------------------------------------------------------------------------------

    async def serve(
        self,
        listen: Address | str,
        handler: StreamHandler,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept peers until cancelled; ``handler(stream)`` runs in its own task per incoming stream.

        Reports the bound port (useful with port 0) through ``task_status`` and ``listen_port``.
        """
        listen = Address.coerce(listen)
        certificate, context = self._server_identity()
        listeners = await trio.open_tcp_listeners(listen.port, host=listen.host)
        self.listen_port = listeners[0].socket.getsockname()[1]
        logger.info("serving peer transport on %s as %s", listen.with_port(self.listen_port), self.identity.peer_id)
        with trio.CancelScope() as scope:
            self._serve_scopes.add(scope)
            own = MemoryNetwork(self.config.max_message_bytes, self.config.stream_window)
            try:
                async with trio.open_nursery() as nursery:
                    async def serve_own(stream: MessageStream) -> None:
                        assert isinstance(stream, MemoryStream)
                        await _serve_own(handler, stream)

                    self._own = own.join(self.identity.peer_id, _OWN, serve_own, nursery)
                    task_status.started(self.listen_port)

                    async def accept(tcp: trio.SocketStream) -> None:
                        await self._accept(tcp, context, certificate.der, handler)

                    await nursery.start(trio.serve_listeners, accept, listeners)
            finally:
                self._serve_scopes.discard(scope)
                own.kill(self.identity.peer_id)  # a stream to itself left open breaks, as a dropped connection's do
                if self._own is not None and self._own.network is own:
                    self._own = None

    def _server_identity(self) -> tuple[Certificate, ssl.SSLContext]:
        if self._certificate is None or self._server_context is None:
            self._certificate = make_certificate(self.identity)
            self._server_context = server_context(self._certificate)
        return self._certificate, self._server_context

    async def accept_stream(self, stream: trio.abc.Stream, handler: StreamHandler, remote: str) -> None:
        """Serve one inbound connection arriving on any byte stream (a relay circuit, say) until it ends.

        Exactly what a TCP accept does: TLS, client authentication, then HTTP/2 with ``handler``.
        """
        if self._closed:
            await trio.aclose_forcefully(stream)
            return
        certificate, context = self._server_identity()
        await self._accept(stream, context, certificate.der, handler, remote)

    def _refuse(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def _shaped(self, stream: trio.abc.Stream, nursery: trio.Nursery) -> trio.abc.Stream:
        """``stream`` with its sends on the configured link shape (its pump in ``nursery``), if any."""
        if self.config.link_shape is None:
            return stream
        self._links_shaped += 1  # a seed of its own for each connection's jitter
        return ShapedStream(stream, self.config.link_shape, nursery, seed=self._links_shaped)

    def _unshape_if_own(self, stream: trio.abc.Stream, peer_id: str) -> None:
        """A connection to this very peer (its own address dialled unnamed, say as a bootstrap address,
        or a stream to itself while it serves nothing) crosses no link: once authenticated, its bytes
        go straight through."""
        if peer_id == self.identity.peer_id and isinstance(stream, ShapedStream):
            stream.stop_shaping()

    async def _accept(self, tcp: trio.abc.Stream, context: ssl.SSLContext, cert_der: bytes, handler: StreamHandler,
                      remote: str | None = None) -> None:
        remote = remote or _describe(tcp)
        if self.config.link_shape is None:
            await self._serve_inbound(tcp, context, cert_der, handler, remote)
            return
        async with trio.open_nursery() as nursery:
            shaped = self._shaped(tcp, nursery)
            try:
                await self._serve_inbound(shaped, context, cert_der, handler, remote)
            finally:
                await trio.aclose_forcefully(shaped)

    async def _serve_inbound(self, tcp: trio.abc.Stream, context: ssl.SSLContext, cert_der: bytes,
                             handler: StreamHandler, remote: str) -> None:
        host = remote.rsplit(":", 1)[0]
        cfg = self.config
        # A connection costs memory from its first byte: bound how many may be authenticating, from
        # anyone and from one host, so that connections held open without a handshake (slow-loris)
        # cannot pile up, and how many authenticated ones are served.
        if len(self._inbound) >= cfg.max_inbound_connections:
            reason = "connections_full"
        elif self._handshaking >= cfg.max_handshakes:
            reason = "handshakes_full"
        elif self._handshaking_from.get(host, 0) >= cfg.max_handshakes_per_host:
            reason = "handshakes_full_for_host"
        else:
            reason = ""
        if reason:
            self._refuse(reason)
            logger.warning("refused connection from %s: %s", remote, reason.replace("_", " "))
            await trio.aclose_forcefully(tcp)
            return
        self._handshaking += 1
        self._handshaking_from[host] = self._handshaking_from.get(host, 0) + 1
        try:
            with trio.fail_after(cfg.handshake_timeout):
                stream, peer_id = await server_handshake(tcp, context, cert_der)
        except PeerAuthError as exc:
            self._refuse("auth_failed")
            logger.warning("rejected connection from %s: %s", remote, exc)
            await trio.aclose_forcefully(tcp)
            return
        except trio.TooSlowError:
            self._refuse("handshake_timeout")
            logger.warning("rejected connection from %s: no authentication within %ss", remote, cfg.handshake_timeout)
            await trio.aclose_forcefully(tcp)
            return
        except (TransportError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._refuse("handshake_failed")
            logger.warning("rejected connection from %s: handshake failed: %s", remote, exc)
            await trio.aclose_forcefully(tcp)
            return
        finally:
            self._handshaking -= 1
            left = self._handshaking_from.pop(host, 1) - 1
            if left:
                self._handshaking_from[host] = left
        self._unshape_if_own(tcp, peer_id)
        connection = Connection(stream, client_side=False, peer_id=peer_id, config=self.config, handler=handler)
        connection.refusals = self.refusals
        logger.debug("accepted peer %s from %s", peer_id, remote)
        self._inbound.add(connection)
        try:
            await connection.run()
        finally:
            self._inbound.discard(connection)

    # -- dialling -------------------------------------------------------------------------------

    async def open_stream(
        self, peer_id: str | None, address: Address | str, path: str, headers: dict[str, str] | None = None
    ) -> MessageStream:
        """Open a stream to a peer, reusing its live connection or dialling a new one.

        ``peer_id`` is the identity the peer must prove; ``None`` accepts whoever answers (the
        proven id is then ``stream.peer_id``). ``address`` is direct or a relay address (a relay
        needs ``peer_id``). A live relayed connection is replaced by a direct one as soon as the
        caller names a direct address for that peer.

        A stream to this very peer (an entry that is also the head or the tail of its route), while
        it serves, stays in memory: the same handler serves it, with no TLS, HTTP/2 or socket in
        between, which would only cost its event loop time on every token.
        """
        all_headers = {**self.stream_headers, **(headers or {})}
        if peer_id == self.identity.peer_id and self._own is not None:
            return await self._own.open_stream(peer_id, _OWN, path, all_headers)
        connection = await self._connection(peer_id, address)
        return await connection.open_stream(path, all_headers)

    async def request(
        self,
        peer_id: str | None,
        address: Address | str,
        path: str,
        body: bytes,
        timeout: float = 30.0,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        """Send one message, end our side, and return the peer's one reply message."""
        all_headers = {**self.stream_headers, **(headers or {})}
        if peer_id == self.identity.peer_id and self._own is not None:
            return await self._own.request(peer_id, _OWN, path, body, timeout, all_headers)
        try:
            with trio.fail_after(timeout):
                stream = await (await self._connection(peer_id, address)).open_stream(path, all_headers)
                async with stream:
                    await stream.send_message(body)
                    await stream.end()
                    status = (await stream.receive_headers())[":status"]
                    reply = await stream.receive_message()
                    if status != "200":
                        detail = reply.decode("utf-8", "replace") if reply else ""
                        raise TransportError(f"{path} on {stream.peer_id} answered status {status}: {detail}")
                    if reply is None:
                        raise TransportError(f"{path} on {stream.peer_id} ended the stream without a reply")
                    return reply
        except trio.TooSlowError as exc:
            raise TransportError(f"request {path} to {peer_id or address} timed out after {timeout}s") from exc

    async def _connection(self, peer_id: str | None, address: Address | str) -> Connection:
        if self._nursery is None or self._closed:
            raise TransportError("the transport is not open; use `async with Transport(...)`")
        try:
            address = Address.coerce(address)
        except AddressError as exc:
            raise TransportError(str(exc)) from None
        if address.relay and peer_id is None:
            raise TransportError("a relay can only be dialled for a named peer id")
        key: str | Address = peer_id if peer_id is not None else address
        lock = self._dial_locks.setdefault(key, trio.Lock())
        async with lock:
            connection = self._outbound.get(key)
            if connection is not None and connection.is_alive:
                via = self._outbound_via.get(key)
                if not (via is not None and via.relay and not address.relay):
                    return connection
                # The peer became directly dialable: new streams go direct; the relayed connection
                # finishes the streams it carries, then closes.
                fresh = await self._dial(peer_id, address)
                self._nursery.start_soon(_retire, connection)
                connection = fresh
            else:
                connection = await self._dial(peer_id, address)
            self._outbound[key] = connection
            self._outbound_via[key] = address
            return connection

    def connection_route(self, peer_id: str) -> str | None:
        """``"direct"`` or ``"relay"`` for this peer's live outbound connection, else ``None``."""
        connection = self._outbound.get(peer_id)
        if connection is None or not connection.is_alive:
            return None
        via = self._outbound_via.get(peer_id)
        return "relay" if via is not None and via.relay else "direct"

    def last_received(self) -> dict[str, float]:
        """Per peer, when (``time.monotonic()``) a live connection with it last carried bytes from it:
        proof that the peer's process is up, which its gossip need not probe again."""
        heard: dict[str, float] = {}
        for connection in [*self._outbound.values(), *self._inbound]:
            if connection.is_alive and connection.last_received > heard.get(connection.peer_id, -1.0):
                heard[connection.peer_id] = connection.last_received
        return heard

    async def check_dialable(self, peer_id: str, address: Address | str, timeout: float = 5.0) -> str | None:
        """Dial ``address`` afresh (no pooled connection) expecting ``peer_id``, then hang up.

        Returns ``None`` when the peer answered and proved its id, else what went wrong. Used to
        tell a peer whether its advertised address can be reached from here.
        """
        try:
            with trio.fail_after(timeout):
                connection = await self._dial(peer_id, Address.coerce(address))
        except (TransportError, AddressError, trio.TooSlowError) as exc:
            return str(exc) or type(exc).__name__
        await connection.aclose()
        return None

    async def _dial(self, peer_id: str | None, address: Address) -> Connection:
        assert self._nursery is not None
        tcp: trio.abc.Stream | None = None
        try:
            with trio.fail_after(self.config.connect_timeout):
                if address.relay:
                    assert peer_id is not None
                    tcp = await relay_dial(self._nursery, address, peer_id, max_chunk=self.config.relay_chunk_bytes)
                else:
                    tcp = await trio.open_tcp_stream(address.host, address.port)
                if peer_id != self.identity.peer_id:
                    tcp = self._shaped(tcp, self._nursery)
                stream, proven_id = await client_handshake(tcp, self._client_context, self.identity, peer_id)
                self._unshape_if_own(tcp, proven_id)
        except trio.TooSlowError as exc:
            await _abort(tcp)
            raise TransportError(f"dialling {address} timed out after {self.config.connect_timeout}s") from exc
        except PeerAuthError as exc:
            await _abort(tcp)
            logger.warning("refused peer at %s: %s", address, exc)
            raise
        except (OSError, HandshakeError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            await _abort(tcp)
            raise TransportError(f"cannot connect to {address}: {exc}") from exc
        except TransportError:
            await _abort(tcp)
            raise
        connection = Connection(stream, client_side=True, peer_id=proven_id, config=self.config)
        connection.refusals = self.refusals
        await self._nursery.start(connection.run)
        logger.debug("connected to peer %s at %s", proven_id, address)
        return connection

    async def aclose(self) -> None:
        """Stop serving and close every connection."""
        self._closed = True
        for scope in list(self._serve_scopes):
            scope.cancel()
        connections = [*self._outbound.values(), *self._inbound]
        self._outbound.clear()
        self._outbound_via.clear()
        async with trio.open_nursery() as nursery:
            for connection in connections:
                nursery.start_soon(connection.aclose)


async def _serve_own(handler: StreamHandler, stream: MemoryStream) -> None:
    """Run the handler of a stream to this very peer as a connection runs one it accepted: a handler
    that fails resets its stream (the rest of the peer goes on), and one that returns ends its side."""
    try:
        await handler(stream)
    except TransportError as exc:
        logger.debug("handler for own stream %s stopped: %s", stream.path, exc)
        stream.break_now(ErrorCodes.CANCEL, "handler stopped on a transport error", notify=True)
        return
    except Exception:
        logger.exception("handler for own stream %s failed", stream.path)
        stream.break_now(ErrorCodes.INTERNAL_ERROR, "handler raised", notify=True)
        return
    await stream.finish()


async def _retire(connection: Connection) -> None:
    """Close a replaced connection once the streams it still carries are done."""
    while connection.is_alive and connection.stream_count:
        await trio.sleep(0.5)
    await connection.aclose()


async def _abort(stream: trio.abc.AsyncResource | None) -> None:
    if stream is not None:
        await trio.aclose_forcefully(stream)


def _describe(tcp: trio.abc.Stream) -> str:
    if not isinstance(tcp, trio.SocketStream):
        return type(tcp).__name__
    try:
        host, port = tcp.socket.getpeername()[:2]
    except OSError:
        return "unknown address"
    return f"{host}:{port}"
