"""Continuous batching: steps of different sessions that wait for the shard at the same time run together.

Each session's hop calls :meth:`StepBatcher.submit` with one bundle and waits for its result. While the
shard computes, new steps queue up; when it is free again, whoever holds the turn takes a *cycle*:

- every queued decode step (one per session, oldest first, at most ``max_batch``; a step with
  drafted tokens brings a row for each) as one batched forward, whose results are handed out as
  soon as it ends;
- then, when the holder's own step is a prompt's, the oldest queued prefill chunk, computed in
  *slices* (a layer at least, see :class:`meshd.runtime.shard.PrefillRun`): after each slice, the
  decode steps queued meanwhile run as one batch before the chunk goes on. Where the shard computes
  each row of a GEMM alike at any row count (``prefill_tokens`` says how many prompt tokens may then
  go together), the chunks of other sessions queued behind it join it, up to that many tokens in
  all, and compute as one: prompts that arrive together are computed in one pass over the weights
  and their sessions start decoding in one wave. A decode step's holder leaves the chunk to its
  own submitter, which waits next in the turn's queue, so that no decode result is held up for a
  whole chunk because its session happened to hold the turn. Chunks that queue within the first
  ``slice_s`` after the run starts are taken in too: it starts again with them (what it computed is
  undone), up to ``RESTARTS_MAX`` times, so that a burst of requests, whose prompts reach the hop a
  few milliseconds apart, is computed in one pass rather than the first prompt alone and the rest
  after it.

So a session joins the batch by having a step queued and leaves it by not having one; a decode step
waits for at most one slice of a prefill chunk, and a prefill chunk for the decode batches of the
turns taken before it and for at most one decode batch per slice, so neither starves the other.

A slice ends once the decode steps it can expect are queued here (those queued, and those of sessions
handed a result here that are due back within the slice) and it has computed about as long as their
batch will (so that the two share the hop while both wait), and after ``slice_s`` in any case,
which hands the machine's CPU turn (:mod:`meshd.runtime.cpu_turn`) to other peers' decode steps as
well. The hop is shared per session: prompts of several sessions computed together get as many
times that as they are sessions against the decoding ones, up to ``PROMPT_SHARE_MAX`` times
(:func:`prompt_share`). Seven prompts that arrive together behind one decoding session then do not
wait for its lone steps (each costing about what a step of eight does) after every slice. Turns are
taken in arrival order (a fair lock); a step already taken by an earlier turn only waits for its
result.

Before a decode batch starts, the turn may *hold* it for sessions that are about to arrive. Each
decoding session comes back once per route traversal, so the batcher knows when to expect it (its
last step plus its period). Whether waiting pays depends on where the route's hops run:

- **On one shared machine** (the route's hops, or other work, keep its cores busy while this hop
  waits: ``shared_machine`` says), a wait costs no compute: while this hop waits, the others use the
  cores, and the sessions waited for are the ones they compute. What a shared machine loses is a
  wave computed apart from another: each pays for its own step at every hop. So the batch is held
  for every session due within ``hold_factor`` times its period, as long as the hop's own step-cost
  table (:mod:`meshd.runtime.step_costs`) says rows computed together cost clearly less than apart
  (``cost(R + E) < 0.9 (cost(R) + cost(E))`` for ``R`` rows queued and ``E`` expected). Sessions
  that start apart are drawn into one wave, which then moves through the route together. Where rows
  cost what they add, nobody is waited for. Only the hop where routes enter the model (its first
  layer: ``forms_waves``) waits that long; the hops after it get waves formed and wait only for the
  rest of the wave in flight: for sessions due within the period while steps keep arriving less
  than ``QUIET_STEPS`` of a one-row step apart (``QUIET_MIN_S`` at least: the previous hop sends a
  batch's steps within a millisecond or two), and at most ``IN_FLIGHT_STEPS`` one-row steps. Were
  every hop to wait a period, each would wait for sessions that another holds for it, and the
  machine's cores would idle while all of them wait; were a later hop to wait out its cap whenever
  a wave had split, it would wait, at every step, for sessions that the first hop holds.

  A wave's sessions do not always come back together: a step handed on a few milliseconds late
  (the sending hop's event loop descheduled while the next hop computes), or a round slower than
  half a period, which makes every session of the wave look gone. Were the wave then computed
  without its late *mates* (the sessions that ran here in one batch with a session now queued),
  it would come apart for good: each part pays for its own step at every hop, the parts arrive
  further apart at every round, and the first hop's expectations, drawn from periods the split
  disturbs, miss them. So a mate is waited for even when late: where waves form, until it is
  ``LATE_SHARE`` of its period late and taken to be gone; past the first hop, whatever the lull,
  until the cap. A session that ends here (the hop releases it) is waited for no longer.
- **On machines of their own**, hops are idle between waves anyway, and several waves keep all of
  them busy: the batcher holds only for sessions due within ``hold_factor`` one-row steps (those
  would arrive while the batch computes and then run alone after it), and waves spread over a
  pipeline stay spread.

A batch is capped at ``max_batch`` sessions and, given ``latency_bound_s``, at the rows whose step
the table expects within it. The decode stall a long prompt may cause here is one slice of a
prefill chunk: ``slice_s``, or one layer of the chunk where a layer takes longer (chunks computed
together hold no more tokens than one chunk may, so their layer costs no more). Prompts computed
together may stall a decode step for ``PROMPT_SHARE_MAX`` times ``slice_s`` and the layer then in
progress. The summary's
``decode_stall_bound_ms`` is the longest slice computed so far, and the table keeps what whole
chunks cost by size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import trio

from meshd.runtime.shard import StepResult
from meshd.runtime.step_costs import StepCosts
from meshd.wire.bundle import HiddenStateBundle, Phase

PAYS = 0.9  # on a shared machine, rows are waited for when together they cost less than this share of apart
SLICE_S = 0.05  # a prefill slice ends after this long even when no decode step waits here
PROMPT_SHARE_MAX = 4  # prompts computed together slice for at most this many times SLICE_S
IN_FLIGHT_STEPS = 2  # past the first hop, a batch waits at most this many one-row steps for a wave's sessions
QUIET_STEPS = 0.1  # ... and no longer than this share of a one-row step after the last step arrived,
QUIET_MIN_S = 0.002  # ... or this long, if longer: a batch's steps reach the next hop within a millisecond or two
LATE_SHARE = 0.5  # a session this share of its period late is taken to be gone (finished, or elsewhere)
RESTARTS_MAX = 3  # a prefill run starts again at most this many times to take in chunks queued behind it


def prompt_share(prompts: int, decoding: int) -> float:
    """How many times its own length a slice may run when it computes ``prompts`` sessions' chunks
    together while ``decoding`` sessions' steps wait: the hop is shared per session, so seven prompts
    arriving together are not held to the pace one decoding session sets (each of its lone steps costs
    about what a step of eight does), up to ``PROMPT_SHARE_MAX``. A lone prompt shares evenly."""
    return min(float(PROMPT_SHARE_MAX), max(1.0, prompts / max(1, decoding)))

# Each returns its outcomes and how long the compute itself took, in seconds (measured on the thread
# that ran it), so that the batcher can tell a step's waiting from its computing.
RunBatch = Callable[[Sequence[HiddenStateBundle]], Awaitable[tuple[list[StepResult | Exception], float]]]
RunOne = Callable[[HiddenStateBundle], Awaitable[tuple[StepResult, float]]]
# Prefill chunks of one or more sessions, computed as one in slices: ``pause()`` (safe to call from the
# compute thread) says when a slice should end, and ``between()`` is awaited after each slice but the last.
# ``between()`` may return chunks to take in: the run then starts again with them, the computed slices
# undone, and the outcomes come for every chunk, in the order given and then taken in.
RunPrefill = Callable[[Sequence[HiddenStateBundle], Callable[[], bool],
                       Callable[[], Awaitable[Sequence[HiddenStateBundle]]]],
                      Awaitable[tuple[list[StepResult | Exception], float]]]


@dataclass
class BatchStats:
    """Counts of what the batcher ran (for status and benchmarks)."""

    decode_batches: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    prefill_runs: dict[int, int] = field(default_factory=dict)  # prefill computes by how many chunks went together
    prefill_restarts: int = 0  # prefill runs started again to take in chunks queued within their first slice
    largest_batch: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    held_batches: int = 0  # decode batches held for sessions about to arrive
    held_s: float = 0.0
    longest_slice_s: float = 0.0  # a decode step waits behind at most one slice of a prefill chunk: the bound
    decodes_between_slices: int = 0  # decode batches run between two slices of a prefill chunk
    costs: StepCosts = field(default_factory=StepCosts)  # this hop's step costs by size
    shared_machine: bool | None = None  # what the last hold decision took the machine to be
    decode_compute_s: float = 0.0  # time the shard spent computing decode batches
    prefill_compute_s: float = 0.0  # ... and prefill chunks (their own slices, not the batches between)

    def summary(self) -> dict:
        mean = self.decode_steps / self.decode_batches if self.decode_batches else None
        return {"decode_batches": self.decode_batches, "decode_steps": self.decode_steps,
                "prefill_chunks": self.prefill_chunks,
                "prefill_runs": {str(k): v for k, v in sorted(self.prefill_runs.items())},
                "prefill_restarts": self.prefill_restarts,
                "largest_batch": self.largest_batch,
                "mean_batch": mean, "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "held_batches": self.held_batches, "held_s": round(self.held_s, 3),
                "decode_stall_bound_ms": round(self.longest_slice_s * 1000, 3),
                "decodes_between_slices": self.decodes_between_slices,
                "step_costs": self.costs.summary(), "shared_machine": self.shared_machine,
                "decode_compute_s": round(self.decode_compute_s, 4),
                "prefill_compute_s": round(self.prefill_compute_s, 4)}

    def reset(self) -> None:
        """Zero the counts; the cost table is knowledge, not a count, and stays."""
        self.decode_batches = self.decode_steps = self.prefill_chunks = self.largest_batch = self.held_batches = 0
        self.decodes_between_slices = self.prefill_restarts = 0
        self.held_s = self.longest_slice_s = self.decode_compute_s = self.prefill_compute_s = 0.0
        self.batch_sizes.clear()
        self.prefill_runs.clear()


@dataclass
class _Rhythm:
    """When a session's decode steps reach this batcher: the last one and the smoothed interval, and
    how long the session stays away between a result handed out here and its next step (``away``)."""

    last: float = 0.0
    period: float | None = None
    away: float | None = None
    out_since: float | None = None  # its last result was handed out then, and its next step is not here yet
    batch: int | None = None  # the decode batch it last ran in here: its wave mates ran in it too
    _seen: bool = False

    def arrived(self, now: float) -> None:
        if self._seen:
            interval = now - self.last
            self.period = interval if self.period is None else 0.5 * self.period + 0.5 * interval
        if self.out_since is not None:
            gone = now - self.out_since
            self.away = gone if self.away is None else 0.5 * self.away + 0.5 * gone
            self.out_since = None
        self.last, self._seen = now, True

    def due(self) -> float | None:
        """When its next step should arrive; None while one is here or nothing is known yet."""
        if self.out_since is None or self.away is None:
            return None
        return self.out_since + self.away


@dataclass
class _Hold:
    """Whom the next decode batch waits for, and until when; past the first hop on a shared machine,
    also how long it may go on after the last step arrived (``quiet``) while none of ``mates`` (the
    sessions that ran here with one now queued) is missing."""

    wanted: set[tuple[str, int]]
    until: float
    quiet: float | None = None
    mates: set[tuple[str, int]] = field(default_factory=set)


@dataclass
class _Step:
    bundle: HiddenStateBundle
    submitted: float = field(default_factory=trio.current_time)
    done: trio.Event = field(default_factory=trio.Event)
    taken: bool = False
    waiting_turn: trio.CancelScope | None = None  # while it waits for the turn: cancelled once taken
    result: StepResult | None = None
    error: BaseException | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.bundle.session_id, self.bundle.epoch

    @property
    def batchable(self) -> bool:
        b = self.bundle
        return b.phase == Phase.DECODE and b.start_position > 0

    @property
    def rows(self) -> int:
        """Rows this step adds to a decode batch: its token and each drafted one."""
        return self.bundle.token_count

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
                 hold_factor: float = 1.0, latency_bound_s: float | None = None,
                 shared_machine: Callable[[], bool] | None = None, forms_waves: Callable[[], bool] | None = None,
                 run_prefill: RunPrefill | None = None,
                 prefill_tokens: Callable[[], int] | None = None,
                 slice_s: float = SLICE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if hold_factor < 0:
            raise ValueError("hold_factor cannot be negative")
        if latency_bound_s is not None and latency_bound_s <= 0:
            raise ValueError("the latency bound must be positive")
        if slice_s <= 0:
            raise ValueError("a prefill slice must last a positive time")
        self._run_batch = run_batch
        self._run_one = run_one
        self._run_prefill = run_prefill  # None: prefill chunks run whole, through run_one
        # how many prompt tokens of several sessions' chunks may compute as one (0: one chunk at a time)
        self._prefill_tokens = prefill_tokens if prefill_tokens is not None else (lambda: 0)
        self.slice_s = slice_s
        self._clock = clock  # how a slice's compute is timed: read on the compute thread
        self._decodes_queued = 0  # batchable steps queued: read by the compute thread to end a slice
        self._prompts_queued = 0  # ... and the others (prefill chunks): a young run pauses to take them in
        self.max_batch = max_batch
        self.hold_factor = hold_factor
        self.latency_bound_s = latency_bound_s
        self._shared_machine = shared_machine if shared_machine is not None else (lambda: True)
        self._forms_waves = forms_waves if forms_waves is not None else (lambda: True)
        self._queue: list[_Step] = []
        self._turn = trio.Lock()
        self._arrived = trio.Event()  # set (and replaced) whenever a step is queued or a session ends
        self._rhythm: dict[tuple[str, int], _Rhythm] = {}
        self._batches_run = 0  # numbers the decode batches for the rhythms (the stats' count may be reset)
        self.stats = BatchStats()

    @property
    def costs(self) -> StepCosts:
        return self.stats.costs

    @property
    def waiting(self) -> int:
        """Steps queued and not yet taken into a batch."""
        return len(self._queue)

    def forget(self, session_id: str, epoch: int) -> None:
        """The session has ended here: nobody waits for its next step (a hold waiting for it ends)."""
        if self._rhythm.pop((session_id, epoch), None) is not None:
            self._wake()

    def _wake(self) -> None:
        """Wake whatever waits on the queue (a hold, the batching loop) to look at it again."""
        self._arrived.set()
        self._arrived = trio.Event()

    async def submit(self, bundle: HiddenStateBundle) -> StepResult:
        step = _Step(bundle)
        self._queue.append(step)
        if step.batchable:
            self._rhythm.setdefault(step.key, _Rhythm()).arrived(step.submitted)
            self._decodes_queued += 1
        else:
            self._prompts_queued += 1
        self._wake()
        try:
            while not step.taken:
                # a step taken by another's cycle stops waiting for the turn: its result may come long
                # before that cycle ends (a decode batch run between the slices of a prefill chunk)
                with trio.CancelScope() as step.waiting_turn:
                    async with self._turn:
                        step.waiting_turn = None
                        if not step.taken:
                            await self._hold()
                            # a decode step's holder leaves the prefill chunk to its own
                            # submitter, next in the turn's queue: its result is not held up by it
                            await self._cycle(prefill_too=not step.batchable)
                step.waiting_turn = None
        except BaseException:
            if not step.taken:
                self._queue.remove(step)
                self._decodes_queued -= step.batchable
                self._prompts_queued -= not step.batchable
            raise
        await step.done.wait()
        if step.error is not None:
            raise step.error
        assert step.result is not None
        return step.result

    def _expected(self, now: float) -> _Hold | None:
        """Sessions worth holding the next decode batch for, and how long; None when none are."""
        solo = self.costs.decode_s(1)
        if self.hold_factor <= 0 or solo is None:
            return None
        queued = [s for s in self._queue if s.batchable]
        present = {s.key for s in queued}
        if not queued or len(present) >= self.max_batch:
            return None
        shared = self._shared_machine()
        self.stats.shared_machine = shared
        waves = shared and self._forms_waves()
        # past the first hop, a shared machine's batch waits for the sessions a wave brings, but not for long
        cap = None if waves or not shared else now + IN_FLIGHT_STEPS * self.hold_factor * solo
        mates: set[tuple[str, int]] = set()
        if shared:  # the wave in flight: sessions that ran here with one now queued
            batches = {self._rhythm[key].batch for key in present if key in self._rhythm}
            mates = {key for key, rhythm in self._rhythm.items()
                     if key not in present and rhythm.batch is not None and rhythm.batch in batches}
        due: list[tuple[float, tuple[str, int], float, float]] = []
        for key, rhythm in self._rhythm.items():
            if key in present or rhythm.period is None:
                continue
            eta = rhythm.last + rhythm.period - now
            # long overdue: gone; past the first hop a wave mate is waited for anyway, up to the cap
            if -LATE_SHARE * rhythm.period < eta or (key in mates and cap is not None):
                due.append((max(0.0, eta), key, rhythm.period, rhythm.last + (1 + LATE_SHARE) * rhythm.period))
        if not due:
            return None
        due.sort()
        rows = sum(s.rows for s in queued)
        room = self.max_batch - len(present)
        # a wave that came apart is drawn together again at once: a late mate is waited for until it is
        # taken to be gone (past the first hop, until the cap)
        waited = [(eta, key, gone) for eta, key, _, gone in due[:room] if key in mates]
        wanted = {key for _, key, _ in waited}
        until = max([now] + [max(now + eta + 0.1 * solo, gone) for eta, _, gone in waited])
        for count, (eta, key, period, _) in enumerate(due[:room], start=1):
            if key in mates:
                continue
            if shared:
                apart = (self.costs.decode_s(rows) or solo) + (self.costs.decode_s(count) or solo)
                together = self.costs.decode_s(rows + count) or solo
                limit = self.hold_factor * period if together < PAYS * apart else 0.0
            else:
                limit = self.hold_factor * solo
            if limit <= 0 or eta > limit:
                break
            wanted.add(key)
            until = max(until, now + eta + 0.1 * solo)
        if not wanted:
            return None
        if cap is None:
            return _Hold(wanted, until, mates=mates & wanted)
        # how fast steps come, not how long holding pays; a missing wave mate is waited for to the cap
        return _Hold(wanted, cap if wanted & mates else min(until, cap),
                     max(QUIET_STEPS * solo, QUIET_MIN_S), mates & wanted)

    async def _hold(self) -> None:
        hold = self._expected(trio.current_time())
        if hold is None:
            return
        started = trio.current_time()
        with trio.move_on_at(hold.until):
            while True:
                here = {s.key for s in self._queue if s.batchable}
                missing = {key for key in hold.wanted - here if key in self._rhythm}  # not those that ended
                if not missing:
                    break
                lull_ends = math.inf if missing & hold.mates else self._lull_ends(hold.quiet)
                with trio.move_on_at(lull_ends) as lull:
                    await self._arrived.wait()
                if lull.cancelled_caught:  # the wave in flight has come; the sessions still due are elsewhere
                    break
        held = trio.current_time() - started
        if held > 0:  # a lull over before the hold began holds nothing
            self.stats.held_batches += 1
            self.stats.held_s += held

    def _lull_ends(self, quiet: float | None) -> float:
        """When ``quiet`` seconds will have passed since the last decode step queued arrived (never, for
        None; now, when none is queued: those went away)."""
        if quiet is None:
            return math.inf
        arrivals = [s.submitted for s in self._queue if s.batchable]
        return max(arrivals) + quiet if arrivals else trio.current_time()

    async def _cycle(self, prefill_too: bool) -> None:
        decodes, prefills = self._take(prefill_too)
        if decodes:
            await self._run_decodes(decodes)
        if prefills:
            self.stats.prefill_chunks += len(prefills)
            self._count_run(len(prefills), +1)
            await self._run(prefills)

    def _count_run(self, chunks: int, change: int) -> None:
        runs = self.stats.prefill_runs
        runs[chunks] = runs.get(chunks, 0) + change
        if not runs[chunks]:
            del runs[chunks]

    async def _run_decodes(self, decodes: list[_Step]) -> None:
        self.stats.decode_batches += 1
        self.stats.decode_steps += len(decodes)
        self.stats.largest_batch = max(self.stats.largest_batch, len(decodes))
        self.stats.batch_sizes[len(decodes)] = self.stats.batch_sizes.get(len(decodes), 0) + 1
        self._batches_run += 1
        batch = self._batches_run
        await self._run(decodes)
        now = trio.current_time()
        for step in decodes:
            rhythm = self._rhythm.get(step.key)
            if rhythm is not None and step.error is None:
                rhythm.out_since, rhythm.batch = now, batch

    def _slice_plan(self, prompts: int) -> tuple[int, float, float]:
        """When a prefill slice of ``prompts`` sessions' chunks starting now may pause: once this many
        decode steps are queued and it has computed this long, and in any case after the last time
        (``slice_s``, longer for prompts computed together: :func:`prompt_share`).

        The steps are those queued and those of sessions handed a result here that are due back
        within the slice (a hop holding a whole route gets them back within milliseconds; pausing at
        the first would split them into batches of one). A session overdue by a slice is not counted.
        The time is what the decode batch for them is expected to cost, so that while both wait, the
        prompt and the decoding sessions share the hop about evenly: a hop of many layers no longer
        computes a short prompt's layers one at a time, each behind a whole decode batch."""
        now = trio.current_time()
        coming = 0
        for rhythm in self._rhythm.values():
            due = rhythm.due()
            if due is not None and due <= now + self.slice_s and now - due < self.slice_s:
                coming += 1
        wanted = max(1, min(self._decodes_queued + coming, self.max_batch))
        share = prompt_share(prompts, wanted)
        longest = self.slice_s * share
        return wanted, min(longest, (self.costs.decode_s(wanted) or 0.0) * share), longest

    def _take(self, prefill_too: bool) -> tuple[list[_Step], list[_Step]]:
        """The decode steps of the next batch, and (with ``prefill_too``) the oldest prefill chunk with
        the chunks that may compute with it."""
        decodes: list[_Step] = []
        sessions: set[tuple[str, int]] = set()
        most = self.max_batch
        rows = 0
        if self.latency_bound_s is not None:
            most = self.costs.rows_within(self.latency_bound_s, 4 * self.max_batch)
        for step in self._queue:
            if len(decodes) == self.max_batch:
                break
            # a session's steps run in order, one per cycle
            if step.batchable and step.key not in sessions and (not decodes or rows + step.rows <= most):
                decodes.append(step)
                rows += step.rows
                sessions.add(step.key)
        prefills: list[_Step] = []
        if prefill_too:
            oldest = next((s for s in self._queue if not s.batchable and s.key not in sessions), None)
            prefills = [oldest, *self._fitting([oldest], sessions)] if oldest is not None else []
        self._mark_taken(decodes + prefills)
        return decodes, prefills

    def _joining(self, steps: list[_Step]) -> list[_Step]:
        """The prefill chunks queued that may compute with ``steps`` (other sessions', while their tokens
        fit what the shard computes as one), taken."""
        joining = self._fitting(steps, set())
        self._mark_taken(joining)
        return joining

    def _fitting(self, steps: list[_Step], busy: set[tuple[str, int]]) -> list[_Step]:
        """The prefill chunks queued, oldest first, of sessions neither in ``steps`` nor ``busy`` (one
        chunk a session), that fit with ``steps`` into what the shard computes as one chunk."""
        sessions = busy | {s.key for s in steps}
        tokens = sum(s.rows for s in steps)
        joint = self._prefill_tokens() if self._run_prefill is not None else 0
        fitting: list[_Step] = []
        for step in self._queue:
            if step.batchable or step.key in sessions or tokens + step.rows > joint:
                continue
            fitting.append(step)
            sessions.add(step.key)
            tokens += step.rows
        return fitting

    def _mark_taken(self, taken: list[_Step]) -> None:
        for step in taken:
            step.taken = True
            if step.waiting_turn is not None:
                step.waiting_turn.cancel()
        self._queue = [s for s in self._queue if not s.taken]
        self._decodes_queued -= sum(s.batchable for s in taken)
        self._prompts_queued -= sum(not s.batchable for s in taken)

    async def _prefill_in_slices(self, steps: list[_Step]) -> tuple[list[StepResult | Exception], float]:
        """Prefill chunks through ``run_prefill``: each slice ends as :meth:`_slice_plan` says or once
        ``slice_s`` has passed, and the decode steps queued by then run as one batch before the next.

        Within the first ``slice_s`` of the run, a slice also ends when another prompt's chunk queues that
        may compute with it, and the run starts again with the chunks queued by then taken in (``steps``
        grows), up to ``RESTARTS_MAX`` times: prompts that arrive within milliseconds of each other (a
        burst of requests, each through its own entry work) are computed in one pass and decode in one
        wave, rather than the first alone and ahead of the rest for its whole prefill. Each start throws
        away what it computed, at most one slice (and the layer then in progress)."""
        assert self._run_prefill is not None
        clock = self._clock  # for pause(), on the compute thread, which has no Trio clock
        began, at = clock(), trio.current_time()
        restarts = 0

        def join_window() -> float:
            """Until when chunks of other prompts may still be taken in (the run starting again)."""
            room = self._prefill_tokens() - sum(s.rows for s in steps)
            return began + self.slice_s if room > 0 and restarts < RESTARTS_MAX else began

        joins_until = join_window()
        take_in = False  # the slice ended for chunks to take in
        joinable = self._prompts_queued  # those queued now did not fit, or are of these sessions
        wanted, least_s, longest_s = self._slice_plan(len(steps))

        def pause() -> bool:
            nonlocal take_in
            now = clock()
            spent = now - began
            if now < joins_until and self._prompts_queued > joinable:
                take_in = True
                return True
            return spent >= longest_s or (spent >= least_s and self._decodes_queued >= wanted)

        async def between() -> list[HiddenStateBundle]:
            nonlocal began, at, wanted, least_s, longest_s, joinable, joins_until, restarts, take_in
            self.stats.longest_slice_s = max(self.stats.longest_slice_s, trio.current_time() - at)
            decodes, _ = self._take(prefill_too=False)
            if decodes:
                self.stats.decodes_between_slices += 1
                await self._run_decodes(decodes)
            joining = self._joining(steps) if take_in else []
            take_in = False
            joinable = self._prompts_queued
            if joining:
                restarts += 1
                self.stats.prefill_restarts += 1
                self.stats.prefill_chunks += len(joining)
                self._count_run(len(steps), -1)
                self._count_run(len(steps) + len(joining), +1)
                steps.extend(joining)
            began, at = clock(), trio.current_time()
            if joining:
                joins_until = join_window()
            wanted, least_s, longest_s = self._slice_plan(len(steps))
            return [s.bundle for s in joining]

        outcome = await self._run_prefill([s.bundle for s in steps], pause, between)
        self.stats.longest_slice_s = max(self.stats.longest_slice_s, trio.current_time() - at)
        return outcome

    async def _run(self, steps: list[_Step]) -> None:
        """Compute ``steps`` and hand each its outcome; the compute is not interrupted by cancellation
        (the shard's state must stay consistent), so every waiting step gets its answer."""
        compute_s = 0.0
        try:
            with trio.CancelScope(shield=True):
                try:
                    outcomes: list[StepResult | BaseException]
                    if not steps[0].batchable and self._run_prefill is not None:
                        results, compute_s = await self._prefill_in_slices(steps)  # may take in more
                        outcomes = list(results)
                    elif len(steps) == 1:
                        result, compute_s = await self._run_one(steps[0].bundle)
                        outcomes = [result]
                    else:
                        results, compute_s = await self._run_batch([s.bundle for s in steps])
                        outcomes = list(results)
                except Exception as exc:  # the steps' error, not the turn holder's: each step gets it
                    outcomes = [exc] * len(steps)
        except BaseException as exc:
            for step in steps:
                step.finish(exc)
            raise
        # a step refused (its bundle did not fit the shard) computed nothing: its rows would teach the
        # cost tables, and the speed the card claims, a rate nothing ran at
        computed = all(not isinstance(o, BaseException) for o in outcomes)
        if steps[0].batchable:
            self.stats.decode_compute_s += compute_s
            if computed:
                self.costs.observe_decode(sum(s.rows for s in steps), compute_s)
        else:
            self.stats.prefill_compute_s += compute_s
            if computed:
                self.costs.observe_prefill(sum(s.rows for s in steps), compute_s)
            if self._run_prefill is None:  # a chunk computed whole stalls decode for all of it
                self.stats.longest_slice_s = max(self.stats.longest_slice_s, compute_s)
        for step, outcome in zip(steps, outcomes, strict=True):
            step.finish(outcome, compute_s)
