"""``ShapedStream``: a Trio byte stream whose sends travel a modelled link (the Trio adapter of
:class:`~meshd.links.shaper.Shaper`).

``send_all`` hands the bytes to the shaper and returns once they are accepted; it waits while the
link's backlog is full, so a fast sender is held back as by a full socket buffer, never buffered
without bound. One pump task, in a nursery the caller owns, writes each chunk to the wrapped stream
when it is due. Receiving passes straight through: each side shapes what it sends.

``stop_shaping`` turns a connection that crosses no link (a peer's connection to itself) into a
plain pass-through, once what it has queued has gone out.

Closing with ``aclose`` flushes what is queued (at most until it is due, plus a second) and then
closes the wrapped stream; a cancelled close (``trio.aclose_forcefully``) drops it at once. A
``send_all`` cancelled part way has queued a prefix of its data and nothing after it, so the bytes
that do go out are always in order.

Timing: Trio's timers wake at whole milliseconds (epoll's resolution), too coarse for a 0.5 ms LAN.
The pump sleeps until a millisecond before a chunk is due and yields (``trio.sleep(0)``) for the
rest, which keeps releases within tens of microseconds of their time for at most a millisecond of
busy waiting per release.
"""

from __future__ import annotations

import logging

import trio

from meshd.links.profiles import LinkShape
from meshd.links.shaper import Shaper

logger = logging.getLogger("meshd.links")

TIMER_RESOLUTION_S = 0.001
FLUSH_GRACE_S = 1.0


class ShapedStream(trio.abc.Stream):
    """Wraps ``inner``; ``nursery`` runs the pump until the stream is closed or the link fails."""

    def __init__(self, inner: trio.abc.Stream, shape: LinkShape, nursery: trio.Nursery, *, seed: int = 0,
                 backlog_bytes: int | None = None, spin_s: float = TIMER_RESOLUTION_S) -> None:
        self.inner = inner
        self.shaper = Shaper(shape, seed=seed, backlog_bytes=backlog_bytes)
        self._spin_s = spin_s
        self._queued = trio.Event()  # something was queued since the pump last looked
        self._stopped = trio.Event()  # closed, or the wrapped stream failed: sends fail from now on
        self._pump_done = trio.Event()
        self._pump_scope = trio.CancelScope()
        self._closing = False
        self._direct = False
        self._failure: BaseException | None = None
        self._sending = False
        nursery.start_soon(self._pump)

    @property
    def shape(self) -> LinkShape:
        return self.shaper.shape

    def stop_shaping(self) -> None:
        """Send straight through from now on; bytes already queued still go first."""
        self._direct = True
        self._queued.set()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this stream")
        self._sending = True
        try:
            if self._direct:
                await self._pump_done.wait()  # the pump has sent what was queued, and stopped
                self._raise_if_stopped()
                await self.inner.send_all(data)
                return
            view = memoryview(data).cast("B")
            while True:
                self._raise_if_stopped()
                now = trio.current_time()
                want = min(len(view), self.shaper.segment_bytes, self.shaper.backlog_bytes)
                room = self.shaper.room(now)
                if view and room >= want:
                    taken = min(room, len(view))
                    self.shaper.send(view[:taken], now)
                    self._queued.set()
                    view = view[taken:]
                if not view:
                    break
                with trio.move_on_at(self.shaper.ready_at(want)):
                    await self._stopped.wait()
            await trio.lowlevel.checkpoint()
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        if self._direct:
            await self._pump_done.wait()
            self._raise_if_stopped()
            await self.inner.wait_send_all_might_not_block()
            return
        while not self._stopped.is_set() and not self.shaper.room(trio.current_time()):
            with trio.move_on_at(self.shaper.ready_at(1)):
                await self._stopped.wait()
        self._raise_if_stopped()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        try:
            if not self._closing:
                self._closing = True
                self._queued.set()
                # the pump ends once it has written everything queued (and whatever it is writing now)
                with trio.move_on_at(max(self.shaper.last_release, trio.current_time()) + FLUSH_GRACE_S):
                    await self._pump_done.wait()
        finally:
            self._stop()
            await self.inner.aclose()

    def _stop(self) -> None:
        self.shaper.drop()
        self._stopped.set()
        self._pump_scope.cancel()

    def _raise_if_stopped(self) -> None:
        if self._failure is not None:
            raise trio.BrokenResourceError("the shaped link failed") from self._failure
        if self._stopped.is_set() or self._closing:
            raise trio.ClosedResourceError("the shaped link is closed")

    async def _pump(self) -> None:
        try:
            with self._pump_scope:
                while True:
                    due = self.shaper.next_release()
                    if due is None:
                        if self._closing or self._direct:
                            return
                        await self._queued.wait()
                        self._queued = trio.Event()
                        continue
                    await self._sleep_until(due)
                    data = self.shaper.take_due(trio.current_time())
                    if data:
                        await self.inner.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            # the wrapped stream is gone: so are the bytes still queued, and every later send fails
            self._failure = exc
            self._stop()
        except Exception as exc:
            # a bug here must cost this link, not every connection in the caller's nursery
            logger.exception("link shaper pump failed")
            self._failure = exc
            self._stop()
        finally:
            self._pump_done.set()

    async def _sleep_until(self, deadline: float) -> None:
        if deadline - trio.current_time() > self._spin_s:
            await trio.sleep_until(deadline - self._spin_s)
        while trio.current_time() < deadline:
            await trio.sleep(0)
