"""Whether other work keeps this machine's cores busy: what a batcher needs to know to form waves.

Hops of one route on one machine compete for its cores, and then one wave of sessions moving through
them together beats several waves computed side by side; hops on machines of their own are idle
between waves, and several waves keep each of them busy. A hop tells the two apart from the kernel's
CPU counters: the machine's busy CPU time less this process's own, over the wall time and the CPU
count. On a shared machine the other hops fill the cores while this one waits; on a machine of its
own, next to nothing does. Any other heavy work counts the same, and should: it competes too.
Only the CPUs this process may run on count: a peer pinned to some of a large machine's cores (by a
service's CPU affinity, say) competes with work on those cores alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil

SAMPLE_S = 1.0      # the shortest window between two readings
THRESHOLD = 0.25    # others' share of all CPUs above which the machine counts as shared
SMOOTHING = 0.5     # weight of the newest window
# the kernel's busy CPU time (guest time is already inside user time, and idle or waiting is not busy)
BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq", "steal")


class MachineShare:
    """Call it for the current verdict; it reads the counters at most once per ``sample_s``. Until
    the first full window the machine counts as shared (one wave is never wrong, only slower)."""

    def __init__(self, *, sample_s: float = SAMPLE_S, threshold: float = THRESHOLD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sample_s = sample_s
        self._threshold = threshold
        self._clock = clock
        self._process = psutil.Process()
        self._last: tuple[float, float, float] | None = None  # wall, busy time of its CPUs, own
        self._cpus: tuple[int, ...] = ()  # the CPUs the last reading counted
        self.others: float | None = None  # smoothed share of all CPUs used by other processes

    def __call__(self) -> bool:
        now = self._clock()
        if self._last is None or now - self._last[0] >= self._sample_s:
            self._read(now)
        return self.others is None or self.others > self._threshold

    def _read(self, now: float) -> None:
        per_cpu = psutil.cpu_times(percpu=True)
        cpus = tuple(cpu for cpu in _allowed_cpus() if cpu < len(per_cpu)) or tuple(range(len(per_cpu)))
        busy = sum(getattr(per_cpu[cpu], name, 0.0) for cpu in cpus for name in BUSY_FIELDS)
        own_times = self._process.cpu_times()
        own = own_times.user + own_times.system
        if self._last is not None and cpus == self._cpus:  # a changed affinity starts a new window
            wall = now - self._last[0]
            share = max(0.0, (busy - self._last[1]) - (own - self._last[2])) / (wall * len(cpus))
            self.others = share if self.others is None else self.others + SMOOTHING * (share - self.others)
        self._last = (now, busy, own)
        self._cpus = cpus


def _allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on, or none where the platform does not say (macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return ()
