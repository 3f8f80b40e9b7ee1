"""Continuous batching: steps of different sessions that wait for the shard at the same time run together.

Each session's hop calls :meth:`StepBatcher.submit` with one bundle and waits for its result. While the
shard computes, new steps queue up; when it is free again, whoever holds the turn takes a *cycle*:

- every queued decode step (one per session, oldest first, at most ``max_batch``; a step with
  drafted tokens brings a row for each) as one batched forward, whose results are handed out as
  soon as it ends;
- then the oldest queued prefill chunk, alone.

So a session joins the batch by having a step queued and leaves it by not having one; decode steps
wait for at most one prefill chunk (bounded by the chunk size), and a prefill chunk waits for at most
one decode batch, so neither starves the other. Turns are taken in arrival order (a fair lock); a
step already taken by an earlier turn only waits for its result.

Before a decode batch starts, the turn may *hold* it briefly for sessions that are about to arrive.
Each decoding session comes back once per route traversal, so the batcher knows when to expect it
(its last step plus its period). A session expected within ``hold_factor`` times the time one
single-session step takes here would otherwise arrive while the batch computes and then run alone
after it; waiting for it costs the others less than that, and runs one forward instead of two. Held
this way, sessions that start apart drift into one batch and then move through the route together.
A session expected later is not waited for, so sessions spread evenly over a pipeline on separate
machines stay spread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import trio

from meshd.runtime.shard import StepResult
from meshd.wire.bundle import HiddenStateBundle, Phase

# Each returns its outcomes and how long the compute itself took, in seconds (measured on the thread
# that ran it), so that the batcher can tell a step's waiting from its computing.
RunBatch = Callable[[Sequence[HiddenStateBundle]], Awaitable[tuple[list[StepResult | Exception], float]]]
RunOne = Callable[[HiddenStateBundle], Awaitable[tuple[StepResult, float]]]


@dataclass
class BatchStats:
    """Counts of what the batcher ran (for status and benchmarks)."""

    decode_batches: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    largest_batch: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    held_batches: int = 0  # decode batches held for sessions about to arrive
    held_s: float = 0.0

    def summary(self) -> dict:
        mean = self.decode_steps / self.decode_batches if self.decode_batches else None
        return {"decode_batches": self.decode_batches, "decode_steps": self.decode_steps,
                "prefill_chunks": self.prefill_chunks, "largest_batch": self.largest_batch,
                "mean_batch": mean, "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "held_batches": self.held_batches, "held_s": round(self.held_s, 3)}

    def reset(self) -> None:
        self.decode_batches = self.decode_steps = self.prefill_chunks = self.largest_batch = self.held_batches = 0
        self.held_s = 0.0
        self.batch_sizes.clear()


@dataclass
class _Rhythm:
    """When a session's decode steps reach this batcher: the last one, and the smoothed interval."""

    last: float = 0.0
    period: float | None = None
    _seen: bool = False

    def arrived(self, now: float) -> None:
        if self._seen:
            interval = now - self.last
            self.period = interval if self.period is None else 0.5 * self.period + 0.5 * interval
        self.last, self._seen = now, True


@dataclass
class _Step:
    bundle: HiddenStateBundle
    submitted: float = field(default_factory=trio.current_time)
    done: trio.Event = field(default_factory=trio.Event)
    taken: bool = False
    result: StepResult | None = None
    error: BaseException | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.bundle.session_id, self.bundle.epoch

    @property
    def batchable(self) -> bool:
        b = self.bundle
        return b.phase == Phase.DECODE and b.start_position > 0

    def finish(self, outcome: StepResult | BaseException, compute_s: float = 0.0) -> None:
        if isinstance(outcome, BaseException):
            self.error = outcome
        else:
            waited = trio.current_time() - self.submitted - compute_s
            outcome.compute_ms = compute_s * 1000
            outcome.queue_ms = max(0.0, waited * 1000)
            self.result = outcome
        self.done.set()


class StepBatcher:
    def __init__(self, run_batch: RunBatch, run_one: RunOne, *, max_batch: int = 16,
                 hold_factor: float = 1.0) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if hold_factor < 0:
            raise ValueError("hold_factor cannot be negative")
        self._run_batch = run_batch
        self._run_one = run_one
        self.max_batch = max_batch
        self.hold_factor = hold_factor
        self._queue: list[_Step] = []
        self._turn = trio.Lock()
        self._arrived = trio.Event()  # set (and replaced) whenever a step is queued
        self._rhythm: dict[tuple[str, int], _Rhythm] = {}
        self._solo_s: float | None = None  # smoothed compute time of a one-session decode step
        self.stats = BatchStats()

    @property
    def waiting(self) -> int:
        """Steps queued and not yet taken into a batch."""
        return len(self._queue)

    def forget(self, session_id: str, epoch: int) -> None:
        """The session has ended here: nobody waits for its next step."""
        self._rhythm.pop((session_id, epoch), None)

    async def submit(self, bundle: HiddenStateBundle) -> StepResult:
        step = _Step(bundle)
        self._queue.append(step)
        if step.batchable:
            self._rhythm.setdefault(step.key, _Rhythm()).arrived(step.submitted)
        self._arrived.set()
        self._arrived = trio.Event()
        try:
            while not step.taken:
                async with self._turn:
                    if not step.taken:
                        await self._hold()
                        await self._cycle()
        except BaseException:
            if not step.taken:
                self._queue.remove(step)
            raise
        await step.done.wait()
        if step.error is not None:
            raise step.error
        assert step.result is not None
        return step.result

    def _expected(self, now: float) -> tuple[set[tuple[str, int]], float] | None:
        """Sessions worth holding the next decode batch for, and until when; None when none are."""
        if self.hold_factor <= 0 or self._solo_s is None:
            return None
        queued = [s for s in self._queue if s.batchable]
        if not queued or len({s.key for s in queued}) >= self.max_batch:
            return None
        present = {s.key for s in queued}
        limit = self.hold_factor * self._solo_s
        wanted: set[tuple[str, int]] = set()
        until = now
        for key, rhythm in self._rhythm.items():
            if key in present or rhythm.period is None:
                continue
            eta = rhythm.last + rhythm.period - now
            if -0.5 * rhythm.period < eta <= limit:  # long overdue: finished, or gone elsewhere
                wanted.add(key)
                until = max(until, now + max(0.0, eta) + 0.1 * limit)
        return (wanted, until) if wanted else None

    async def _hold(self) -> None:
        expected = self._expected(trio.current_time())
        if expected is None:
            return
        wanted, until = expected
        started = trio.current_time()
        with trio.move_on_at(until):
            while not wanted <= {s.key for s in self._queue if s.batchable}:
                await self._arrived.wait()
        self.stats.held_batches += 1
        self.stats.held_s += trio.current_time() - started

    async def _cycle(self) -> None:
        decodes, prefill = self._take()
        if decodes:
            self.stats.decode_batches += 1
            self.stats.decode_steps += len(decodes)
            self.stats.largest_batch = max(self.stats.largest_batch, len(decodes))
            self.stats.batch_sizes[len(decodes)] = self.stats.batch_sizes.get(len(decodes), 0) + 1
            await self._run(decodes)
        if prefill is not None:
            self.stats.prefill_chunks += 1
            await self._run([prefill])

    def _take(self) -> tuple[list[_Step], _Step | None]:
        decodes: list[_Step] = []
        prefill: _Step | None = None
        sessions: set[tuple[str, int]] = set()
        for step in self._queue:
            if step.key in sessions:
                continue  # a session's steps run in order, one per cycle
            if step.batchable and len(decodes) < self.max_batch:
                decodes.append(step)
            elif not step.batchable and prefill is None:
                prefill = step
            else:
                continue
            sessions.add(step.key)
        taken = decodes + ([prefill] if prefill is not None else [])
        for step in taken:
            step.taken = True
        self._queue = [s for s in self._queue if not s.taken]
        return decodes, prefill

    async def _run(self, steps: list[_Step]) -> None:
        """Compute ``steps`` and hand each its outcome; the compute is not interrupted by cancellation
        (the shard's state must stay consistent), so every waiting step gets its answer."""
        compute_s = 0.0
        try:
            with trio.CancelScope(shield=True):
                try:
                    if len(steps) == 1:
                        result, compute_s = await self._run_one(steps[0].bundle)
                        outcomes: list[StepResult | BaseException] = [result]
                    else:
                        results, compute_s = await self._run_batch([s.bundle for s in steps])
                        outcomes = list(results)
                except Exception as exc:  # the steps' error, not the turn holder's: each step gets it
                    outcomes = [exc] * len(steps)
        except BaseException as exc:
            for step in steps:
                step.finish(exc)
            raise
        if len(steps) == 1 and steps[0].batchable and compute_s > 0:
            self._solo_s = compute_s if self._solo_s is None else 0.8 * self._solo_s + 0.2 * compute_s
        for step, outcome in zip(steps, outcomes, strict=True):
            step.finish(outcome, compute_s)
