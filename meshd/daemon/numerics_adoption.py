"""Peers that measured different numerics classes for one model settle on one of them.

A peer measures its numerics class when it starts (:mod:`meshd.runtime.numerics`). Peers of one
machine kind usually choose alike, but not always, and peers in different classes never share a
route: three peers holding a third of the model each then serve nothing. So for a while after it
starts, a peer whose class was measured (not given with ``--numerics``) takes the class of the peer
that has computed the same model in its own class the longest, as its card says
(``class_since_ms``), when it can compute that class exactly as that peer does. The earliest peer
has no one to follow, and a peer that adopts its class starts its own time in it anew, so the mesh
settles on one class whatever order the cards arrive in, and a peer already serving when another
starts is the one followed. A peer waits while it holds sessions or loads its range, and never
moves after the window: an old mesh is not reshuffled by a newcomer whose clock runs late.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

from meshd.errors import ModelFormatError
from meshd.wire import card_pb2 as cpb

log = logging.getLogger("meshd.peer")

ADOPTION_WINDOW_S = 120.0  # how long after starting a peer may still take another's class
CHECK_INTERVAL_S = 1.0
FIRST_LOOK_S = 5.0  # how long a peer waits for other peers' cards before it loads a range


@dataclass(frozen=True)
class ClassHolder:
    """A peer computing a model in a numerics class since ``since_ms`` (its wall clock)."""

    peer_id: str
    model_id: str
    numerics: str
    compat_key: str
    since_ms: int

    @property
    def order(self) -> tuple[int, str]:
        return self.since_ms, self.peer_id


def holders_of(cards: Iterable[cpb.CapabilityCard], model_id: str) -> list[ClassHolder]:
    """The peers whose cards compute ``model_id`` with torch in a class they say since when, earliest first."""
    holders = [ClassHolder(card.peer_id, m.model_id, m.numerics, m.compat_key, m.class_since_ms)
               for card in cards for m in card.models
               if m.model_id == model_id and m.numerics and m.compat_key and m.class_since_ms > 0
               and m.backend in ("", "torch") and not m.shard_error]
    return sorted(holders, key=lambda h: h.order)


def to_follow(own: ClassHolder, holders: Iterable[ClassHolder],
              refused: Iterable[tuple[str, str]] = ()) -> list[ClassHolder]:
    """The peers ahead of ``own`` whose class this peer would take, earliest first, up to the first in
    its own class (nothing is ahead of that one worth leaving it for); ``refused``: the (class, compat
    key) pairs found not computable here, passed over."""
    skip = set(refused)
    ahead = []
    for holder in holders:
        if holder.order >= own.order or holder.numerics == own.numerics:
            break
        if (holder.numerics, holder.compat_key) not in skip and holder.peer_id != own.peer_id:
            ahead.append(holder)
    return ahead


T = TypeVar("T")


class NumericsAdoption(Generic[T]):
    """Watches the cards for :data:`ADOPTION_WINDOW_S` after the peer starts and takes the class of the
    longest-computing peer it can follow: ``check(holder)`` says what taking ``holder``'s class needs
    here (raising :class:`ModelFormatError` when this peer cannot compute that class as the holder
    does), ``adopt(that, holder)`` takes it, ``idle()`` says whether the peer may change its class now."""

    def __init__(self, own: Callable[[], ClassHolder | None], cards: Callable[[], Iterable[cpb.CapabilityCard]],
                 check: Callable[[ClassHolder], Awaitable[T]], adopt: Callable[[T, ClassHolder], Awaitable[None]],
                 idle: Callable[[], bool], window_s: float = ADOPTION_WINDOW_S,
                 interval_s: float = CHECK_INTERVAL_S) -> None:
        self.own, self.cards, self.check, self.adopt, self.idle = own, cards, check, adopt, idle
        self.window_s, self.interval_s = window_s, interval_s
        self.refused: dict[tuple[str, str], str] = {}  # (class, compat key) -> why it cannot compute here
        self.adopted: list[str] = []  # the classes taken, in turn
        self._looking = trio.Lock()  # one look at a time: two would both take the class
        self._until: float | None = None  # the window's end (Trio's clock), once the watch runs

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._until = trio.current_time() + self.window_s
        task_status.started()
        while trio.current_time() < self._until:
            await trio.sleep(self.interval_s)
            await self.step()

    async def first_look(self, others_known: Callable[[], bool], timeout_s: float = FIRST_LOOK_S) -> None:
        """One look once ``others_known()`` says cards of other peers have come (at most ``timeout_s``
        later): taken before a range loads, so that a peer which takes another's class loads its range
        once, in that class."""
        with trio.move_on_after(timeout_s):
            while not others_known():
                await trio.sleep(0.1)
        await self.step()

    async def step(self) -> None:
        """Adopt the class of the first peer to follow that this peer can compute as, if any, while idle and
        within the window (a load long after the start, a range placed anew, moves nothing)."""
        if self._until is not None and trio.current_time() >= self._until:
            return
        async with self._looking:
            await self._look()

    async def _look(self) -> None:
        own = self.own()
        if own is None or not self.idle():
            return
        for holder in to_follow(own, holders_of(self.cards(), own.model_id), self.refused):
            try:
                adoption = await self.check(holder)
            except ModelFormatError as exc:
                self.refused[(holder.numerics, holder.compat_key)] = str(exc)
                log.warning("not taking numerics class %s of peer %s: %s", holder.numerics, holder.peer_id[:8], exc)
                continue
            if self.own() != own or not self.idle():
                return  # it changed meanwhile: look again next time
            log.warning("taking numerics class %s of peer %s, which has computed %s in it %.1f s longer than this "
                        "peer in the class it measured, %s", holder.numerics, holder.peer_id[:8], own.model_id,
                        (own.since_ms - holder.since_ms) / 1000, own.numerics)
            await self.adopt(adoption, holder)
            self.adopted.append(holder.numerics)
            return
