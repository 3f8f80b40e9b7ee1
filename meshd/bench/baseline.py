"""The baseline: the whole model in this process, transformers ``generate()`` with its KV cache."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from meshd.runtime.numerics import Numerics


@dataclass(frozen=True)
class BaselineResult:
    token_ids: list[int]
    decode_tok_s: float  # tokens after the first, over the time from the first new token to the last
    ttft_ms: float  # generate() called -> first new token (prefill and one sample)
    runs_tok_s: list[float]
    runs_ttft_ms: list[float]
    rss_mb: float  # this process with the model loaded, after generating (weights are mapped lazily)
    model_bytes: int  # every parameter of the full model
    torch_threads: int


class _Timestamps:
    """A ``generate()`` streamer that records when each new token comes out.

    transformers hands the streamer the prompt first, then each new token as it is chosen.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class Baseline:
    """The whole model loaded once in this process; :meth:`measure` times greedy generation of exactly
    ``new_tokens`` (no EOS stop) per token, as often as asked (the benchmark measures it again
    between meshes, so that every mesh is compared with a baseline taken next to it in time). With
    ``int8``, its linears compute as the peers' do at ``--dtype int8`` (:mod:`meshd.runtime.int8`); with
    ``numerics``, as peers of that class do where their kernels are not torch's own
    (:func:`meshd.runtime.numerics.linears_like`), so that its tokens compare like with like, routed at
    its modules and over weights that start on a cache line as the peers' are
    (:func:`meshd.runtime.numerics.route_linears`, :func:`meshd.runtime.loader.aligned_weights`), so
    that its speed does too."""

    def __init__(self, model_dir: Path, prompt_ids: list[int], new_tokens: int, dtype: Any = None,
                 int8: bool = False, numerics: Numerics | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from meshd.runtime.int8 import int8_bytes, quantize_linears, release_freed_memory
        from meshd.runtime.loader import aligned_weights
        from meshd.runtime.numerics import route_linears

        self.numerics = numerics
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32)
        if numerics is not None:
            aligned_weights(self.model)
        if int8:
            quantize_linears(self.model)
            release_freed_memory()
        route_linears(self.model.eval())
        self.model_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.model_bytes += int8_bytes(self.model)
        self.prompt_ids = list(prompt_ids)
        self.new_tokens = new_tokens
        self.token_ids: list[int] | None = None
        self._generate(min(4, new_tokens))  # warm-up: first-call allocations and kernel selection

    def batched_tok_s(self, batch: int) -> float:
        """Tokens per second of one greedy ``generate()`` over ``batch`` copies of the prompt, all its
        new tokens over the wall time from the call to the end (as the mesh's aggregate is taken):
        the ceiling for concurrent sessions on one machine."""
        import time

        import torch
        from transformers import GenerationConfig

        from meshd.runtime.numerics import linears_like, routed

        input_ids = torch.tensor([self.prompt_ids] * batch)
        config = GenerationConfig(max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=self.model.config.pad_token_id)
        started = time.perf_counter()
        with torch.inference_mode(), routed(linears_like(self.numerics)):
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
        wall = time.perf_counter() - started
        return batch * (out.shape[1] - len(self.prompt_ids)) / wall

    def _generate(self, max_new: int, streamer: Any = None) -> Any:
        import torch
        from transformers import GenerationConfig

        from meshd.runtime.numerics import linears_like, routed

        input_ids = torch.tensor([self.prompt_ids])
        config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                                  pad_token_id=self.model.config.pad_token_id)
        with torch.inference_mode(), routed(linears_like(self.numerics)):
            return self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                       generation_config=config, streamer=streamer)

    def measure(self, runs: int) -> BaselineResult:
        import torch

        def once() -> tuple[list[int], list[float], float]:
            stamps = _Timestamps()
            started = time.perf_counter()
            out = self._generate(self.new_tokens, stamps)
            return out[0, len(self.prompt_ids):].tolist(), stamps.times, started

        result = measure_runs(once, runs, self.token_ids, self.model_bytes, torch.get_num_threads())
        self.token_ids = result.token_ids
        return result


def measure_runs(once: Callable[[], tuple[list[int], list[float], float]], runs: int,
                 expected: list[int] | None, model_bytes: int, threads: int) -> BaselineResult:
    """``runs`` greedy generations by ``once`` (token ids, each token's arrival time, the start time),
    checked to give the same tokens every time (and ``expected``, when given); medians of the runs."""
    runs_tok_s: list[float] = []
    runs_ttft_ms: list[float] = []
    token_ids = expected
    for _ in range(runs):
        ids, stamps, started = once()
        if token_ids is not None and ids != token_ids:
            raise RuntimeError("the baseline's greedy generation is not deterministic across runs")
        token_ids = ids
        runs_ttft_ms.append((stamps[0] - started) * 1000)
        span = stamps[-1] - stamps[0]
        runs_tok_s.append((len(stamps) - 1) / span if span > 0 else 0.0)
    assert token_ids is not None
    return BaselineResult(
        token_ids=token_ids, decode_tok_s=statistics.median(runs_tok_s), ttft_ms=statistics.median(runs_ttft_ms),
        runs_tok_s=runs_tok_s, runs_ttft_ms=runs_ttft_ms, rss_mb=psutil.Process().memory_info().rss / 2**20,
        model_bytes=model_bytes, torch_threads=threads,
    )
