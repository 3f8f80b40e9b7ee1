"""Continuous batching: steps of different sessions that wait for the shard at the same time run together.

Each session's hop calls :meth:`StepBatcher.submit` with one bundle and waits for its result. While the
shard computes, new steps queue up; when it is free again, whoever holds the turn takes a *cycle*:

- every queued decode step (one token, one per session, oldest first, at most ``max_batch``) as one
  batched forward, whose results are handed out as soon as it ends;
- then the oldest queued prefill chunk, alone.

So a session joins the batch by having a step queued and leaves it by not having one; decode steps
wait for at most one prefill chunk (bounded by the chunk size), and a prefill chunk waits for at most
one decode batch, so neither starves the other. Turns are taken in arrival order (a fair lock); a
step already taken by an earlier turn only waits for its result.
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

    def summary(self) -> dict:
        mean = self.decode_steps / self.decode_batches if self.decode_batches else None
        return {"decode_batches": self.decode_batches, "decode_steps": self.decode_steps,
                "prefill_chunks": self.prefill_chunks, "largest_batch": self.largest_batch,
                "mean_batch": mean, "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())}}

    def reset(self) -> None:
        self.decode_batches = self.decode_steps = self.prefill_chunks = self.largest_batch = 0
        self.batch_sizes.clear()


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
        return b.phase == Phase.DECODE and b.token_count == 1 and b.start_position > 0

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
    def __init__(self, run_batch: RunBatch, run_one: RunOne, *, max_batch: int = 16) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._run_batch = run_batch
        self._run_one = run_one
        self.max_batch = max_batch
        self._queue: list[_Step] = []
        self._turn = trio.Lock()
        self.stats = BatchStats()

    @property
    def waiting(self) -> int:
        """Steps queued and not yet taken into a batch."""
        return len(self._queue)

    async def submit(self, bundle: HiddenStateBundle) -> StepResult:
        step = _Step(bundle)
        self._queue.append(step)
        try:
            while not step.taken:
                async with self._turn:
                    if not step.taken:
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
                if len(steps) == 1:
                    try:
                        result, compute_s = await self._run_one(steps[0].bundle)
                        outcomes: list[StepResult | BaseException] = [result]
                    except Exception as exc:
                        outcomes = [exc]
                else:
                    results, compute_s = await self._run_batch([s.bundle for s in steps])
                    outcomes = list(results)
        except BaseException as exc:
            for step in steps:
                step.finish(exc)
            raise
        for step, outcome in zip(steps, outcomes, strict=True):
            step.finish(outcome, compute_s)
