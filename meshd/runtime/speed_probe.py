"""How fast this peer decodes its own range, measured once after loading, for cards and routing."""

from __future__ import annotations

import os
import time

import torch

from meshd.runtime.shard import HIDDEN_STATES, INPUT_IDS, Shard
from meshd.wire.bundle import HiddenStateBundle, Phase

TIMING_SESSION = "meshd-timing-"  # sessions of these timings start so: no client's, none counted as load
PROBE_PROMPT_TOKENS = 8
WARMUP_STEPS = 2
TIMED_STEPS = 8


def decode_steps(shard: Shard, steps: int, name: str) -> list[float]:
    """Seconds of each of ``steps`` decode steps of a throw-away session of ``shard`` (after a short
    prefill and a warm-up). Runs on the caller's thread (the shard's compute thread) and releases the
    session whatever happens."""
    spec = shard.spec
    session = TIMING_SESSION + name

    def bundle(position: int, n: int) -> HiddenStateBundle:
        tensors = ({INPUT_IDS: torch.zeros(n, dtype=torch.long)} if spec.is_head
                   else {HIDDEN_STATES: torch.zeros(n, spec.hidden_size, dtype=spec.dtype)})
        return HiddenStateBundle(session_id=session, epoch=0, phase=Phase.PREFILL if position == 0 else Phase.DECODE,
                                 start_position=position, token_count=n, tensors=tensors, range_start=spec.start,
                                 range_end=spec.end, sample=True)

    timings = []
    try:
        shard.forward(bundle(0, PROBE_PROMPT_TOKENS))
        position = PROBE_PROMPT_TOKENS
        for _ in range(WARMUP_STEPS):
            shard.forward(bundle(position, 1))
            position += 1
        for _ in range(steps):
            started = time.perf_counter()
            shard.forward(bundle(position, 1))
            timings.append(time.perf_counter() - started)
            position += 1
    finally:
        shard.release(session, 0)
    return timings


def measure_decode_tok_s(shard: Shard) -> float:
    """Decode tokens per second of ``shard`` alone: the median of a few steps of a throw-away session."""
    timings = decode_steps(shard, TIMED_STEPS, f"probe-{os.getpid()}")
    median = sorted(timings)[len(timings) // 2]
    return 1.0 / median if median > 0 else 0.0
