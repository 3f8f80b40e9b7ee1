"""Run inputs through a shard and read what each of its layers gave, position by position.

The prompt is prefilled in chunks and every later position runs as a decode step, through the
shard's own ``forward``: the code path, shapes and numerics of a real session's steps, so a trace
sees what a session would. It runs in a throw-away session that is released at the end whatever
happens, and only when the KV it needs is free: a trace never evicts another session. Layer outputs
are read by forward hooks on the shard's decoder layers, registered and removed inside the one call
on the compute thread, so no other session's step runs while they are there.

The hops of a traced route and the one-process reference run this same function, so whatever two
traces differ by is the computation, not the way it was read.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshd.errors import ErrorCode, MeshError, ShapeMismatch
from meshd.runtime.numerics import routed
from meshd.runtime.shard import HIDDEN_STATES, INPUT_IDS, Shard, ShardSpec
from meshd.runtime.speed_probe import TIMING_SESSION
from meshd.trace.limits import MAX_TRACE_DECODE_STEPS, MAX_TRACE_POSITIONS, MAX_TRACE_REPLY_BYTES
from meshd.wire.bundle import HiddenStateBundle, Phase

# a trace's session is no client's: not counted as load (see ShardHost.active_sessions)
TRACE_SESSION = TIMING_SESSION + "trace-"
LAYERS = "layers"
LOGITS = "logits"


class TraceRefused(MeshError):
    """A trace this shard does not run: inputs outside the bounds, or a shard whose layers cannot be read."""

    code = ErrorCode.BAD_REQUEST


class TraceNoRoom(MeshError):
    """The trace's KV does not fit what is free on this hop; running it would evict other sessions."""

    code = ErrorCode.KV_BUDGET


@dataclass
class ShardTrace:
    """What a shard's layers gave for every position of a trace."""

    hidden: torch.Tensor                # [n, hidden]: the range's output (at the tail, before the final norm)
    layers: torch.Tensor | None         # [end - start, n, hidden]: each layer's output, when asked
    logits: torch.Tensor | None         # tail: [decode steps + 1, vocab] float32, where tokens are sampled
    tokens: list[int]                   # the greedy continuation, when the trace was asked to generate one
    compute_ms: float


def layers_readable(shard: Shard) -> bool:
    """Whether the shard computes with torch decoder layers that hooks can read (not llama.cpp's)."""
    layers = getattr(shard, "layers", None)
    return isinstance(layers, nn.ModuleList) and len(layers) == shard.spec.end - shard.spec.start


def reply_bytes(spec: ShardSpec, positions: int, decode_steps: int, layers: bool) -> int:
    """Raw bytes of the tensors a trace of ``positions`` positions answers on a shard of ``spec``."""
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    states = positions * spec.hidden_size * itemsize * (1 + (spec.end - spec.start if layers else 0))
    return states + ((decode_steps + 1) * spec.vocab_size * 4 if spec.is_tail else 0)


def check_bounds(spec: ShardSpec, positions: int, prefill_tokens: int, chunk_tokens: int, max_chunk_tokens: int,
                 layers: bool) -> None:
    """Raise :class:`TraceRefused` unless a trace of these sizes is one this shard runs and answers."""
    if positions < 1:
        raise TraceRefused("a trace needs at least one position")
    if positions > MAX_TRACE_POSITIONS:
        raise TraceRefused(f"a trace covers at most {MAX_TRACE_POSITIONS} positions, not {positions}")
    if not 1 <= prefill_tokens <= positions:
        raise TraceRefused(f"prefill_tokens is {prefill_tokens}; it must lie in [1, {positions}] (the positions)")
    decode_steps = positions - prefill_tokens
    if decode_steps > MAX_TRACE_DECODE_STEPS:
        raise TraceRefused(f"a trace runs at most {MAX_TRACE_DECODE_STEPS} decode steps, not {decode_steps}")
    if not 1 <= chunk_tokens <= max_chunk_tokens:
        raise TraceRefused(f"chunk_tokens is {chunk_tokens}; this shard takes chunks of 1 to {max_chunk_tokens}")
    size = reply_bytes(spec, positions, decode_steps, layers)
    if size > MAX_TRACE_REPLY_BYTES:
        raise TraceRefused(f"the answer would carry {size} bytes of tensors (limit {MAX_TRACE_REPLY_BYTES}): trace a "
                           "shorter prompt" + (", or without every layer's output" if layers else ""))


def check_inputs(spec: ShardSpec, inputs: torch.Tensor) -> None:
    """Raise :class:`ShapeMismatch` unless ``inputs`` are what a shard of ``spec`` takes for a whole
    trace: token ids ``[n]`` at the head, hidden states ``[n, hidden]`` in its dtype elsewhere."""
    n = int(inputs.shape[0]) if inputs.dim() else 0
    if spec.is_head:
        if inputs.dtype != torch.int64 or inputs.dim() != 1:
            raise ShapeMismatch(f"the head's trace input is int64 token ids [n], not {inputs.dtype} "
                                f"{list(inputs.shape)}")
        if n and (int(inputs.min()) < 0 or int(inputs.max()) >= spec.vocab_size):
            raise ShapeMismatch(f"token ids must lie in [0, {spec.vocab_size})")
        return
    if inputs.dtype != spec.dtype or inputs.dim() != 2 or inputs.shape[1] != spec.hidden_size:
        raise ShapeMismatch(f"layers [{spec.start}, {spec.end}) take hidden states [n, {spec.hidden_size}] in "
                            f"{spec.dtype}, not {inputs.dtype} {list(inputs.shape)}")


def trace_shard(shard: Shard, inputs: torch.Tensor, prefill_tokens: int, chunk_tokens: int, *, layers: bool = False,
                greedy_steps: int = 0, name: str = "") -> ShardTrace:
    """Positions ``[0, n)`` of ``inputs`` through ``shard``: the first ``prefill_tokens`` prefilled in
    chunks of ``chunk_tokens``, each later one as a decode step; then, on a shard of the whole model,
    ``greedy_steps`` more decode steps, each on the most likely token after the one before.

    Runs on the caller's thread (the shard's compute thread), blocking."""
    spec = shard.spec
    if not layers_readable(shard):
        raise TraceRefused(f"trace parity reads torch decoder layers; this shard computes with "
                           f"{shard.numerics.backend}")
    if greedy_steps and not (spec.is_head and spec.is_tail):
        raise ValueError("only a shard of the whole model can choose its own next tokens")
    check_inputs(spec, inputs)
    n = int(inputs.shape[0])
    if not 1 <= prefill_tokens <= n:
        raise TraceRefused(f"prefill_tokens is {prefill_tokens}; it must lie in [1, {n}]")
    total = n + greedy_steps
    free = shard.kv.free_bytes
    need = total * shard.kv_bytes_per_token()
    if free is not None and need > free:
        raise TraceNoRoom(f"a trace of {total} positions needs {need} KV bytes, and this hop has {free} free; try "
                          "again when fewer sessions run, or with a shorter prompt")
    session = TRACE_SESSION + (name or uuid.uuid4().hex[:16])
    captured: list[list[torch.Tensor]] = [[] for _ in range(spec.end - spec.start)]
    rows = [0]  # the real rows of the step running now (a decode step pads its rows up to the band)

    def reader(index: int) -> Callable[[nn.Module, Any, Any], None]:
        def read(_module: nn.Module, _args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            captured[index].append(out.detach().reshape(-1, out.shape[-1])[: rows[0]].to("cpu", copy=True))
        return read

    def step(x: torch.Tensor, position: int, phase: Phase) -> None:
        rows[0] = int(x.shape[0])
        bundle = HiddenStateBundle(session_id=session, epoch=0, phase=phase, start_position=position,
                                   token_count=rows[0], tensors={INPUT_IDS if spec.is_head else HIDDEN_STATES: x},
                                   range_start=spec.start, range_end=spec.end)
        shard.forward(bundle)

    logits: list[torch.Tensor] = []
    tokens: list[int] = []
    handles = [layer.register_forward_hook(reader(i)) for i, layer in enumerate(shard.layers)]
    started = time.perf_counter()
    try:
        for start in range(0, prefill_tokens, chunk_tokens):
            step(inputs[start : min(start + chunk_tokens, prefill_tokens)], start, Phase.PREFILL)
        if spec.is_tail:
            logits.append(_row_logits(shard, captured[-1][-1][-1]))
        for position in range(prefill_tokens, total):
            if position < n:
                x = inputs[position : position + 1]
            else:
                tokens.append(int(torch.argmax(logits[-1])))
                x = torch.tensor([tokens[-1]], dtype=torch.long)
            step(x, position, Phase.DECODE)
            if spec.is_tail:
                logits.append(_row_logits(shard, captured[-1][-1][-1]))
    finally:
        for handle in handles:
            handle.remove()
        shard.release(session, 0)
    compute_ms = (time.perf_counter() - started) * 1000
    outputs = [torch.cat(parts) for parts in captured]
    if any(out.shape[0] != total for out in outputs):
        raise RuntimeError(f"the layers' hooks read {[o.shape[0] for o in outputs]} positions, not {total}")
    return ShardTrace(hidden=outputs[-1], layers=torch.stack(outputs) if layers else None,
                      logits=torch.stack(logits) if logits else None, tokens=tokens, compute_ms=compute_ms)


@torch.inference_mode()
def _row_logits(shard: Shard, hidden: torch.Tensor) -> torch.Tensor:
    """One position's logits from the tail's final norm and LM head, as a decode step computes a row."""
    assert shard.norm is not None and shard.lm_head is not None
    x = hidden.to(shard.device).view(1, 1, -1)
    with routed(shard.numerics.decode(rows=1)):
        out = shard.adapter.logits(shard.config, shard.lm_head(shard.norm(x)))
    return out[0, -1].float().cpu()
