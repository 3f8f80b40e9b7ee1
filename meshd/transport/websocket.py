"""A WebSocket connection seen as a Trio byte stream, so TLS and HTTP/2 can run inside it.

The relay carries a peer link as binary WebSocket messages. ``WebSocketStream`` turns that back
into bytes in, bytes out (``trio.abc.Stream``): ``send_all`` cuts its data into messages of at
most ``max_chunk`` bytes, ``receive_some`` hands out received messages, splitting them when the
caller asks for fewer bytes. Message boundaries carry no meaning. A WebSocket closed by the other
side reads as end of stream; a close with a code of 4000 or above (the relay refusing something)
raises ``trio.BrokenResourceError`` naming the relay's reason.
"""

from __future__ import annotations

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

DEFAULT_MAX_CHUNK = 64 * 1024
NORMAL_CLOSE_CODES = (1000, 1001, 1005, 1006)


def close_description(exc: ConnectionClosed) -> tuple[int | None, str]:
    """The close code and reason of a closed WebSocket, ``(None, "")`` when it gave none."""
    reason = exc.reason
    if reason is None:
        return None, ""
    return reason.code, reason.reason or reason.name


class WebSocketStream(trio.abc.Stream):
    """Bytes over a ``trio_websocket.WebSocketConnection``; closing the stream closes the WebSocket."""

    def __init__(self, ws: WebSocketConnection, *, max_chunk: int = DEFAULT_MAX_CHUNK) -> None:
        self.ws = ws
        self.max_chunk = max_chunk
        self._pending = memoryview(b"")
        self._send_lock = trio.StrictFIFOLock()
        self._eof = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        async with self._send_lock:
            try:
                for offset in range(0, len(view), self.max_chunk):
                    await self.ws.send_message(bytes(view[offset : offset + self.max_chunk]))
            except ConnectionClosed as exc:
                code, reason = close_description(exc)
                raise trio.BrokenResourceError(f"WebSocket closed ({code}: {reason})") from exc

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._pending:
            if self._eof:
                await trio.lowlevel.checkpoint()
                return b""
            try:
                message = await self.ws.get_message()
            except ConnectionClosed as exc:
                code, reason = close_description(exc)
                if code is not None and code >= 4000:
                    raise trio.BrokenResourceError(f"relay closed the link: {reason}") from exc
                self._eof = True
                return b""
            if isinstance(message, str):
                raise trio.BrokenResourceError("text message on a byte stream")
            self._pending = memoryview(message)
        size = len(self._pending) if max_bytes is None else max(1, max_bytes)
        chunk, self._pending = self._pending[:size], self._pending[size:]
        return bytes(chunk)

    async def aclose(self) -> None:
        await self.ws.aclose()
