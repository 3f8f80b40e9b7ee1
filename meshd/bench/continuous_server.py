"""The serving benchmark's ceiling of one machine: the whole model as one shard in the bench process,
batching step by step.

A static batch (:class:`~meshd.bench.batch_server.OneProcessServer`) makes a request that arrives
while it computes wait for all of it, which is what one process gets from transformers'
``generate()``. This server schedules every step instead: each cycle runs one decode step of every
running request as one batch, then one slice of the oldest waiting prompt's prefill (``SLICE_S``, a
layer at least), then decodes again. Where the shard computes prompts of several sessions as one
(:attr:`~meshd.runtime.shard.Shard.prefills_share_rows`), the next chunks of the prompts waiting
behind the oldest join its chunk, up to one chunk's tokens, and their slices last longer, per
session against the running requests, as at a peer. A run whose first slice saw more prompts arrive
that may compute with it starts again with them, as at a peer, up to ``RESTARTS_MAX`` times. A peer's batcher
(:mod:`meshd.runtime.batching`) slices prompts in the same ``PrefillRun`` pieces but may end a slice
sooner, once the decode steps it expects are queued and the slice has computed about as long as
their batch will; here a slice always runs its full time, since every running request is waiting
for the next cycle. A request joins the batch as soon as its prompt is computed and leaves it with
its last token, and a prompt stalls the running requests by one slice at most.

It computes through the very :class:`~meshd.runtime.shard.Shard` a peer runs, holding every layer
``[0, n)``, in the peers' numerics class: the mesh's own engine on one machine, without the network,
the codec or a second process. Loading and every step run on the server's compute thread
(:class:`~meshd.bench.batch_server.ThreadedServer`).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.bench.batch_server import Pending, ThreadedServer
from meshd.runtime.batching import RESTARTS_MAX, SLICE_S, prompt_share
from meshd.runtime.numerics import Numerics

PREFILL_CHUNK = 512  # tokens per prefill chunk, as the mesh's entry cuts a prompt


@dataclass
class _Request(Pending):
    """One request from its arrival to its last token."""

    session_id: str = ""
    chunked: bool = False  # its prompt has been cut into prefill bundles
    chunks: deque[Any] = field(default_factory=deque)  # prefill bundles not yet started
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    @property
    def position(self) -> int:
        """Where its next decode step starts: the prompt and every token but the last are in the KV."""
        return len(self.prompt_ids) + len(self.tokens) - 1

    def took(self, token: int) -> bool:
        """Record a token as it comes out; True once the request has all it asked for."""
        self.tokens.append(token)
        self.times.append(time.perf_counter())
        return len(self.tokens) >= self.new_tokens


class ContinuousServer(ThreadedServer):
    """The model loaded once as a whole-range shard of the class ``numerics``. At most ``max_batch``
    requests are running or prefilling at a time; the rest wait in arrival order."""

    label = "the continuous server"

    def __init__(self, model_dir: Path, numerics: Numerics, threads: int, warm_up: bool = True,
                 slice_s: float = SLICE_S) -> None:
        self.numerics = numerics
        self.slice_s = slice_s
        self.prefill_slices = 0
        self.prefill_runs: Counter[int] = Counter()  # prefill computes by how many prompts' chunks went together
        self.prefill_restarts = 0
        self.longest_slice_s = 0.0
        self.shard: Any = None
        self._prefill: tuple[Any, list[tuple[_Request, Any]]] | None = None  # the run in progress, its chunks
        self._restarts = 0  # how often the run in progress started again to take in prompts
        self._slices = 0  # slices computed since the run in progress (re)started
        self._ids = itertools.count()
        super().__init__(model_dir, threads, warm_up)

    def reset_stats(self) -> None:
        super().reset_stats()
        self.prefill_slices = 0
        self.prefill_runs = Counter()
        self.prefill_restarts = 0
        self.longest_slice_s = 0.0

    def stats(self) -> dict[str, Any]:
        """Its decode steps by batch size, and the prefill slices run since the last reset."""
        return super().stats() | {"prefill_slices": self.prefill_slices,
                                  "prefill_runs": {str(k): v for k, v in sorted(self.prefill_runs.items())},
                                  "prefill_restarts": self.prefill_restarts,
                                  "decode_stall_bound_ms": round(self.longest_slice_s * 1000, 3)}

    def _pending(self, prompt_ids: list[int], new_tokens: int) -> Pending:
        return _Request(prompt_ids, new_tokens, session_id=f"serve-{next(self._ids)}")

    # -- the compute thread ----------------------------------------------------------------------

    def _load(self, model_dir: Path) -> None:
        from meshd.runtime.loader import load_config
        from meshd.runtime.shard import Shard

        self.shard = Shard(model_dir, 0, load_config(model_dir).num_hidden_layers, numerics=self.numerics,
                           max_chunk_tokens=PREFILL_CHUNK)

    def _serve_queue(self) -> None:
        running: list[_Request] = []  # decoding
        prefilling: deque[_Request] = deque()  # admitted, prompt not yet computed
        while True:
            with self._wake:
                while not (self._queue or running or prefilling or self._closed):
                    self._wake.wait()
                if self._closed:
                    for request in [*running, *prefilling, *self._queue]:
                        assert isinstance(request, _Request)
                        self._fail(request, RuntimeError("the continuous server closed"))
                    return
                while self._queue and len(running) + len(prefilling) < self.max_batch:
                    admitted = self._queue.popleft()
                    assert isinstance(admitted, _Request)
                    prefilling.append(admitted)
            try:
                running = self._cycle(running, prefilling)
            except Exception as exc:  # every admitted request hears of it; the server keeps serving
                for request in [*running, *prefilling]:
                    self._fail(request, exc)
                running, prefilling = [], deque()

    def _cycle(self, running: list[_Request], prefilling: deque[_Request]) -> list[_Request]:
        """One decode step of the running requests, then one prefill slice (a request whose prompt fails
        gets its error alone); the requests running after it."""
        if running:
            running = self._decode(running)
        if not prefilling:
            return running
        for request, outcome in self._prefill_slice(prefilling, len(running)):
            prefilling.remove(request)
            if isinstance(outcome, Exception):
                self._fail(request, outcome)
            elif request.took(outcome):
                self._finish(request)
            else:
                running.append(request)
        return running

    def _prefill_slice(self, prefilling: deque[_Request], decoding: int) -> list[tuple[_Request, int | Exception]]:
        """Compute one slice of the prefill in progress, first starting one when none is: the oldest
        waiting prompt's next chunk, with those of the prompts behind it that may compute with it; it
        lasts longer for several prompts than ``decoding`` requests, as at a peer (``prompt_share``).
        Each request whose prompt ended with the run, and its first token or its error."""
        try:
            if self._prefill is None:
                self._prefill = self._start_prefill(prefilling)
                self._restarts = self._slices = 0
            elif self._slices == 1 and self._restarts < RESTARTS_MAX and self._may_join(prefilling, self._prefill[1]):
                self._restart(prefilling)  # prompts admitted during its first slice
        except Exception as exc:
            return [(prefilling[0], exc)]
        run, members = self._prefill
        started = time.monotonic()
        deadline = started + self.slice_s * prompt_share(len(members), decoding)
        try:
            done = run.advance(lambda: time.monotonic() >= deadline)
        except Exception as exc:  # the run undid itself: every prompt in it fails
            self._prefill = None
            return [(request, exc) for request, _ in members]
        finally:
            self._slices += 1
            self.prefill_slices += 1
            self.longest_slice_s = max(self.longest_slice_s, time.monotonic() - started)
        if not done:
            return []
        self._prefill = None
        ended: list[tuple[_Request, int | Exception]] = []
        for (request, _), outcome in zip(members, run.finish(), strict=True):
            if isinstance(outcome, Exception):
                ended.append((request, outcome))
            elif request.chunks:
                continue
            elif outcome.token is None:
                ended.append((request, RuntimeError(f"the prefill of {request.session_id} gave no token")))
            else:
                ended.append((request, int(outcome.token)))
        return ended

    def _may_join(self, prefilling: deque[_Request], members: list[tuple[_Request, Any]]) -> bool:
        """Whether a prompt waiting behind the run's may compute with it: the shard computes prompts as
        one, and its next chunk fits what a run may hold."""
        if not self.shard.prefills_share_rows:
            return False
        tokens = sum(bundle.token_count for _, bundle in members)
        inside = {id(request) for request, _ in members}
        for request in prefilling:
            if id(request) in inside:
                continue
            size = request.chunks[0].token_count if request.chunked else min(len(request.prompt_ids), PREFILL_CHUNK)
            if tokens + size <= PREFILL_CHUNK:
                return True
        return False

    def _restart(self, prefilling: deque[_Request]) -> None:
        """Undo the run in progress and start it again with the prompts waiting that may join it."""
        assert self._prefill is not None
        run, members = self._prefill
        run.abort()
        for request, bundle in reversed(members):
            request.chunks.appendleft(bundle)
        self.prefill_runs[len(members)] -= 1
        self.prefill_runs += Counter()  # drops the count that went to zero
        self._prefill = None
        self._prefill = self._start_prefill(prefilling)
        self._restarts += 1
        self._slices = 0
        self.prefill_restarts += 1

    def _start_prefill(self, prefilling: deque[_Request]) -> tuple[Any, list[tuple[_Request, Any]]]:
        from meshd.runtime.chain import input_bundles
        from meshd.wire.bundle import Sampling

        joint = PREFILL_CHUNK if self.shard.prefills_share_rows else 0
        members: list[tuple[_Request, Any]] = []
        tokens = 0
        for request in prefilling:
            if not request.chunked:
                request.chunked = True
                request.chunks.extend(input_bundles(request.session_id, 0, request.prompt_ids, 0, PREFILL_CHUNK,
                                                    (0, self.shard.spec.n_layers), Sampling()))
            size = request.chunks[0].token_count
            if members and tokens + size > joint:
                continue
            members.append((request, request.chunks.popleft()))
            tokens += size
        try:
            run = self.shard.start_prefill([bundle for _, bundle in members])
            self.prefill_runs[len(members)] += 1
            return run, members
        except Exception:
            for request, bundle in members:
                request.chunks.appendleft(bundle)
            raise

    def _decode(self, running: list[_Request]) -> list[_Request]:
        """One decode step of every running request as one batch; the requests still running after it."""
        from meshd.runtime.chain import input_bundles
        from meshd.wire.bundle import Sampling

        head = (0, self.shard.spec.n_layers)
        bundles = [next(input_bundles(r.session_id, 0, r.tokens[-1:], r.position, 1, head, Sampling(),
                                      step=len(r.tokens))) for r in running]
        outcomes = self.shard.forward_batch(bundles)
        self.batch_sizes[len(running)] += 1
        still: list[_Request] = []
        for request, outcome in zip(running, outcomes, strict=True):
            if isinstance(outcome, Exception):
                self._fail(request, outcome)
            elif outcome.token is None:
                self._fail(request, RuntimeError(f"the decode step of {request.session_id} gave no token"))
            elif request.took(int(outcome.token)):
                self._finish(request)
            else:
                still.append(request)
        return still

    def _finish(self, request: _Request) -> None:
        self.shard.release(request.session_id, 0)
        request.future.set_result((tuple(request.times), tuple(request.tokens)))

    def _fail(self, request: _Request, exc: BaseException) -> None:
        """The request's client hears of ``exc``; its KV goes, and every other request keeps running (a
        prefill it was computed in is undone, and the others' chunks run again)."""
        if self._prefill is not None and any(r is request for r, _ in self._prefill[1]):
            run, members = self._prefill
            self._prefill = None
            run.abort()
            for member, bundle in members:
                member.chunks.appendleft(bundle)
        if self.shard is not None:
            self.shard.release(request.session_id, 0)
        if not request.future.done():
            request.future.set_exception(exc)
