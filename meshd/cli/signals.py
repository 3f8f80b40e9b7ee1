"""How the daemons end: SIGINT or SIGTERM starts a graceful stop, a second one stops at once."""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import trio

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def run_until_signalled(start: Callable[..., Awaitable[Any]], log: logging.Logger,
                              drain: Callable[[], Awaitable[None]] | None = None) -> None:
    """Start ``start`` (a ``nursery.start``-style service) and run it until a stop signal.

    With ``drain``, the first signal runs it (a service manager's SIGTERM drains running work) and a
    second signal cuts it short; either way the service is then cancelled.
    """
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
            await nursery.start(start)
            async for signum in signals:
                name = signal.Signals(signum).name
                if drain is None:
                    log.info("received %s; stopping", name)
                else:
                    log.info("received %s; draining before stopping (a second signal stops at once)", name)
                    async with trio.open_nursery() as draining:

                        async def drain_then_stop(scope: trio.CancelScope = draining.cancel_scope) -> None:
                            await drain()
                            scope.cancel()

                        draining.start_soon(drain_then_stop)
                        async for _again in signals:
                            log.info("second signal: stopping now")
                            break
                        draining.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
                break
