"""Peers in one process, joined by in-memory message streams: the transport of in-process tests, and
of a peer's streams to itself (:class:`~meshd.transport.transport.Transport` keeps a network of one).

:class:`MemoryNetwork` gives each joined peer a :class:`MemoryOpener` (a
:class:`~meshd.transport.streams.StreamOpener`) and runs the handler of the peer being dialled in
that peer's own nursery, exactly as the real transport runs one handler task per incoming stream.
Streams behave like the real ones where the planes above can tell: messages in order, a clean end
is ``None`` once read, a reset raises :class:`~meshd.transport.errors.StreamReset` on the other side,
the same message size limit applies, and a sender waits while its reader holds a stream window of
messages unread (a message goes whatever its size when nothing is unread). :meth:`MemoryNetwork.kill`
takes a peer off the network the way a dead process leaves it: its streams break at once, nothing it
still sends arrives, and dialling it fails. With Trio's ``MockClock`` the whole mesh then runs on a fake clock.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import trio
from h2.errors import ErrorCodes

from meshd.address import Address
from meshd.transport.config import TransportConfig
from meshd.transport.errors import MessageTooLarge, PeerAuthError, StreamReset, TransportError
from meshd.transport.framing import DEFAULT_MAX_MESSAGE_BYTES
from meshd.transport.streams import StreamHandler


@dataclass(frozen=True)
class _Reset:
    error_code: int


_END = None


@dataclass
class _Member:
    peer_id: str
    handler: StreamHandler
    nursery: trio.Nursery
    alive: bool = True
    streams: set[MemoryStream] = field(default_factory=set)


class MemoryStream:
    """One end of an in-memory stream; see :class:`~meshd.transport.streams.MessageStream`."""

    def __init__(self, network: MemoryNetwork, peer_id: str, path: str, owner: str,
                 inbox: trio.MemoryReceiveChannel[bytes | _Reset | None],
                 outbox: trio.MemorySendChannel[bytes | _Reset | None],
                 headers: dict[str, str] | None = None) -> None:
        self._network = network
        self.headers = headers or {}  # what the opener sent with it, as a real stream's request headers
        self._peer_id = peer_id
        self._path = path
        self.owner = owner
        self._inbox = inbox
        self._outbox = outbox
        self.other: MemoryStream | None = None
        self._local_ended = False
        self._remote_ended = False
        self._reset: StreamReset | None = None
        self._max_message_bytes: int | None = None
        self._unread = 0  # bytes of messages in this end's inbox
        self._read_some = trio.lowlevel.ParkingLot()  # the other end's sender, waiting for window

    @property
    def peer_id(self) -> str:
        return self._peer_id

    async def __aenter__(self) -> MemoryStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (message := await self.receive_message()) is not None:
            yield message

    @property
    def path(self) -> str:
        return self._path

    async def send_message(self, payload: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if len(payload) > self._network.max_message_bytes:
            raise MessageTooLarge(f"message of {len(payload)} bytes exceeds the limit of "
                                  f"{self._network.max_message_bytes}")
        self._raise_if_reset()
        if self._local_ended:
            raise TransportError(f"stream {self._path!r} to {self._peer_id} already ended")
        while (other := self.other) is not None and other.holds_a_window_with(len(payload)):
            await other._read_some.park()
            self._raise_if_reset()
        self._deliver(bytes(payload))

    def holds_a_window_with(self, size: int) -> bool:
        """Whether this end, still reading, would hold more than a stream window unread with ``size``
        bytes more."""
        return self._reset is None and self._unread > 0 and self._unread + size > self._network.stream_window

    async def receive_message(self) -> bytes | None:
        self._raise_if_reset()
        if self._remote_ended:
            await trio.lowlevel.checkpoint()
            return None
        try:
            item = await self._inbox.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            item = _END
        if isinstance(item, _Reset):
            self._reset = StreamReset(item.error_code, "reset by peer")
            self._forget()
            raise self._reset
        if item is _END:
            self._remote_ended = True
            self._maybe_forget()
            return None
        self._unread -= len(item)
        self._read_some.unpark_all()
        if self._max_message_bytes is not None and len(item) > self._max_message_bytes:
            self.break_now(ErrorCodes.FRAME_SIZE_ERROR, "message too large", notify=True)
            raise MessageTooLarge(f"a {len(item)}-byte message; this stream takes at most {self._max_message_bytes}")
        return item

    def limit_messages(self, max_bytes: int) -> None:
        self._max_message_bytes = max_bytes

    async def end(self) -> None:
        await trio.lowlevel.checkpoint()
        self._raise_if_reset()
        if not self._local_ended:
            self._local_ended = True
            self._deliver(_END)
            self._maybe_forget()

    async def reset(self, error_code: int = ErrorCodes.CANCEL) -> None:
        await trio.lowlevel.checkpoint()
        self.break_now(error_code, "reset locally", notify=True)

    async def aclose(self) -> None:
        if not (self._local_ended and self._remote_ended):
            await self.reset(ErrorCodes.CANCEL)

    async def finish(self) -> None:
        """After the handler of this end returns: end its side, and stop a dialler still sending."""
        if self._reset is not None:
            return
        if not self._local_ended:
            await self.end()
        if not self._remote_ended:
            self.break_now(ErrorCodes.NO_ERROR, "responder finished", notify=True)

    # -- internals ------------------------------------------------------------------------------

    def break_now(self, error_code: int, reason: str, *, notify: bool) -> None:
        """Fail this end; with ``notify`` the other end sees a reset (a peer that died says nothing,
        but its connection dropping resets every stream of it on the survivor's side)."""
        if self._reset is not None:
            return
        self._reset = StreamReset(error_code, reason)
        if notify:
            self._deliver(_Reset(error_code))
        self._read_some.unpark_all()  # a sender to this end stops waiting; its messages go nowhere
        if self.other is not None:
            self.other._read_some.unpark_all()  # this end's own send fails
        self._forget()

    def wake_other(self, item: _Reset) -> None:
        """Wake the other end if it is blocked reading (what a dropped connection does)."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._outbox.send_nowait(item)

    def _deliver(self, item: bytes | _Reset | None) -> None:
        other = self.other
        if other is None or not self._network.is_alive(self.owner):
            return  # a dead peer's last words never arrive
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._outbox.send_nowait(item)
            if isinstance(item, bytes):
                other._unread += len(item)

    def _raise_if_reset(self) -> None:
        if self._reset is not None:
            raise self._reset

    def _maybe_forget(self) -> None:
        if self._local_ended and self._remote_ended:
            self._forget()

    def _forget(self) -> None:
        self._network.forget(self)


class MemoryOpener:
    """One peer's way into the network: opens streams as that peer."""

    def __init__(self, network: MemoryNetwork, peer_id: str) -> None:
        self.network = network
        self.peer_id = peer_id

    async def open_stream(self, peer_id: str | None, address: Address | str, path: str,
                          headers: dict[str, str] | None = None) -> MemoryStream:
        await trio.lowlevel.checkpoint()
        return self.network.connect(self.peer_id, peer_id, Address.coerce(address), path, headers)

    async def request(self, peer_id: str | None, address: Address | str, path: str, body: bytes,
                      timeout: float = 30.0, headers: dict[str, str] | None = None) -> bytes:
        try:
            with trio.fail_after(timeout):
                stream = await self.open_stream(peer_id, address, path, headers)
                await stream.send_message(body)
                await stream.end()
                reply = await stream.receive_message()
                if reply is None:
                    raise TransportError(f"{path} on {stream.peer_id} ended the stream without a reply")
                return reply
        except trio.TooSlowError as exc:
            raise TransportError(f"request {path} to {peer_id or address} timed out after {timeout}s") from exc


class MemoryNetwork:
    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 stream_window: int = TransportConfig.stream_window) -> None:
        self.max_message_bytes = max_message_bytes
        self.stream_window = stream_window
        self._members: dict[str, _Member] = {}
        self._by_address: dict[Address, str] = {}

    def join(self, peer_id: str, address: Address | str, handler: StreamHandler,
             nursery: trio.Nursery) -> MemoryOpener:
        """Put a peer on the network at ``address``; its incoming streams run ``handler`` in ``nursery``."""
        self._members[peer_id] = _Member(peer_id, handler, nursery)
        self._by_address[Address.coerce(address)] = peer_id
        return MemoryOpener(self, peer_id)

    def is_alive(self, peer_id: str) -> bool:
        member = self._members.get(peer_id)
        return member is not None and member.alive

    def kill(self, peer_id: str) -> None:
        """The peer's process is gone: every stream of it breaks, and it cannot be dialled."""
        member = self._members[peer_id]
        member.alive = False
        for stream in list(member.streams):
            stream.break_now(ErrorCodes.CONNECT_ERROR, "this peer is dead", notify=False)
            survivor = stream.other
            if survivor is not None:
                survivor.break_now(ErrorCodes.CONNECT_ERROR, f"the connection to {peer_id} dropped", notify=False)
                stream.wake_other(_Reset(ErrorCodes.CONNECT_ERROR))

    def revive(self, peer_id: str, handler: StreamHandler | None = None, nursery: trio.Nursery | None = None) -> None:
        member = self._members[peer_id]
        member.alive = True
        if handler is not None:
            member.handler = handler
        if nursery is not None:
            member.nursery = nursery

    def connect(self, dialler: str, expected: str | None, address: Address, path: str,
                headers: dict[str, str] | None = None) -> MemoryStream:
        if not self.is_alive(dialler):
            raise TransportError(f"{dialler} is not on the network")
        target_id = self._by_address.get(address.endpoint if not address.relay else address)
        target = self._members.get(target_id) if target_id is not None else None
        if target is None or not target.alive:
            raise TransportError(f"cannot connect to {address}: nobody answers there")
        if expected is not None and expected != target.peer_id:
            raise PeerAuthError(f"{address} proved identity {target.peer_id}, expected {expected}")
        to_target, target_inbox = trio.open_memory_channel[bytes | _Reset | None](math.inf)
        to_dialler, dialler_inbox = trio.open_memory_channel[bytes | _Reset | None](math.inf)
        near = MemoryStream(self, target.peer_id, path, dialler, dialler_inbox, to_target)
        far = MemoryStream(self, dialler, path, target.peer_id, target_inbox, to_dialler, headers)
        near.other, far.other = far, near
        self._members[dialler].streams.add(near)
        target.streams.add(far)
        target.nursery.start_soon(target.handler, far)
        return near

    def forget(self, stream: MemoryStream) -> None:
        member = self._members.get(stream.owner)
        if member is not None:
            member.streams.discard(stream)
