"""Peer RPC: one ``PeerRequest`` out, one ``PeerReply`` back, dispatched by the kind of request.

Every request between peers that is not part of a session (gossip, routes, placement orders, model
files, dial-back tests) travels on its own ``/meshd/rpc`` stream as protobuf. The responder keeps a
table of handlers keyed by the request body's kind; a handler gets the proven sender and the body,
and returns the reply body. A refusal is a :class:`~meshd.errors.MeshError`, answered as an
``RpcError`` with its code; the caller gets it back as :class:`RpcFailed` with the same code, so no
side ever compares prose. Each peer may send each kind of request at a bounded rate
(:data:`RATE_LIMITS`, per sender); above it the request is answered ``RATE_LIMITED`` without reaching
its handler, so one flooding peer costs the others nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import trio
from google.protobuf.message import DecodeError, Message

from meshd.address import Address
from meshd.errors import ErrorCode, MeshError, RemoteError
from meshd.limits import KeyedRates
from meshd.transport.errors import TransportError
from meshd.transport.streams import MessageStream, StreamOpener
from meshd.wire import rpc_pb2 as pb

log = logging.getLogger("meshd.rpc")
T = TypeVar("T")

RPC_PATH = "/meshd/rpc"
REQUEST_WAIT_S = 10.0  # how long a requester may take to send its one request
# Requests one peer may send another, per kind: (per second, burst). Well above what the protocol
# needs (gossip: a few messages a second from any one peer; chunks: a fetch's requests in flight),
# so that only a peer that floods is refused.
RATE_LIMITS: dict[str, tuple[float, float]] = {
    "gossip": (50.0, 200.0), "route": (100.0, 400.0), "placement": (10.0, 40.0), "model_files": (10.0, 40.0),
    "dialback": (2.0, 10.0), "manifest": (5.0, 20.0), "chunk": (500.0, 1000.0), "join": (1.0, 5.0),
    "speed_check": (2.0, 32.0), "trace": (1.0, 8.0), "prefix_probe": (100.0, 400.0),
    "kv_put": (500.0, 1000.0), "kv_get": (500.0, 1000.0),
}
MAX_SENDERS = 10_000  # senders whose rates are tracked; the longest unheard are forgotten first
MAX_IN_FLIGHT = 32  # requests one sender may have this peer working on at once; more are reset unread
MAX_REQUEST_BYTES = 8 * 1024 * 1024  # a push-pull carrying a full card store is about half of this
MAX_OUTSIDER_REQUEST_BYTES = 64 * 1024  # from a peer not (yet) admitted to a private mesh: an invite fits

Handler = Callable[[str, Any], Awaitable[Message]]
"""``handler(sender peer id, request body) -> reply body`` (a message that fits ``PeerReply.body``)."""
Admit = Callable[[str, str], None]
"""``admit(sender, kind)`` raises a :class:`MeshError` when the sender may not ask this at all."""

_REPLY_FIELDS = {field.message_type.full_name: field.name
                 for field in pb.PeerReply.DESCRIPTOR.oneofs_by_name["body"].fields if field.message_type is not None}
REQUEST_KINDS = tuple(field.name for field in pb.PeerRequest.DESCRIPTOR.oneofs_by_name["body"].fields)


class RpcFailed(RemoteError):
    """The peer answered with an error, or could not be asked at all (``UNREACHABLE``)."""


def reply_of(body: Message) -> pb.PeerReply:
    """Wrap a reply body (``RouteReply``, ``Accepted`` ...) in a ``PeerReply``."""
    field = _REPLY_FIELDS.get(body.DESCRIPTOR.full_name)
    if field is None:
        raise TypeError(f"{body.DESCRIPTOR.full_name} is not a kind of PeerReply")
    reply = pb.PeerReply()
    getattr(reply, field).CopyFrom(body)
    return reply


def error_reply(code: ErrorCode, message: str) -> pb.PeerReply:
    return pb.PeerReply(error=pb.RpcError(code=code.value, message=message))


class RpcRouter:
    """The responder's table of handlers, one per kind of ``PeerRequest``."""

    def __init__(self, limits: dict[str, tuple[float, float]] | None = None,
                 clock: Callable[[], float] = time.monotonic, admit: Admit | None = None,
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        self._handlers: dict[str, Handler] = {}
        self.admit = admit
        self.on_refused = on_refused
        self.served: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self.rate_limited: dict[str, int] = {}
        self.limits = RATE_LIMITS if limits is None else limits
        self.clock = clock
        self._rates = {kind: KeyedRates(rate, burst, MAX_SENDERS) for kind, (rate, burst) in self.limits.items()}
        self._in_flight: dict[str, int] = {}

    def _allowed(self, sender: str, kind: str) -> bool:
        rates = self._rates.get(kind)
        return rates is None or rates.allow(sender, self.clock())

    def register(self, kind: str, handler: Handler) -> None:
        if kind not in REQUEST_KINDS:
            raise ValueError(f"{kind!r} is not a kind of PeerRequest ({', '.join(REQUEST_KINDS)})")
        if kind in self._handlers:
            raise ValueError(f"a handler for {kind!r} is already registered")
        self._handlers[kind] = handler

    async def dispatch(self, sender: str, request: pb.PeerRequest) -> pb.PeerReply:
        """The reply to one request; never raises for anything the request or its handler did."""
        kind = request.WhichOneof("body")
        handler = self._handlers.get(kind) if kind is not None else None
        if handler is None:
            self.refused[str(kind)] = self.refused.get(str(kind), 0) + 1
            return error_reply(ErrorCode.BAD_REQUEST, f"this peer does not answer {kind!r} requests")
        if not self._allowed(sender, kind):
            self.rate_limited[kind] = self.rate_limited.get(kind, 0) + 1
            log.debug("%s request from %s refused: over its rate", kind, sender[:12])
            return self._refusal(kind, ErrorCode.RATE_LIMITED, f"too many {kind} requests from this peer; slow down")
        body = getattr(request, kind)
        try:
            if self.admit is not None:
                self.admit(sender, kind)
            reply = reply_of(await handler(sender, body))
        except MeshError as exc:
            log.info("%s request from %s refused: %s", kind, sender[:12], exc)
            self.refused[kind] = self.refused.get(kind, 0) + 1
            return self._refusal(kind, exc.code, str(exc))
        except Exception:
            log.exception("%s request from %s failed", kind, sender[:12])
            self.refused[kind] = self.refused.get(kind, 0) + 1
            return self._refusal(kind, ErrorCode.INTERNAL_ERROR, f"{kind} failed on this peer")
        self.served[kind] = self.served.get(kind, 0) + 1
        return reply

    def _refusal(self, kind: str, code: ErrorCode, message: str) -> pb.PeerReply:
        if self.on_refused is not None:
            self.on_refused(kind, code.value)
        return error_reply(code, message)

    async def serve(self, stream: MessageStream) -> None:
        """Answer the one request on ``stream``; a stream that is not exactly one message is reset, and
        so is one from a sender that has :data:`MAX_IN_FLIGHT` requests in progress already."""
        sender = stream.peer_id
        if self._in_flight.get(sender, 0) >= MAX_IN_FLIGHT:
            self.rate_limited["in_flight"] = self.rate_limited.get("in_flight", 0) + 1
            if self.on_refused is not None:
                self.on_refused("in_flight", ErrorCode.RATE_LIMITED.value)
            await stream.reset()
            return
        self._in_flight[sender] = self._in_flight.get(sender, 0) + 1
        try:
            await self._serve(stream)
        finally:
            left = self._in_flight.pop(sender) - 1
            if left:
                self._in_flight[sender] = left

    async def _serve(self, stream: MessageStream) -> None:
        with trio.move_on_after(REQUEST_WAIT_S):
            body = await stream.receive_message()
            # The requester ends its side right after its one message; wait for that before replying,
            # so that finishing this handler never has to reset a stream the peer is still closing.
            extra = await stream.receive_message() if body is not None else None
            if body is not None and extra is None:
                request = pb.PeerRequest()
                try:
                    request.ParseFromString(body)
                except DecodeError:
                    reply = error_reply(ErrorCode.BAD_REQUEST, "the request does not parse as a PeerRequest")
                else:
                    reply = await self.dispatch(stream.peer_id, request)
                await stream.send_message(reply.SerializeToString())
                await stream.end()
                return
        await stream.reset()


class NoSourceAnswered(MeshError):
    """Every peer asked refused, failed, or answered something that did not check out."""

    code = ErrorCode.NO_ROUTE


async def ask_in_turn(opener: StreamOpener, sources: Iterable[tuple[str | None, str]], request: pb.PeerRequest,
                      kind: str, check: Callable[[Any], T], timeout: float, what: str) -> tuple[str | None, T]:
    """Ask each (peer id, address) in turn for ``kind``; the first peer whose reply ``check`` accepts
    (it returns the checked value, or raises a :class:`MeshError` to refuse it) and that value. A
    peer id None accepts whoever answers at the address."""
    last: Exception | None = None
    for peer_id, address in sources:
        try:
            reply = await call(opener, peer_id, address, request, timeout=timeout)
            if reply.WhichOneof("body") != kind:
                raise RpcFailed(ErrorCode.PROTOCOL, f"answered {reply.WhichOneof('body')!r}", peer_id or "")
            return peer_id, check(getattr(reply, kind))
        except MeshError as exc:
            log.warning("%s from %s refused: %s", what, (peer_id or address)[:24], exc)
            last = exc
    raise NoSourceAnswered(f"no peer handed out {what}" + (f"; the last said: {last}" if last else "")) from last


async def call(opener: StreamOpener, peer_id: str | None, address: Address | str, request: pb.PeerRequest,
               timeout: float) -> pb.PeerReply:
    """Ask one peer; the reply's body, or :class:`RpcFailed` (the peer's error, or ``UNREACHABLE``)."""
    target = peer_id or str(address)
    try:
        raw = await opener.request(peer_id, address, RPC_PATH, request.SerializeToString(), timeout=timeout)
    except (TransportError, OSError, trio.BrokenResourceError) as exc:
        raise RpcFailed(ErrorCode.UNREACHABLE, f"cannot ask {target[:12]}: {exc}", peer_id or "") from exc
    reply = pb.PeerReply()
    try:
        reply.ParseFromString(raw)
    except DecodeError:
        raise RpcFailed(ErrorCode.PROTOCOL, "the reply does not parse as a PeerReply", peer_id or "") from None
    if reply.WhichOneof("body") == "error":
        raise RpcFailed(ErrorCode.parse(reply.error.code), reply.error.message, peer_id or "")
    if reply.WhichOneof("body") is None:
        raise RpcFailed(ErrorCode.PROTOCOL, "the reply carries nothing", peer_id or "")
    return reply
