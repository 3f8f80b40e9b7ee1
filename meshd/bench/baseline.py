"""The baseline: the whole model in this process, transformers ``generate()`` with its KV cache."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import psutil


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

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_baseline(model_dir: Path, prompt_ids: list[int], new_tokens: int, runs: int = 3) -> BaselineResult:
    """Greedy generation of exactly ``new_tokens`` (no EOS stop), timed per token."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    input_ids = torch.tensor([prompt_ids])
    attention_mask = torch.ones_like(input_ids)

    def generate(max_new: int, streamer=None):
        config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                                  pad_token_id=model.config.pad_token_id)
        with torch.inference_mode():
            return model.generate(input_ids, attention_mask=attention_mask, generation_config=config,
                                  streamer=streamer)

    generate(min(4, new_tokens))  # warm-up: first-call allocations and kernel selection
    token_ids: list[int] | None = None
    runs_tok_s: list[float] = []
    runs_ttft_ms: list[float] = []
    for _ in range(runs):
        stamps = _Timestamps()
        started = time.perf_counter()
        out = generate(new_tokens, stamps)
        ids = out[0, len(prompt_ids):].tolist()
        if token_ids is not None and ids != token_ids:
            raise RuntimeError("greedy baseline generation is not deterministic across runs")
        token_ids = ids
        runs_ttft_ms.append((stamps.times[0] - started) * 1000)
        span = stamps.times[-1] - stamps.times[0]
        runs_tok_s.append((len(stamps.times) - 1) / span if span > 0 else 0.0)
    assert token_ids is not None
    rss_mb = psutil.Process().memory_info().rss / 2**20
    threads = torch.get_num_threads()
    return BaselineResult(
        token_ids=token_ids, decode_tok_s=statistics.median(runs_tok_s), ttft_ms=statistics.median(runs_ttft_ms),
        runs_tok_s=runs_tok_s, runs_ttft_ms=runs_ttft_ms, rss_mb=rss_mb, model_bytes=model_bytes,
        torch_threads=threads,
    )
