"""How fast this peer decodes and prefills its own range, measured once after loading, for cards,
routing and the choice of prefill workers."""

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
PREFILL_PROBE_TOKENS = 256  # chunks this long say what a long prompt's prefill costs per token


def decode_steps(shard: Shard, steps: int, name: str) -> list[float]:
    """Seconds of each of ``steps`` decode steps of a throw-away session of ``shard`` (after a short
    prefill and a warm-up). Runs on the caller's thread (the shard's compute thread) and releases the
    session whatever happens."""
    session = TIMING_SESSION + name

    def bundle(position: int, n: int) -> HiddenStateBundle:
        return _probe_bundle(shard, session, position, n)

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


def _probe_bundle(shard: Shard, session: str, position: int, n: int, prefill: bool = False) -> HiddenStateBundle:
    """``n`` positions from ``position`` of a throw-away session (a prefill chunk at position 0, or when
    ``prefill``, else a decode step): zeros, as the head or a later hop takes them."""
    spec = shard.spec
    tensors = ({INPUT_IDS: torch.zeros(n, dtype=torch.long)} if spec.is_head
               else {HIDDEN_STATES: torch.zeros(n, spec.hidden_size, dtype=spec.dtype)})
    phase = Phase.PREFILL if prefill or position == 0 else Phase.DECODE
    return HiddenStateBundle(session_id=session, epoch=0, phase=phase, start_position=position, token_count=n,
                             tensors=tensors, range_start=spec.start, range_end=spec.end, sample=True)


def measure_prefill_tok_s(shard: Shard) -> float:
    """Prefill tokens per second of ``shard`` alone: the second of two chunks of ``PREFILL_PROBE_TOKENS``
    of a throw-away session (the first warms this size's kernels up)."""
    session = f"{TIMING_SESSION}prefill-{os.getpid()}"
    try:
        shard.forward(_probe_bundle(shard, session, 0, PREFILL_PROBE_TOKENS))
        started = time.perf_counter()
        shard.forward(_probe_bundle(shard, session, PREFILL_PROBE_TOKENS, PREFILL_PROBE_TOKENS, prefill=True))
        took = time.perf_counter() - started
    finally:
        shard.release(session, 0)
    return PREFILL_PROBE_TOKENS / took if took > 0 else 0.0


def measure_decode_tok_s(shard: Shard) -> float:
    """Decode tokens per second of ``shard`` alone: the median of a few steps of a throw-away session."""
    timings = decode_steps(shard, TIMED_STEPS, f"probe-{os.getpid()}")
    median = sorted(timings)[len(timings) // 2]
    return 1.0 / median if median > 0 else 0.0
