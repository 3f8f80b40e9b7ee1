"""One HTTP/2 connection to a peer and the streams on it: the Trio adapter around ``h2``.

``h2`` holds all protocol state; this module only moves bytes. One reader task feeds received
bytes to ``h2`` and dispatches its events to streams; one writer task sends whatever ``h2`` has
queued, so no task ever blocks on the socket while holding protocol state, and a stream that waits
for flow-control credit never stops the reader from delivering the window update it waits for.

Flow control is end to end: a sender only hands ``h2`` as much as the stream's window allows and
otherwise waits; a receiver keeps at most one stream window of unread data and hands the credit
back (``acknowledge_received_data``) only as the application consumes it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import trio
from h2.errors import ErrorCodes
from h2.settings import SettingCodes, Settings

from meshd.transport.config import TransportConfig
from meshd.transport.errors import BufferFull, FramingError, MessageTooLarge, StreamReset, TransportError
from meshd.transport.framing import LENGTH_PREFIX, MessageDecoder

logger = logging.getLogger("meshd.transport")

Handler = Callable[["Stream"], Awaitable[None]]
_DEFAULT_CONNECTION_WINDOW = 65535
_GOAWAY_FLUSH_SECONDS = 1.0


class _Signal:
    """Wakes every task waiting on it; waiters re-check their own condition."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class Connection:
    """An authenticated HTTP/2 connection; ``run`` owns its tasks, ``open_stream`` starts a request."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        client_side: bool,
        peer_id: str,
        config: TransportConfig,
        handler: Handler | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.client_side = client_side
        self._socket = stream
        self._config = config
        self._handler = handler
        self._h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=client_side, header_encoding="utf-8")
        )
        settings = {
            SettingCodes.INITIAL_WINDOW_SIZE: config.stream_window,
            SettingCodes.MAX_CONCURRENT_STREAMS: config.max_concurrent_streams,
            SettingCodes.MAX_HEADER_LIST_SIZE: config.max_header_list_bytes,
        }
        if client_side:
            settings[SettingCodes.ENABLE_PUSH] = 0
        self._h2.local_settings = Settings(client=client_side, initial_values=settings)
        # settings given as initial values count as acknowledged, so h2 never applies this one itself
        self._h2.decoder.max_header_list_size = config.max_header_list_bytes
        self._h2.initiate_connection()
        if config.connection_window > _DEFAULT_CONNECTION_WINDOW:
            self._h2.increment_flow_control_window(config.connection_window - _DEFAULT_CONNECTION_WINDOW)
        self._streams: dict[int, Stream] = {}
        self.buffered_bytes = 0  # held by this connection's streams, received but not read whole
        self.refusals: dict[str, int] = {}  # streams refused for what they sent, by reason
        self._changed = _Signal()  # windows, flushes, free stream slots, closure
        self._writer_wakeup = trio.Event()
        self._wanted_seq = 0
        self._sent_seq = 0
        self._closed_reason: str | None = None
        self._goaway_sent = False
        self._cancel_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._finished = trio.Event()
        self.last_received = time.monotonic()  # when the peer last sent bytes (the handshake counts)

    def __repr__(self) -> str:
        side = "to" if self.client_side else "from"
        return f"<Connection {side} {self.peer_id} streams={len(self._streams)}>"

    @property
    def is_alive(self) -> bool:
        return self._closed_reason is None

    @property
    def stream_count(self) -> int:
        return len(self._streams)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the reader, writer and (server side) handler tasks until the connection ends."""
        try:
            async with trio.open_nursery() as nursery:
                self._cancel_scope = nursery.cancel_scope
                self._nursery = nursery
                if self._closed_reason is not None:
                    nursery.cancel_scope.cancel()
                nursery.start_soon(self._write_loop)
                nursery.start_soon(self._read_loop)
                self._kick()
                task_status.started()
        finally:
            self._mark_closed("connection closed")
            await trio.aclose_forcefully(self._socket)
            self._finished.set()

    async def aclose(self) -> None:
        """Say GOAWAY (briefly, best effort), then close the socket and stop all tasks."""
        if self._closed_reason is None:
            self._goaway_sent = True
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.close_connection()
            with trio.move_on_after(_GOAWAY_FLUSH_SECONDS):
                with contextlib.suppress(TransportError):
                    await self.flush()
            self._close("closed locally")
        if self._cancel_scope is not None:
            await self._finished.wait()
        else:
            await trio.aclose_forcefully(self._socket)

    async def open_stream(self, path: str, headers: dict[str, str] | None = None) -> Stream:
        """Send request headers for a new stream; waits for a free slot if the peer's limit is reached."""
        while True:
            self._raise_if_closed()
            if self._h2.open_outbound_streams < self._h2.remote_settings.max_concurrent_streams:
                break
            await self._changed.wait()
        request_headers = [(":method", "POST"), (":scheme", "https"), (":authority", self.peer_id), (":path", path)]
        request_headers += [(name.lower(), value) for name, value in (headers or {}).items()]
        try:
            stream_id = self._h2.get_next_available_stream_id()
            self._h2.send_headers(stream_id, request_headers)
        except h2.exceptions.NoAvailableStreamIDError as exc:
            self._close("stream ids exhausted")
            raise TransportError(f"connection to {self.peer_id} has no stream ids left") from exc
        except h2.exceptions.ProtocolError as exc:
            raise TransportError(f"cannot open stream {path!r} to {self.peer_id}: {exc}") from exc
        stream = Stream(self, stream_id, path=path, headers=dict(headers or {}), server_side=False)
        self._streams[stream_id] = stream
        await self.flush()
        return stream

    async def flush(self) -> None:
        """Wait until everything queued in ``h2`` so far has been written to the socket."""
        seq = self._kick()
        while self._sent_seq < seq:
            self._raise_if_closed()
            await self._changed.wait()

    def _kick(self) -> int:
        self._wanted_seq += 1
        self._writer_wakeup.set()
        return self._wanted_seq

    def _raise_if_closed(self) -> None:
        if self._closed_reason is not None:
            raise TransportError(f"connection with {self.peer_id} is closed: {self._closed_reason}")

    def _mark_closed(self, reason: str) -> None:
        if self._closed_reason is not None:
            return
        self._closed_reason = reason
        logger.debug("connection with %s closed: %s", self.peer_id, reason)
        for stream in list(self._streams.values()):
            stream._signal.fire()
        self._changed.fire()

    def _close(self, reason: str) -> None:
        self._mark_closed(reason)
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    def _forget(self, stream: Stream) -> None:
        stream._drop_buffered()
        if self._streams.get(stream.stream_id) is stream:
            del self._streams[stream.stream_id]
            self._changed.fire()

    def _acknowledge(self, stream_id: int, size: int) -> None:
        if size and self._closed_reason is None:
            try:
                self._h2.acknowledge_received_data(size, stream_id)
            except h2.exceptions.ProtocolError:
                return
            self._kick()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._writer_wakeup.wait()
                self._writer_wakeup = trio.Event()
                seq = self._wanted_seq
                data = self._h2.data_to_send()
                if data:
                    await self._socket.send_all(data)
                self._sent_seq = seq
                self._changed.fire()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._close(f"send failed: {exc!r}")
        except Exception:
            # A bug here must cost this connection, not every connection of the transport.
            logger.exception("writer for %s failed", self.peer_id)
            self._close("internal error in the writer")

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._socket.receive_some(self._config.read_size)
                if not data:
                    self._close("peer closed the connection")
                    return
                self.last_received = time.monotonic()
                try:
                    events = self._h2.receive_data(data)
                except h2.exceptions.ProtocolError as exc:
                    if self._goaway_sent:  # h2 refuses every frame after our GOAWAY; we are closing anyway
                        self._close("closed locally")
                        return
                    logger.warning("HTTP/2 protocol error from %s, closing the connection: %s", self.peer_id, exc)
                    self.refusals["protocol_error"] = self.refusals.get("protocol_error", 0) + 1
                    with trio.move_on_after(_GOAWAY_FLUSH_SECONDS), contextlib.suppress(TransportError):
                        await self.flush()
                    self._close(f"protocol error: {exc}")
                    return
                for event in events:
                    self._dispatch(event)
                self._kick()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._close(f"receive failed: {exc!r}")
        except Exception:
            logger.exception("reader for %s failed", self.peer_id)
            self._close("internal error in the reader")

    def _dispatch(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.DataReceived):
            stream = self._streams.get(event.stream_id)
            if stream is None:
                self._acknowledge(event.stream_id, event.flow_controlled_length)
            else:
                stream._on_data(event.data, event.flow_controlled_length)
        elif isinstance(event, h2.events.RequestReceived):
            self._on_request(event)
        elif isinstance(event, h2.events.ResponseReceived):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream._on_response(_text_headers(event.headers))
        elif isinstance(event, h2.events.StreamEnded):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream._on_remote_end()
            self._changed.fire()
        elif isinstance(event, h2.events.StreamReset):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                reason = "reset by peer" if event.remote_reset else "reset after a protocol error"
                stream._on_reset(event.error_code, reason)
            self._changed.fire()
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self._changed.fire()
        elif isinstance(event, h2.events.ConnectionTerminated):
            # h2 accepts nothing more after GOAWAY; streams not finished by now are lost.
            if event.error_code:
                logger.warning("peer %s ended the connection with %s", self.peer_id, event.error_code)
            self._close(f"peer sent GOAWAY ({event.error_code})")

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        headers = dict(_text_headers(event.headers))
        path = headers.get(":path", "")
        stream = Stream(
            self,
            event.stream_id,
            path=path,
            headers={name: value for name, value in headers.items() if not name.startswith(":")},
            server_side=True,
        )
        self._streams[event.stream_id] = stream
        if self._handler is None:
            stream._reset_now(ErrorCodes.REFUSED_STREAM, "this side serves no requests")
            return
        assert self._nursery is not None
        self._nursery.start_soon(self._run_handler, self._handler, stream)

    async def _run_handler(self, handler: Handler, stream: Stream) -> None:
        try:
            await handler(stream)
        except TransportError as exc:
            logger.debug("handler for %s from %s stopped: %s", stream.path, self.peer_id, exc)
            stream._reset_now(ErrorCodes.CANCEL, "handler stopped on a transport error")
            return
        except Exception:
            logger.exception("handler for %s from %s failed", stream.path, self.peer_id)
            stream._reset_now(ErrorCodes.INTERNAL_ERROR, "handler raised")
            return
        try:
            await stream._finish()
        except TransportError as exc:
            logger.debug("could not finish stream %s from %s: %s", stream.path, self.peer_id, exc)


class Stream:
    """One HTTP/2 stream carrying length-prefixed messages in both directions.

    On the responding side, response headers (status 200 unless ``respond`` was called) go out with
    the first message or ``end``. ``receive_message`` returns ``None`` once the peer has ended its
    side cleanly. Use ``async with stream`` (or ``aclose``) so an abandoned stream is reset.
    """

    def __init__(
        self, connection: Connection, stream_id: int, *, path: str, headers: dict[str, str], server_side: bool
    ) -> None:
        self.stream_id = stream_id
        self.path = path
        self.headers = headers
        self.peer_id = connection.peer_id
        self.response_headers: dict[str, str] | None = None
        self._conn = connection
        self._server_side = server_side
        self._headers_sent = not server_side
        self._local_ended = False
        self._remote_ended = False
        self._reset: StreamReset | None = None
        self._readable_after_reset = False
        self._inbound: deque[tuple[bytes, int]] = deque()
        self._unacknowledged = 0
        self._decoder = MessageDecoder(connection._config.max_message_bytes)
        self._messages: deque[bytes] = deque()
        self._buffered = 0  # this stream's share of the connection's buffered_bytes
        self._signal = _Signal()
        self._send_lock = trio.Lock()

    def __repr__(self) -> str:
        return f"<Stream {self.stream_id} {self.path!r} peer={self.peer_id}>"

    @property
    def status(self) -> int | None:
        """The response status, once response headers were sent (responder) or received (requester)."""
        if self.response_headers is None:
            return None
        return int(self.response_headers[":status"])

    @property
    def buffered_bytes(self) -> int:
        """Received bytes not yet consumed by the application (bounded by the stream window)."""
        return self._unacknowledged

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[bytes]:
        while (message := await self.receive_message()) is not None:
            yield message

    async def respond(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        """Send response headers now (responding side only, before any message)."""
        if not self._server_side:
            raise TransportError("only the responding side sends response headers")
        async with self._send_lock:
            self._check_can_send()
            if self._headers_sent:
                raise TransportError("response headers were already sent")
            self._send_response_headers(status, headers)
        await self._conn.flush()

    async def send_message(self, payload: bytes) -> None:
        """Send one message, waiting for flow-control credit as needed."""
        limit = self._conn._config.max_message_bytes
        if len(payload) > limit:
            raise MessageTooLarge(f"message of {len(payload)} bytes exceeds the limit of {limit}")
        prefix = LENGTH_PREFIX.pack(len(payload))
        if len(payload) < self._conn._h2.max_outbound_frame_size:
            # one DATA frame, not two: a decode step's messages are this small, and each frame costs
            # about as much to send and to receive as its bytes do
            await self._send_bytes(prefix + payload)
        else:
            await self._send_bytes(prefix, payload)

    async def receive_headers(self) -> dict[str, str]:
        """Wait for the response headers (requesting side)."""
        while self.response_headers is None:
            self._raise_if_unreadable()
            if self._remote_ended:
                raise TransportError(f"peer {self.peer_id} ended stream {self.path!r} without response headers")
            await self._signal.wait()
        return self.response_headers

    async def receive_message(self) -> bytes | None:
        """The next message, or ``None`` when the peer has ended its side."""
        while True:
            self._raise_if_unreadable()
            if self._messages:
                message = self._messages.popleft()
                self._account()
                return message
            if self._inbound:
                data, flow_length = self._inbound.popleft()
                self._consumed(flow_length)
                try:
                    self._messages.extend(self._decoder.feed(data))
                    self._account()
                except FramingError as exc:
                    self._fail_framing(exc)
                    raise
                continue
            if self._remote_ended:
                try:
                    self._decoder.end()
                except FramingError as exc:
                    self._fail_framing(exc)
                    raise
                return None
            self._conn._raise_if_closed()
            await self._signal.wait()

    async def end(self) -> None:
        """Half-close: we send nothing more, the peer may go on sending."""
        async with self._send_lock:
            self._check_can_send()
            if not self._headers_sent:
                self._send_response_headers(200, None, end_stream=True)
            else:
                self._h2_call(self._conn._h2.end_stream, self.stream_id)
            self._local_ended = True
            self._maybe_forget()
        await self._conn.flush()

    async def reset(self, error_code: int = ErrorCodes.CANCEL) -> None:
        """Abort the stream in both directions with an HTTP/2 error code."""
        if self._reset is not None or (self._local_ended and self._remote_ended):
            return
        self._reset_now(error_code, "reset locally")
        with contextlib.suppress(TransportError):
            await self._conn.flush()

    async def aclose(self) -> None:
        """Reset the stream unless both sides already ended it."""
        if not (self._local_ended and self._remote_ended) and self._conn.is_alive:
            await self.reset(ErrorCodes.CANCEL)
        self._release()

    # -- internals ------------------------------------------------------------------------------

    async def _send_bytes(self, *parts: bytes) -> None:
        h2conn = self._conn._h2
        async with self._send_lock:
            self._check_can_send()
            if not self._headers_sent:
                self._send_response_headers(200, None)
            for part in parts:
                view = memoryview(part)
                offset = 0
                while offset < len(view):
                    self._check_can_send()
                    credit = min(h2conn.local_flow_control_window(self.stream_id), h2conn.max_outbound_frame_size)
                    if credit <= 0:
                        # Out of credit: push out what is queued, then wait for a WINDOW_UPDATE.
                        await self._conn.flush()
                        self._check_can_send()
                        if h2conn.local_flow_control_window(self.stream_id) <= 0:
                            await self._conn._changed.wait()
                        continue
                    size = min(credit, len(view) - offset)
                    self._h2_call(h2conn.send_data, self.stream_id, bytes(view[offset : offset + size]))
                    offset += size
        await self._conn.flush()

    def _send_response_headers(self, status: int, headers: dict[str, str] | None, *, end_stream: bool = False) -> None:
        response = [(":status", str(status))] + [(name.lower(), value) for name, value in (headers or {}).items()]
        self._h2_call(self._conn._h2.send_headers, self.stream_id, response, end_stream=end_stream)
        self._headers_sent = True
        self.response_headers = dict(response)

    def _h2_call(self, method: Callable[..., None], *args: object, **kwargs: object) -> None:
        try:
            method(*args, **kwargs)
        except h2.exceptions.StreamClosedError as exc:
            if self._reset is not None:
                raise self._reset from exc
            raise StreamReset(ErrorCodes.STREAM_CLOSED, "stream is closed") from exc
        except h2.exceptions.ProtocolError as exc:
            self._conn._raise_if_closed()
            raise TransportError(f"stream {self.path!r} to {self.peer_id}: {exc}") from exc

    def _check_can_send(self) -> None:
        self._conn._raise_if_closed()
        if self._reset is not None:
            raise self._reset
        if self._local_ended:
            raise TransportError(f"stream {self.path!r} was already ended on our side")

    def _raise_if_unreadable(self) -> None:
        if self._reset is not None and not self._readable_after_reset:
            raise self._reset

    def _consumed(self, flow_length: int) -> None:
        self._unacknowledged -= flow_length
        self._conn._acknowledge(self.stream_id, flow_length)

    def _release(self) -> None:
        """Hand back credit for data nobody will read and drop the stream from its connection."""
        pending = sum(length for _, length in self._inbound)
        self._inbound = deque((data, 0) for data, _ in self._inbound)
        if pending:
            self._consumed(pending)
        self._conn._forget(self)

    def _maybe_forget(self) -> None:
        if self._local_ended and self._remote_ended:
            self._release()

    def limit_messages(self, max_bytes: int) -> None:
        """Accept no message larger than ``max_bytes`` on this stream (below the transport's limit)."""
        self._decoder.max_message_bytes = min(self._decoder.max_message_bytes, max_bytes)

    def _account(self) -> None:
        """Update the connection's buffered bytes; over its budget, this stream is the one refused."""
        if self._buffered < 0:  # forgotten by its connection: what it still holds is the reader's
            return
        held = self._decoder.buffered_bytes + sum(len(m) for m in self._messages)
        self._conn.buffered_bytes += held - self._buffered
        self._buffered = held
        limit = self._conn._config.max_buffered_bytes
        if self._conn.buffered_bytes > limit:
            self._drop_buffered()
            self._messages.clear()
            self._decoder = MessageDecoder(self._decoder.max_message_bytes)
            self._conn.refusals["buffer_full"] = self._conn.refusals.get("buffer_full", 0) + 1
            raise BufferFull(f"peer {self.peer_id} has more than {limit} bytes of unread messages buffered here")

    def _drop_buffered(self) -> None:
        """Stop counting this stream against its connection (it failed, or the connection forgot it)."""
        self._conn.buffered_bytes -= max(0, self._buffered)
        self._buffered = -1

    def _fail_framing(self, exc: FramingError) -> None:
        logger.warning("bad framing on stream %s from %s, resetting it: %s", self.path, self.peer_id, exc)
        self._reset_now(exc.error_code, f"bad framing: {exc}")

    def _reset_now(self, error_code: int, reason: str) -> None:
        if self._reset is not None:
            return
        if self._conn.is_alive:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._conn._h2.reset_stream(self.stream_id, error_code)
            self._conn._kick()
        self._reset = StreamReset(error_code, reason)
        self._inbound.clear()
        self._release_credit_of_dropped()
        self._signal.fire()
        self._conn._forget(self)

    def _release_credit_of_dropped(self) -> None:
        if self._unacknowledged:
            self._conn._acknowledge(self.stream_id, self._unacknowledged)
            self._unacknowledged = 0

    async def _finish(self) -> None:
        """After the handler returns: end our side, and stop a peer that is still sending."""
        if self._reset is not None:
            return
        if not self._local_ended:
            await self.end()
        if not self._remote_ended:
            self._reset_now(ErrorCodes.NO_ERROR, "responder finished")
            await self._conn.flush()

    # -- events from the connection --------------------------------------------------------------

    def _on_data(self, data: bytes, flow_length: int) -> None:
        if self._reset is not None:
            self._conn._acknowledge(self.stream_id, flow_length)
            return
        self._inbound.append((data, flow_length))
        self._unacknowledged += flow_length
        self._signal.fire()

    def _on_response(self, headers: list[tuple[str, str]]) -> None:
        self.response_headers = dict(headers)
        self._signal.fire()

    def _on_remote_end(self) -> None:
        self._remote_ended = True
        self._signal.fire()
        self._maybe_forget()

    def _on_reset(self, error_code: int, reason: str) -> None:
        if self._reset is not None:
            return
        self._reset = StreamReset(error_code, reason)
        # RST_STREAM(NO_ERROR) after the peer's END_STREAM only means "stop sending": what it sent
        # before stays readable.
        self._readable_after_reset = self._remote_ended and error_code == ErrorCodes.NO_ERROR
        if not self._readable_after_reset:
            self._inbound.clear()
            self._release_credit_of_dropped()
        self._signal.fire()
        self._conn._forget(self)


def _text_headers(headers: object) -> list[tuple[str, str]]:
    """Header pairs as text: the connection is configured with ``header_encoding="utf-8"``, so h2
    hands out ``str``; anything else is decoded the same way."""
    out = []
    for name, value in headers or []:  # type: ignore[attr-defined]
        out.append((name.decode() if isinstance(name, bytes) else name,
                    value.decode() if isinstance(value, bytes) else value))
    return out
