"""What the planes above the transport need of it: message streams, and a way to open them.

The session and RPC planes are written against these protocols, not against :class:`Transport`, so
that they run unchanged over the real authenticated HTTP/2 transport and over the in-memory network
of the in-process tests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from meshd.address import Address


class MessageStream(Protocol):
    """A bidirectional stream of whole messages between two proven peers."""

    @property
    def peer_id(self) -> str:
        """The remote peer's proven identity."""
        ...

    @property
    def path(self) -> str:
        """What the opener asked for (``/meshd/seam``, ``/meshd/rpc`` ...)."""
        ...

    async def send_message(self, payload: bytes) -> None: ...

    async def receive_message(self) -> bytes | None:
        """The next message, or ``None`` once the remote side has ended its half cleanly."""
        ...

    async def end(self) -> None:
        """Half-close: this side sends nothing more."""
        ...

    def limit_messages(self, max_bytes: int) -> None:
        """Refuse (reset the stream on) any later message larger than ``max_bytes``."""
        ...

    async def reset(self, error_code: int = ...) -> None:
        """Abort both directions."""
        ...

    async def aclose(self) -> None:
        """Reset unless both sides already ended."""
        ...


StreamHandler = Callable[[MessageStream], Awaitable[None]]


class StreamOpener(Protocol):
    """Opens streams to peers by id and address; ``request`` is one message out, one back."""

    async def open_stream(self, peer_id: str | None, address: Address | str, path: str,
                          headers: dict[str, str] | None = None) -> MessageStream: ...

    async def request(self, peer_id: str | None, address: Address | str, path: str, body: bytes,
                      timeout: float = 30.0, headers: dict[str, str] | None = None) -> bytes: ...
