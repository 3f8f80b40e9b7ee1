"""The hop's side of trace parity: the ``trace`` peer request, answered with this peer's own shard.

The request names the model, compat key and range the asker expects here, and carries the inputs of
every position as a hidden-state bundle (token ids at the head). Everything is checked before any
compute: who this peer serves, the range, the bundle, the input's dtype and shape, the positions,
decode steps and chunk size, and the size of the answer. The trace then runs on the compute thread
the sessions use, one trace at a time, in a throw-away session that never takes another session's
KV (:func:`meshd.trace.run.trace_shard`); a request with the wrong range, a bad shape or too many
positions is refused with a clear error and changes nothing.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable

import torch
import trio

from meshd.errors import RangeMismatch, ShapeMismatch
from meshd.runtime.served_model import ServedModel
from meshd.runtime.shard import HIDDEN_STATES, INPUT_IDS
from meshd.trace.run import LAYERS, LOGITS, TraceRefused, check_bounds, check_inputs, layers_readable, trace_shard
from meshd.wire import bundle as wire
from meshd.wire import trace_pb2 as tpb
from meshd.wire.bundle import HiddenStateBundle, Phase

log = logging.getLogger("meshd.trace")

TRACE_BUNDLE_SESSION = "trace"  # the session id the bundles of a trace request and reply carry


def trace_bundle(start: int, end: int, n: int, tensors: dict[str, torch.Tensor]) -> HiddenStateBundle:
    """A trace's input or answer as a bundle of positions ``[0, n)`` for layers ``[start, end)``."""
    return HiddenStateBundle(session_id=TRACE_BUNDLE_SESSION, epoch=0, phase=Phase.PREFILL, start_position=0,
                             token_count=n, tensors=tensors, range_start=start, range_end=end)


class TraceService:
    """Answers ``trace`` requests with the served model's loaded shard, one at a time."""

    def __init__(self, served: Callable[[], ServedModel | None]) -> None:
        self.served = served  # read at each request: a peer joining a model gets its shard later
        self._running = trio.Lock()
        self.traced = 0

    def _shard_of(self, request: tpb.TraceRequest) -> ServedModel:
        served = self.served()
        if served is None:
            raise TraceRefused("this peer offers no model")
        info = served.info
        if request.model_id != info.model_id or request.compat_key != info.compat_key:
            raise TraceRefused(f"trace for {request.model_id!r} ({request.compat_key[:12]}); this peer serves "
                               f"{info.model_id!r} ({info.compat_key[:12]})")
        if served.range is None or served.error:
            raise TraceRefused("this peer serves no range of the model yet")
        if (request.range_start, request.range_end) != served.range:
            raise RangeMismatch(f"trace for layers [{request.range_start}, {request.range_end}); this peer holds "
                                f"[{served.range[0]}, {served.range[1]})")
        if not layers_readable(served.host.require_shard()):
            raise TraceRefused(f"trace parity reads torch decoder layers; this peer computes {info.model_id} with "
                               f"{info.numerics.backend}")
        return served

    async def serve(self, sender: str, request: tpb.TraceRequest) -> tpb.TraceReply:
        served = self._shard_of(request)
        shard = served.host.require_shard()
        spec = shard.spec
        bundle = wire.decode(request.input)
        if bundle.start_position != 0 or (bundle.range_start, bundle.range_end) != (spec.start, spec.end):
            raise ShapeMismatch(f"the trace input must cover positions from 0 for layers [{spec.start}, {spec.end}), "
                                f"not from {bundle.start_position} for [{bundle.range_start}, {bundle.range_end})")
        name = INPUT_IDS if spec.is_head else HIDDEN_STATES
        if set(bundle.tensors) != {name}:
            raise ShapeMismatch(f"the trace input carries {sorted(bundle.tensors)}; layers [{spec.start}, {spec.end}) "
                                f"take one {name!r} tensor")
        inputs = bundle.tensors[name]
        check_inputs(spec, inputs)
        n = int(inputs.shape[0])
        if n != bundle.token_count:
            raise ShapeMismatch(f"the trace input has {n} positions; its bundle says {bundle.token_count}")
        check_bounds(spec, n, request.prefill_tokens, request.chunk_tokens, shard.max_chunk_tokens, request.layers)
        if n > served.info.context_length:
            raise TraceRefused(f"{n} positions exceed the model's context of {served.info.context_length}")
        run = functools.partial(trace_shard, shard, inputs, request.prefill_tokens, request.chunk_tokens,
                                layers=request.layers, name=f"{sender[:12]}-{uuid.uuid4().hex[:8]}")
        async with self._running:
            trace = await served.host.run_sync(run)
        self.traced += 1
        tensors = {HIDDEN_STATES: trace.hidden}
        if trace.layers is not None:
            tensors[LAYERS] = trace.layers
        if trace.logits is not None:
            tensors[LOGITS] = trace.logits
        log.info("traced %d positions of layers [%d, %d) for %s in %.1f ms", n, spec.start, spec.end, sender[:12],
                 trace.compute_ms)
        return tpb.TraceReply(output=wire.encode(trace_bundle(spec.start, spec.end, n, tensors), compress=True),
                              numerics=served.info.numerics.name, compute_ms=trace.compute_ms)
