"""How others reach this peer: direct address, relays, and the dial-back test that picks between them.

``reachability`` (config) decides what the card advertises:

- ``direct``: the advertised address, always; no relay registrations.
- ``relayed``: no direct address; the peer stays registered with its ``relays`` and advertises
  ``relay:HOST:PORT`` for each relay it is registered with right now.
- ``auto``: the peer asks up to ``DIALBACK_HELPERS`` other peers to dial its advertised address
  back (a ``dialback`` peer RPC; each helper opens a fresh transport connection and checks that the
  answer proves this peer's id). The direct address goes into the card only once a helper got
  through; until then, and after every helper failed, the peer is reached through its relays. The
  test repeats every ``reachability_interval_s``. With no relays configured there is nothing to fall
  back on, so the direct address is advertised regardless and the result is only reported.

Dialers pick a card's direct address when it has one, else a relay address
(``meshd.tracker.view.dial_address``);
the transport replaces a live relayed connection as soon as a direct address is known.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import trio

from meshd.address import Address, AddressError
from meshd.daemon.config import PeerConfig
from meshd.errors import ErrorCode, MeshError
from meshd.identity import Identity
from meshd.limits import remember
from meshd.rpc import RpcFailed, call
from meshd.transport import StreamHandler, Transport
from meshd.transport.relay import RelayRegistration
from meshd.transport.websocket import WebSocketStream
from meshd.wire import rpc_pb2 as rpb

log = logging.getLogger("meshd.reachability")

DIALBACK_HELPERS = 3
DIALBACK_TIMEOUT_S = 5.0
DIALBACK_MIN_INTERVAL_S = 2.0  # per asking peer: a helper is not a free port scanner
DIALBACK_ASKERS_KEPT = 4096  # peers whose last dial-back request is remembered, the latest
FIRST_CHECK_DELAY_S = 0.5

Helpers = Callable[[], list[tuple[str, str]]]  # (peer id, address) of live peers that can be asked


class DialbackRefused(MeshError):
    """A dial-back request this peer will not serve (a relay address, or asked too often)."""

    code = ErrorCode.BAD_REQUEST


class Reachability:
    """Keeps the relay registrations up and decides, by dial-back tests, what the card advertises.

    ``advertised`` gives the address this peer tells others to dial (known once its listener is bound).
    """

    def __init__(self, config: PeerConfig, transport: Transport, identity: Identity,
                 advertised: Callable[[], str], on_change: Callable[[], None],
                 membership: Callable[[], bytes] | None = None) -> None:
        """``membership``: this peer's serialized credential (in a private mesh), shown to relays."""
        self.config = config
        self.transport = transport
        self.identity = identity
        self.advertised = advertised
        self.on_change = on_change
        self.mode = config.reachability
        self.registrations = [] if self.mode == "direct" else [
            RelayRegistration(identity, relay, self._on_circuit, on_change, membership=membership)
            for relay in config.relays
        ]
        self.dialable: bool | None = None  # last dial-back verdict; None until one came back
        self.last_check: dict[str, object] = {}
        self._handler: StreamHandler | None = None
        self._asked_at: dict[str, float] = {}

    # -- what the card says ------------------------------------------------------------------------

    def direct_addresses(self) -> list[str]:
        advertised = self.advertised()
        if self.mode == "direct" or (self.mode == "auto" and not self.registrations):
            return [advertised]
        if self.mode == "auto" and self.dialable:
            return [advertised]
        return []

    def relay_addresses(self) -> list[str]:
        return [r.address for r in self.registrations if r.registered]

    def status(self) -> dict:
        return {
            "mode": self.mode, "dialable": self.dialable, "advertised": self.direct_addresses(),
            "relays": [{"relay": r.address, "registered": r.registered, "registrations": r.registrations,
                        "last_error": r.last_error} for r in self.registrations],
            "last_check": self.last_check,
        }

    # -- running -----------------------------------------------------------------------------------

    async def run(self, handler: StreamHandler, helpers: Helpers) -> None:
        """Keep relay registrations up and, in ``auto`` mode, re-test dialability; runs until cancelled."""
        self._handler = handler
        async with trio.open_nursery() as nursery:
            for registration in self.registrations:
                nursery.start_soon(registration.run)
            if self.mode == "auto":
                nursery.start_soon(self._check_loop, helpers)

    async def _on_circuit(self, stream: WebSocketStream, remote: str) -> None:
        assert self._handler is not None
        await self.transport.accept_stream(stream, self._handler, remote)

    async def _check_loop(self, helpers: Helpers) -> None:
        await trio.sleep(FIRST_CHECK_DELAY_S)
        while True:
            candidates = [h for h in helpers() if h[0] != self.identity.peer_id]
            verdict = await self.check(candidates) if candidates else None
            if verdict is not None and verdict != self.dialable:
                log.info("dial-back: %s is %s", self.advertised(),
                         "dialable" if verdict else "NOT dialable by other peers")
                self.dialable = verdict
                self.on_change()
            await trio.sleep(self.config.reachability_interval_s if verdict is not None else 1.0)

    async def check(self, candidates: list[tuple[str, str]]) -> bool | None:
        """Ask a few peers to dial us back: True if any got through, False if all answered no,
        None if none answered at all."""
        chosen = random.sample(candidates, min(DIALBACK_HELPERS, len(candidates)))
        answers: dict[str, rpb.DialbackReply] = {}

        async def ask(peer_id: str, address: str) -> None:
            request = rpb.PeerRequest(dialback=rpb.DialbackRequest(address=self.advertised()))
            try:
                reply = await call(self.transport, peer_id, address, request, timeout=DIALBACK_TIMEOUT_S + 2)
            except RpcFailed as exc:
                log.debug("dial-back request to %s failed: %s", peer_id[:12], exc)
                return
            if reply.WhichOneof("body") == "dialback":
                answers[peer_id] = reply.dialback

        async with trio.open_nursery() as nursery:
            for peer_id, address in chosen:
                nursery.start_soon(ask, peer_id, address)
        self.last_check = {"at": round(time.time(), 1), "asked": [p[:12] for p, _ in chosen],
                           "answers": {p[:12]: {"dialable": a.dialable, "error": a.error or None}
                                       for p, a in answers.items()}}
        if not answers:
            return None
        return any(a.dialable for a in answers.values())

    async def serve_dialback(self, sender: str, request: rpb.DialbackRequest) -> rpb.DialbackReply:
        """Dial the requester's address afresh and check that ``sender`` answers there."""
        try:
            address = Address.parse(request.address)
        except AddressError as exc:
            raise DialbackRefused(f"dial-back needs a direct HOST:PORT address: {exc}") from None
        if address.relay:
            raise DialbackRefused("dial-back needs a direct HOST:PORT address, not a relay address")
        now = time.monotonic()
        if now - self._asked_at.get(sender, -DIALBACK_MIN_INTERVAL_S) < DIALBACK_MIN_INTERVAL_S:
            raise DialbackRefused("dial-back asked too often")
        remember(self._asked_at, sender, now, DIALBACK_ASKERS_KEPT)
        error = await self.transport.check_dialable(sender, address, timeout=DIALBACK_TIMEOUT_S)
        return rpb.DialbackReply(dialable=error is None, error=error or "")
