"""How fast this peer decodes its own range, measured once after loading, for cards and routing."""

from __future__ import annotations

import os
import time

import torch

from meshd.runtime.shard import HIDDEN_STATES, INPUT_IDS, Shard
from meshd.wire.bundle import HiddenStateBundle, Phase

PROBE_PROMPT_TOKENS = 8
WARMUP_STEPS = 2
TIMED_STEPS = 8


def measure_decode_tok_s(shard: Shard) -> float:
    """Decode tokens per second of ``shard`` alone: the median of a few steps of a throw-away session.

    Runs on the caller's thread (the shard's compute thread) and releases its session whatever happens.
    """
    spec = shard.spec
    session = f"speed-probe-{os.getpid()}"

    def bundle(position: int, n: int) -> HiddenStateBundle:
        tensors = ({INPUT_IDS: torch.zeros(n, dtype=torch.long)} if spec.is_head
                   else {HIDDEN_STATES: torch.zeros(n, spec.hidden_size, dtype=spec.dtype)})
        return HiddenStateBundle(session_id=session, epoch=0, phase=Phase.PREFILL if position == 0 else Phase.DECODE,
                                 start_position=position, token_count=n, tensors=tensors, range_start=spec.start,
                                 range_end=spec.end, sample=True)

    try:
        shard.forward(bundle(0, PROBE_PROMPT_TOKENS))
        position = PROBE_PROMPT_TOKENS
        for _ in range(WARMUP_STEPS):
            shard.forward(bundle(position, 1))
            position += 1
        timings = []
        for _ in range(TIMED_STEPS):
            started = time.perf_counter()
            shard.forward(bundle(position, 1))
            timings.append(time.perf_counter() - started)
            position += 1
    finally:
        shard.release(session, 0)
    median = sorted(timings)[len(timings) // 2]
    return 1.0 / median if median > 0 else 0.0
