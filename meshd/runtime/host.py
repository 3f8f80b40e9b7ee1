"""The Trio side of a shard: loads it and runs all its compute on one thread of its own, in batches.

Model compute is blocking and holds the CPU, so it runs off the event loop, which stays free for
gossip, seams and the API meanwhile. It runs on *one* long-lived thread owned by the host, not on
whichever worker ``trio.to_thread`` picks: torch's CPU kernels use OpenMP, and GNU OpenMP keeps a
team of threads per calling thread. Every extra thread that has ever computed adds its own team, and
once a process manages more OpenMP threads than it has CPUs, OpenMP stops letting idle team threads
spin between parallel regions; each of the hundreds of regions in a decode step then pays a futex
wake-up (measured: a 16-layer step 40 ms on one thread, 53 ms when the same work hops between
threads). One compute thread keeps the count at ``torch_threads``.

Concurrent steps of different sessions are grouped by a :class:`~meshd.runtime.batching.StepBatcher`:
decode steps that wait at the same time run as one batched forward.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import trio

from meshd.runtime import heap
from meshd.runtime.backends import open_shard
from meshd.runtime.batching import StepBatcher
from meshd.runtime.cpu_turn import CpuTurn
from meshd.runtime.machine_share import MachineShare
from meshd.runtime.manifest import Manifest
from meshd.runtime.numerics import Numerics
from meshd.runtime.prefix_kv import DEFAULT_PREFIX_BYTES
from meshd.runtime.shard import Shard, StepResult
from meshd.runtime.speed_probe import TIMING_SESSION
from meshd.wire.bundle import HiddenStateBundle

log = logging.getLogger("meshd.runtime")

T = TypeVar("T")


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``fn(*args)`` and the seconds it took, measured on the thread that ran it."""
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


_compute_threads: int | None = None  # the torch threads of this process's compute threads, once set


def set_compute_threads(count: int) -> None:
    """Give the compute threads this process starts ``count`` torch threads each, and the calling
    thread (and every thread started after this) one.

    A thread that runs a parallel torch op gets an OpenMP team of its own. When a daemon's event loop
    (deserializing a prefill chunk, say) grows one next to the compute thread's, the process holds
    more OpenMP threads than the machine has CPUs, and libgomp then makes every idle thread sleep
    almost at once instead of spinning: each of a decode step's hundreds of parallel regions starts by
    waking its team. Measured on the development machine: a compute thread's 48 one-row GEMMs take
    24.5 ms, and 30 ms once the main thread has run one parallel op; with the main thread on one
    thread, 24.5 ms still."""
    global _compute_threads
    import torch

    _compute_threads = count
    torch.set_num_threads(1)


class ComputeThread:
    """One thread that runs every piece of a shard's compute, awaited from Trio.

    A call cannot be cancelled half-way (the shard's state must stay consistent): a cancelled caller
    still waits for the call it started to end, as with ``trio.to_thread.run_sync``.
    """

    def __init__(self, torch_threads: int | None = None, name: str = "meshd-compute") -> None:
        threads = torch_threads or _compute_threads
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                            initializer=self._init_thread, initargs=(threads,))
        self.thread_id: int | None = None
        if _compute_threads is not None:
            # the thread's own count is set now; setting it also made it the count every thread
            # started later gets, so give that back to one (see set_compute_threads)
            self._executor.submit(lambda: None).result()
            import torch

            torch.set_num_threads(1)

    def _init_thread(self, torch_threads: int | None) -> None:
        self.thread_id = threading.get_ident()
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
            # torch gives a thread its count at the thread's first parallel op, from the process-wide
            # count of that moment: take it now, while that count is this one
            torch.get_num_threads()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_future: Future) -> None:
            with contextlib.suppress(trio.RunFinishedError):  # nobody is waiting any more
                token.run_sync_soon(done.set)

        future = self._executor.submit(fn, *args)
        future.add_done_callback(wake)
        with trio.CancelScope(shield=True):
            await done.wait()
        return future.result()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the compute thread, waited for by blocking: for work before the event loop
        runs (measuring the numerics), which must not give the calling thread an OpenMP team of its own."""
        return self._executor.submit(fn, *args).result()

    def close(self) -> None:
        self._executor.shutdown(wait=False)


class InlineCompute:
    """Runs compute on the event loop's own thread, blocking it: for in-process tests on a fake clock,
    where time must not pass while a step computes (a compute thread would let the clock jump)."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    def close(self) -> None:
        pass


class ShardHost:
    """Owns a peer's shard once loaded, its compute thread and its batcher: the Trio face of the runtime."""

    def __init__(self, model_dir: Path, *, numerics: Numerics | None = None, manifest: Manifest | None = None,
                 max_chunk_tokens: int = 512, kv_budget_bytes: int | None = None,
                 prefix_kv_bytes: int = DEFAULT_PREFIX_BYTES, session_ttl_s: float = 600.0, max_batch: int = 16,
                 torch_threads: int | None = None,
                 keep_logits: bool = False, batch_hold: float = 1.0, batch_latency_ms: float = 0.0,
                 compute: ComputeThread | InlineCompute | None = None, cpu_turn: CpuTurn | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.shard: Shard | None = None
        self.compute = compute if compute is not None else ComputeThread(torch_threads)
        self.batcher = StepBatcher(self._run_batch, self._run_one, max_batch=max_batch, hold_factor=batch_hold,
                                   latency_bound_s=batch_latency_ms / 1000 if batch_latency_ms > 0 else None,
                                   shared_machine=MachineShare(), forms_waves=self._forms_waves,
                                   run_prefill=self._run_prefill,
                                   prefill_tokens=self._prefill_tokens)
        self._shard_options: dict[str, Any] = dict(max_chunk_tokens=max_chunk_tokens, kv_budget_bytes=kv_budget_bytes,
                                                   prefix_kv_bytes=prefix_kv_bytes,
                                                   session_ttl_s=session_ttl_s, keep_logits=keep_logits,
                                                   numerics=numerics, manifest=manifest)
        self.loaded = trio.Event()
        self.cpu_turn = cpu_turn  # computes take turns with the other peers on this machine's CPUs

    @property
    def range(self) -> tuple[int, int] | None:
        return None if self.shard is None else (self.shard.spec.start, self.shard.spec.end)

    async def load(self, start: int, end: int, check: Callable[[Shard], T] | None = None) -> T | None:
        """Load ``[start, end)`` (replacing nothing: a host loads one range for its lifetime). With
        ``check``, the shard is held only once ``check(shard)`` returned (on the compute thread): a
        shard that fails it is never seen by anyone. Returns what ``check`` returned."""
        if self.shard is not None:
            raise RuntimeError(f"already holding layers {self.range}")
        log.info("loading layers [%d, %d) of %s", start, end, self.model_dir)
        shard = await self.compute.run(lambda: open_shard(self.model_dir, start, end, **self._shard_options))
        outcome = await self.compute.run(check, shard) if check is not None else None
        self.shard = shard
        heap.settle()  # what loading left behind is collected, the rest frozen: full passes stay short
        self.loaded.set()
        log.info("loaded layers [%d, %d): %.1f MB of weights", start, end, shard.parameter_bytes() / 1e6)
        return outcome

    async def forward(self, bundle: HiddenStateBundle) -> StepResult:
        """One step of one session; steps of other sessions waiting at the same time share its forward."""
        self.require_shard()
        return await self.batcher.submit(bundle)

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the compute thread (for anything else that touches the shard's tensors)."""
        return (await self.compute.run(self._in_turn, fn, *args))[0]

    async def _run_one(self, bundle: HiddenStateBundle) -> tuple[StepResult, float]:
        return await self.compute.run(self._in_turn, self.require_shard().forward, bundle)

    async def _run_prefill(self, bundles: Sequence[HiddenStateBundle], pause: Callable[[], bool],
                           between: Callable[[], Awaitable[Sequence[HiddenStateBundle]]],
                           ) -> tuple[list[StepResult | Exception], float]:
        """Prefill chunks of one or more sessions, as one, in slices: each its own call on the compute
        thread and its own CPU turn; ``between()`` runs after each slice but the last (the batcher's
        decode steps). Where chunks computed together fail, each is computed again on its own, so that
        an error stays with the chunk causing it."""
        shard = self.require_shard()
        run, computed = await self.compute.run(self._in_turn, shard.start_prefill, bundles)
        try:
            while True:
                done, spent = await self.compute.run(self._in_turn, run.advance, pause)
                computed += spent
                if done:
                    break
                joining = await between()
                if joining:  # the run starts again with them: what it computed is undone
                    await self.compute.run(run.abort)
                    bundles = [*bundles, *joining]
                    run, spent = await self.compute.run(self._in_turn, shard.start_prefill, bundles)
                    computed += spent
            outcomes, spent = await self.compute.run(self._in_turn, run.finish)
        except Exception:
            await self.compute.run(run.abort)  # a no-op once the run has ended itself
            if len(bundles) == 1:
                raise
            outcomes, spent = await self.compute.run(self._in_turn, shard.prefill_each, bundles)
        except BaseException:
            await self.compute.run(run.abort)
            raise
        return outcomes, computed + spent

    def _forms_waves(self) -> bool:
        """Whether routes enter the model here (this shard holds its first layer): where the batcher draws
        sessions into waves (see :mod:`meshd.runtime.batching`)."""
        return self.shard is not None and self.shard.spec.start == 0

    def _prefill_tokens(self) -> int:
        """How many prompt tokens of several sessions' chunks may compute as one (0: one chunk at a time)."""
        shard = self.shard
        return shard.max_chunk_tokens if shard is not None and shard.prefills_share_rows else 0

    async def _run_batch(self, bundles: Sequence[HiddenStateBundle]) -> tuple[list[StepResult | Exception], float]:
        return await self.compute.run(self._in_turn, self.require_shard().forward_batch, bundles)

    def _in_turn(self, fn: Callable[..., T], *args: Any) -> tuple[T, float]:
        """``fn(*args)`` in this machine's CPU turn (when taking turns), and the seconds it computed
        (the wait for the turn is not compute)."""
        if self.cpu_turn is None:
            return _timed(fn, *args)
        with self.cpu_turn.held():
            return _timed(fn, *args)

    def release(self, session_id: str, epoch: int) -> bool:
        self.batcher.forget(session_id, epoch)
        return self.shard is not None and self.shard.release(session_id, epoch)

    @property
    def active_sessions(self) -> int:
        """Sessions held for clients (a speed probe's or check's throw-away session is none)."""
        if self.shard is None:
            return 0
        held = self.shard.kv.keys()  # a copy, taken under the manager's lock
        return sum(1 for session_id, _epoch in held if not session_id.startswith(TIMING_SESSION))

    @property
    def kv_free_bytes(self) -> int:
        if self.shard is None or self.shard.kv.free_bytes is None:
            return 0
        return self.shard.kv.free_bytes

    def close(self) -> None:
        heap.thaw()  # the shard's objects may be collected once this host is dropped
        self.compute.close()
        if self.cpu_turn is not None:
            self.cpu_turn.close()

    def require_shard(self) -> Shard:
        if self.shard is None:
            raise RuntimeError("no layers loaded yet")
        return self.shard
