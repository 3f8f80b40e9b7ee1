"""The serving benchmark's one process in static batches, and what both its one-process servers share.

Both hold the whole model in the bench process on a compute thread of their own, with the requests
queued to it (:class:`ThreadedServer`). This one serves them in static batches
(:class:`OneProcessServer`); :mod:`meshd.bench.continuous_server` batches step by step.

Whenever the model is free, the compute thread takes the requests that have arrived (up to
``max_batch``, oldest first) and runs one batched greedy ``generate()`` over them: prompts left-padded
with an attention mask, as many steps as the longest output asked for, no EOS stop. A batch runs to
its end before the next one starts (static batching, the way one process batches with transformers'
``generate()``); requests that arrive meanwhile wait for the next batch.

Streamers see only one sequence, so a ``LogitsProcessor`` stamps the time of every step for the whole
batch and records each row's greedy choice (the argmax of the scores it returns unchanged, which is
what greedy ``generate()`` picks; it is the last processor in the list). A request is answered as soon
as its own last token is out, not when the batch ends: a closed-loop client then sends its next
request while the batch still computes, and that request's wait for the model counts in its TTFT.

Loading and every ``generate()`` run on one thread of its own, so the clients' threads keep their
arrival schedule while a batch computes (torch releases the GIL inside its kernels), and so that only
that thread gets an OpenMP team, as a peer's compute thread (:mod:`meshd.runtime.host` says why). A
batch starts once its first request has waited ``GATHER_S``, so that requests sent together (a
closed loop starting) are batched together.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from meshd.runtime.numerics import Numerics, linears_like, route_linears, routed

GATHER_S = 0.005  # a batch waits this long after its first request for others sent with it


@dataclass(frozen=True)
class Served:
    """One answered request as its client received it."""

    token_times: tuple[float, ...]  # ``time.perf_counter()`` when each streamed token (or chunk) came out
    completion_tokens: int
    text: str
    token_ids: tuple[int, ...] = ()  # known where the server is in this process


@dataclass
class Pending:
    """A request queued for a one-process server: answered with its tokens' times and ids."""

    prompt_ids: list[int]
    new_tokens: int
    future: Future[tuple[tuple[float, ...], tuple[int, ...]]] = field(default_factory=Future)


class ThreadedServer:
    """The model on a compute thread of its own, requests queued to it: :meth:`serve` blocks its caller
    until the request is answered. Subclasses load the model (:meth:`_load`) and serve the queue
    (:meth:`_serve_queue`) on that thread; at most ``max_batch`` requests are computed together."""

    label = "the one-process server"

    def __init__(self, model_dir: Path, threads: int, warm_up: bool = True) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.threads = threads
        self.max_batch = 1
        self.batch_sizes: Counter[int] = Counter()  # batches run, by size, since the last :meth:`reset_stats`
        self._queue: deque[Pending] = deque()
        self._wake = threading.Condition()
        self._closed = False
        loaded: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(model_dir, loaded), name=type(self).__name__,
                                        daemon=True)
        self._thread.start()
        loaded.result()
        if warm_up:  # first-call allocations and kernel selection, on the compute thread
            self._warm_up()

    def _warm_up(self) -> None:
        ids = list(self.tokenizer("warm up")["input_ids"])
        self.max_batch = 2
        done = [self._submit(ids[:n], 4) for n in (len(ids), 1)]
        for future in done:
            future.result()
        self.max_batch = 1
        self.reset_stats()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def reset_stats(self) -> None:
        self.batch_sizes.clear()

    def stats(self) -> dict[str, Any]:
        """The batches run since the last reset, in the shape of a peer's ``/stats`` ``batches``."""
        batches = sum(self.batch_sizes.values())
        rows = sum(size * n for size, n in self.batch_sizes.items())
        return {"batches": batches, "mean_batch": rows / batches if batches else None,
                "largest_batch": max(self.batch_sizes, default=0),
                "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())}}

    def serve(self, prompt_ids: list[int], new_tokens: int) -> Served:
        """Queue a request for exactly ``new_tokens`` greedy tokens after ``prompt_ids``, as arrived now,
        and wait for its answer."""
        times, ids = self._submit(prompt_ids, new_tokens).result()
        return Served(times, len(ids), self.tokenizer.decode(list(ids), skip_special_tokens=True), ids)

    def _submit(self, prompt_ids: list[int], new_tokens: int) -> Future[tuple[tuple[float, ...], tuple[int, ...]]]:
        if new_tokens < 1 or not prompt_ids:
            raise ValueError("a request needs a prompt and at least one new token")
        pending = self._pending(list(prompt_ids), new_tokens)
        with self._wake:
            if self._closed:
                raise RuntimeError(f"{self.label} is closed")
            self._queue.append(pending)
            self._wake.notify()
        return pending.future

    def _pending(self, prompt_ids: list[int], new_tokens: int) -> Pending:
        return Pending(prompt_ids, new_tokens)

    def _run(self, model_dir: Path, loaded: Future[None]) -> None:
        import torch

        torch.set_num_threads(self.threads)  # this thread's OpenMP team, as the bench process's
        try:
            self._load(model_dir)
        except BaseException as exc:
            loaded.set_exception(exc)
            return
        loaded.set_result(None)
        self._serve_queue()

    def _load(self, model_dir: Path) -> None:
        raise NotImplementedError

    def _serve_queue(self) -> None:
        raise NotImplementedError


class OneProcessServer(ThreadedServer):
    """The model loaded once with transformers, serving in static batches; with ``numerics``, its
    weights start on a cache line as the peers' do, and with ``numerics`` of int8 weights, its linears
    are int8 as the peers' are."""

    def __init__(self, model_dir: Path, dtype: Any, threads: int, warm_up: bool = True,
                 numerics: Numerics | None = None) -> None:
        self.numerics = numerics  # its linears compute as peers of this class do (linears_like)
        self.dtype = dtype
        self.model: Any = None
        self.pad_token_id = 0
        super().__init__(model_dir, threads, warm_up)

    def _load(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        from meshd.runtime.int8 import quantize_linears, release_freed_memory
        from meshd.runtime.loader import aligned_weights

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype)
        if self.numerics is not None:
            aligned_weights(model)
        if self.numerics is not None and self.numerics.int8:  # as the peers' (and the bench baseline's) int8
            quantize_linears(model)
            release_freed_memory()
        self.model = route_linears(model.eval())

    def _serve_queue(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                deadline = time.monotonic() + GATHER_S
                while len(self._queue) < self.max_batch and not self._closed and time.monotonic() < deadline:
                    self._wake.wait(deadline - time.monotonic())
                if self._closed:
                    for pending in self._queue:
                        pending.future.set_exception(RuntimeError("the one-process server closed"))
                    return
                batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
            try:
                self._generate(batch)
            except BaseException as exc:  # every waiting client hears of it; the server keeps serving
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(exc)

    def _generate(self, batch: list[Pending]) -> None:
        import torch
        from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

        prompts = [pending.prompt_ids for pending in batch]
        lengths = [pending.new_tokens for pending in batch]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        times: list[float] = []
        chosen: list[list[int]] = [[] for _ in batch]

        class Stamps(LogitsProcessor):
            def __call__(self, ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
                times.append(time.perf_counter())
                step = len(times)
                for row, token in enumerate(scores.argmax(dim=-1).tolist()):
                    if step <= lengths[row]:
                        chosen[row].append(token)
                    if step == lengths[row]:
                        batch[row].future.set_result((tuple(times), tuple(chosen[row])))
                return scores

        config = GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=None,
                                  pad_token_id=self.pad_token_id)
        self.batch_sizes[len(batch)] += 1
        with torch.inference_mode(), routed(linears_like(self.numerics)):
            self.model.generate(input_ids, attention_mask=mask, generation_config=config,
                                logits_processor=LogitsProcessorList([Stamps()]))
