"""How long this machine takes to wake a thread or a process that has been idle: the floor under a seam.

A decode step crosses every hop of a route, and on each hop it wakes something that was waiting:
the peer's event loop (the bundle arrived), its compute thread (the step is handed over), and the
event loop again (the result is back). On an idle CPU, or on a virtual machine whose idle vCPUs the
host deschedules, such a wake-up costs far more than the same hand-off between busy threads. The
benchmark measures both, with nothing else running, so that a report shows how much of a seam is
the machine's and how much is ours:

- ``thread_handoff_us``: a round trip to a long-lived worker thread and back, as a peer hands a
  step to its compute thread, back to back (``hot``) and after ``idle_ms`` of idleness (``idle``);
- ``process_round_trip_us``: a one-byte message to another process over a socket and its answer,
  as one hop hands a bundle to the next, the same two ways;
- ``idle_policy``: what the kernel does with an idle CPU, which decides the ``idle`` figures (and
  how fast peers that take turns at the same CPUs compute): the ``cpuidle`` driver and governor, and
  on a virtual machine under the ``haltpoll`` governor how long an idle vCPU polls before it halts and
  waits on the hypervisor (``guest_halt_poll_ns``; 0 halts at once). None where the kernel does not
  say;
- ``idle_s_by_state``: what the idle CPUs then did while the whole benchmark ran, as seconds in each
  ``cpuidle`` state summed over the CPUs (``POLL`` is polling, the others halt or sleep deeper). The
  setting alone does not say it: under ``haltpoll`` a CPU's poll window adapts, and one that grew while
  polling was allowed goes on polling for a while after ``guest_halt_poll_ns`` is set back to 0.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import get_context
from pathlib import Path

from meshd.stats import percentiles

SAMPLES = 200
IDLE_MS = 20.0


def _round_trips(once: Callable[[], object], samples: int, idle_s: float) -> list[float]:
    times = []
    for _ in range(samples):
        if idle_s:
            time.sleep(idle_s)
        started = time.perf_counter()
        once()
        times.append(time.perf_counter() - started)
    return times


def thread_handoff(samples: int = SAMPLES, idle_ms: float = IDLE_MS) -> dict:
    request, reply = threading.Semaphore(0), threading.Semaphore(0)
    stop = False

    def worker() -> None:
        while True:
            request.acquire()
            if stop:
                return
            reply.release()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()

    def once() -> None:
        request.release()
        reply.acquire()

    try:
        _round_trips(once, 20, 0.0)
        return {"hot": percentiles(_round_trips(once, samples, 0.0), scale=1e6),
                "idle": percentiles(_round_trips(once, samples, idle_ms / 1000), scale=1e6)}
    finally:
        stop = True
        request.release()
        thread.join(timeout=5)


def _echo(sock: socket.socket) -> None:
    while data := sock.recv(1):
        sock.sendall(data)


def process_round_trip(samples: int = SAMPLES, idle_ms: float = IDLE_MS) -> dict:
    ours, theirs = socket.socketpair()
    child = get_context("spawn").Process(target=_echo, args=(theirs,), daemon=True)
    child.start()
    theirs.close()

    def once() -> None:
        ours.sendall(b"x")
        ours.recv(1)

    try:
        _round_trips(once, 20, 0.0)
        return {"hot": percentiles(_round_trips(once, samples, 0.0), scale=1e6),
                "idle": percentiles(_round_trips(once, samples, idle_ms / 1000), scale=1e6)}
    finally:
        ours.close()
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
            child.join()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def idle_policy(sys_root: Path = Path("/sys")) -> dict[str, str | int | None]:
    """The kernel's idle handling of the CPUs, as far as sysfs shows it (None for what it does not)."""
    cpuidle = sys_root / "devices/system/cpu/cpuidle"
    poll = _read(sys_root / "module/haltpoll/parameters/guest_halt_poll_ns")
    return {"driver": _read(cpuidle / "current_driver"), "governor": _read(cpuidle / "current_governor_ro")
            or _read(cpuidle / "current_governor"),
            "guest_halt_poll_ns": int(poll) if poll is not None and poll.isdigit() else None}


def idle_residency(sys_root: Path = Path("/sys")) -> dict[str, float]:
    """Seconds every CPU has spent in each idle state since boot, summed by state name (empty where
    the kernel has no ``cpuidle``)."""
    seconds: dict[str, float] = {}
    for state in sorted((sys_root / "devices/system/cpu").glob("cpu[0-9]*/cpuidle/state[0-9]*")):
        name, micros = _read(state / "name"), _read(state / "time")
        if name is not None and micros is not None and micros.isdigit():
            seconds[name] = seconds.get(name, 0.0) + int(micros) / 1e6
    return seconds


def idle_since(before: dict[str, float], sys_root: Path = Path("/sys")) -> dict[str, float]:
    """Seconds in each idle state since the :func:`idle_residency` reading ``before``."""
    now = idle_residency(sys_root)
    return {name: round(now[name] - before.get(name, 0.0), 3) for name in now}


def measure_wakeups(samples: int = SAMPLES, idle_ms: float = IDLE_MS) -> dict:
    return {"idle_ms": idle_ms, "samples": samples,
            "thread_handoff_us": thread_handoff(samples, idle_ms),
            "process_round_trip_us": process_round_trip(samples, idle_ms),
            "idle_policy": idle_policy()}


if __name__ == "__main__":
    import json

    print(json.dumps(measure_wakeups(), indent=2))
