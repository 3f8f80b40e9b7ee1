"""Build and parse the messages that travel on seam streams."""

from __future__ import annotations

import contextlib

import trio
from google.protobuf.message import DecodeError

from meshd.errors import BundleError, ErrorCode, MeshError
from meshd.transport.streams import MessageStream
from meshd.wire import bundle as wire
from meshd.wire import session_pb2 as pb
from meshd.wire.bundle import HiddenStateBundle

SEAM_PATH = "/meshd/seam"
RESULTS_PATH = "/meshd/results"


def parse(raw: bytes) -> pb.SeamMessage:
    msg = pb.SeamMessage()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise BundleError(f"seam message does not parse: {exc}") from None
    if msg.WhichOneof("kind") is None:
        raise BundleError("seam message carries nothing")
    return msg


def seam_bundle(msg: pb.SeamMessage) -> HiddenStateBundle | None:
    """What a hop's upstream sent: a bundle, or None when the entry closes the session."""
    kind = msg.WhichOneof("kind")
    if kind == "close":
        return None
    if kind != "bundle":
        raise BundleError(f"unexpected {kind!r} message on a seam")
    return wire.decode(msg.bundle)


def bundle_msg(encoded: bytes) -> bytes:
    return pb.SeamMessage(bundle=encoded).SerializeToString()


def token_msg(position: int, token: int, logprob: float | None = None,
              top: list[tuple[int, float]] | None = None) -> bytes:
    result = pb.TokenResult(position=position, token=token)
    if logprob is not None:
        result.has_logprob = True
        result.logprob = logprob
        result.top.extend(pb.TokenLogprob(token=t, logprob=lp) for t, lp in top or [])
    return pb.SeamMessage(token=result).SerializeToString()


def error_msg(code: ErrorCode, message: str, peer_id: str) -> bytes:
    return pb.SeamMessage(error=pb.SessionError(code=code.value, message=message, peer_id=peer_id)).SerializeToString()


def error_from(exc: Exception, peer_id: str) -> bytes:
    code = exc.code if isinstance(exc, MeshError) else ErrorCode.INTERNAL_ERROR
    return error_msg(code, str(exc), peer_id)


READY = pb.SeamMessage(ready=pb.Ready()).SerializeToString()
CLOSE = pb.SeamMessage(close=pb.Close()).SerializeToString()


def open_msg(open_: pb.SessionOpen) -> bytes:
    return pb.SeamMessage(open=open_).SerializeToString()


async def finish_stream(stream: MessageStream, last_message: bytes | None = None, linger_s: float = 1.0) -> None:
    """End a stream we opened without aborting it: send ``last_message``, half-close, give the peer
    ``linger_s`` to end its side (so it reads everything first), then close. Never raises; runs
    shielded so that a cancelled session still says goodbye to its hops."""
    with trio.move_on_after(linger_s + 1) as scope:
        scope.shield = True
        with contextlib.suppress(Exception):
            if last_message is not None:
                await stream.send_message(last_message)
            await stream.end()
            with trio.move_on_after(linger_s):
                while await stream.receive_message() is not None:
                    pass
        with contextlib.suppress(Exception):
            await stream.aclose()


async def end_quietly(stream: MessageStream) -> None:
    """Half-close a stream we answer: what we sent stays readable for the requester."""
    with trio.move_on_after(2), contextlib.suppress(Exception):
        await stream.end()
