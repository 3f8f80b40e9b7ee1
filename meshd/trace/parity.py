"""The entry's side of trace parity: one request through a route, compared with one process.

The entry gets a route for the model (or the one the operator names), tokenizes the prompt with the
model's codec, and computes the reference first: the whole model in this process, from local files
that must hash to the route's compat key, in the route's numerics class, with every layer's output
and a greedy continuation of ``decode_steps`` tokens. Then it sends the head the prompt and that
continuation as token ids (so every hop computes the same positions as the reference, prefill and
decode steps alike), and each next hop what the hop before it actually answered. Every seam's
hidden states are compared with the reference's at the same layer boundary, every layer's with
``layers``, and the tail's logits with the reference's; the report says where the first comparison
leaves the tolerance.

A hop that refuses or fails ends the trace there; the report names it. Every hop runs its part in
a throw-away session (:mod:`meshd.trace.service`), so a trace leaves the mesh's sessions as they were.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse

from meshd.capture.replay import ReplayError, parse_route_spec, pin_route
from meshd.errors import MeshError
from meshd.models.artifacts import ModelFilesUnavailable
from meshd.rpc import call
from meshd.rpc.router import MAX_REQUEST_BYTES
from meshd.runtime.devices import resolve_device
from meshd.runtime.host import ComputeThread
from meshd.runtime.manifest import Manifest
from meshd.runtime.model_info import describe_model
from meshd.runtime.numerics import Numerics, numerics_from_name
from meshd.runtime.shard import HIDDEN_STATES, INPUT_IDS, Shard
from meshd.trace.compare import Comparison, compare, default_tolerance
from meshd.trace.limits import DEFAULT_DECODE_STEPS, MAX_TRACE_DECODE_STEPS, MAX_TRACE_POSITIONS
from meshd.trace.run import LAYERS, LOGITS, ShardTrace, trace_shard
from meshd.trace.service import trace_bundle
from meshd.tracker.routing import NoRouteError
from meshd.tracker.view import Hop, Route
from meshd.wire import bundle as wire
from meshd.wire import rpc_pb2 as rpb
from meshd.wire import trace_pb2 as tpb

if TYPE_CHECKING:
    from meshd.daemon.peer import Peer

log = logging.getLogger("meshd.trace")

HOP_TIMEOUT_S = 300.0
MAX_PROMPT_CHARS = 1 << 20
MAX_TOLERANCE = 1e6  # a relative error past any a real difference shows: larger asks nothing
MAX_TRACE_INPUT_BYTES = MAX_REQUEST_BYTES - 64 * 1024  # one hop's input, within what a peer request may carry


class ParityError(MeshError):
    """A trace that cannot be run as asked; ``status`` is the control API's HTTP status for it."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ParityRequest:
    """What ``meshctl trace-parity`` asks for (the body of ``POST /trace-parity``)."""

    model: str
    prompt: str
    raw: bool = False                  # the prompt as plain text, not as a user's chat message
    layers: bool = False               # compare every layer's output, not only each seam's
    decode_steps: int = DEFAULT_DECODE_STEPS
    tolerance: float | None = None     # relative error; None: the numerics class's default
    route: str = ""                    # the hops to trace, head first (PEER,PEER or PEER:0:2,...); "": the tracker's
    model_dir: str | None = None       # the reference's files; None: this peer's own

    @classmethod
    def from_json(cls, doc: Any) -> ParityRequest:
        """Parse and check a request body; :class:`ValueError` saying what is wrong."""
        if not isinstance(doc, dict):
            raise ValueError("the body is a JSON object")
        unknown = sorted(set(doc) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown fields: {', '.join(unknown)}")
        model, prompt = doc.get("model"), doc.get("prompt")
        if not isinstance(model, str) or not model:
            raise ValueError("model is the model id to trace")
        if not isinstance(prompt, str) or not prompt or len(prompt) > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt is the text to trace (1 to {MAX_PROMPT_CHARS} characters)")
        steps = doc.get("decode_steps", DEFAULT_DECODE_STEPS)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_TRACE_DECODE_STEPS:
            raise ValueError(f"decode_steps is a whole number from 0 to {MAX_TRACE_DECODE_STEPS}")
        tolerance = doc.get("tolerance")
        if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, int | float)
                                      or not 0 <= tolerance <= MAX_TOLERANCE):
            raise ValueError(f"tolerance is a relative error: a number from 0 to {MAX_TOLERANCE:g}")
        route = doc.get("route") or ""
        if not isinstance(route, str):
            raise ValueError("route names the hops, head first: PEER,PEER or PEER:START:END,...")
        model_dir = doc.get("model_dir")
        if model_dir is not None and (not isinstance(model_dir, str) or not model_dir):
            raise ValueError("model_dir is the path of the model's files")
        for flag in ("raw", "layers"):
            if not isinstance(doc.get(flag, False), bool):
                raise ValueError(f"{flag} is true or false")
        return cls(model=model, prompt=prompt, raw=doc.get("raw", False), layers=doc.get("layers", False),
                   decode_steps=steps, tolerance=None if tolerance is None else float(tolerance),
                   route=route, model_dir=model_dir)


@dataclass
class HopAnswer:
    """What one hop answered: its trace (hidden states, layers, logits) and how long it took."""

    hop: Hop
    trace: ShardTrace
    numerics: str
    elapsed_ms: float


@dataclass
class Reference:
    model_dir: Path
    numerics: Numerics
    trace: ShardTrace
    elapsed_ms: float


@dataclass
class Verdict:
    comparisons: list[Comparison] = field(default_factory=list)
    first_failure: Comparison | None = None


def judge(hops: list[HopAnswer], reference: ShardTrace, tolerance: float, layers: bool) -> Verdict:
    """Every comparison of the hops' answers with the reference, in route order (a hop's layers,
    then its seam, then the tail's logits), and the first that is not within ``tolerance``."""
    assert reference.layers is not None
    verdict = Verdict()
    for index, answer in enumerate(hops):
        hop, trace = answer.hop, answer.trace
        here: list[Comparison] = []
        if layers and trace.layers is not None:
            for offset in range(hop.end - hop.start):
                layer = hop.start + offset
                here.append(compare(index, hop.peer_id, hop.start, hop.end, "layer", layer, trace.layers[offset],
                                    reference.layers[layer], tolerance))
        here.append(compare(index, hop.peer_id, hop.start, hop.end, "seam", hop.end - 1, trace.hidden,
                            reference.layers[hop.end - 1], tolerance))
        if trace.logits is not None and reference.logits is not None:
            sampled_from = trace.hidden.shape[0] - trace.logits.shape[0]  # the prompt's last position
            here.append(compare(index, hop.peer_id, hop.start, hop.end, "logits", None, trace.logits,
                                reference.logits, tolerance, sampled_from))
        verdict.comparisons.extend(here)
        if verdict.first_failure is None:
            verdict.first_failure = next((c for c in here if not c.ok), None)
    return verdict


def explicit_route(peer: Peer, model_id: str, text: str) -> Route:
    """The route through exactly the peers ``text`` names, head first (``meshctl replay``'s syntax:
    ``PEER,PEER``, ``PEER:0:2,PEER:2:4`` or what ``Route.describe`` prints), each hop running the
    layers its peer holds."""
    try:
        return pin_route(model_id, parse_route_spec(text), peer.control.view.offers(), 0, peer.peer_id)
    except ReplayError as exc:
        raise ParityError(f"--route: {exc}") from None


def _numerics_name(peer: Peer, route: Route) -> str:
    for hop in route.hops:
        card = peer.control.view.cards().get(hop.peer_id)
        for m in card.models if card is not None else ():
            if m.model_id == route.model_id and m.compat_key == route.compat_key and m.numerics:
                return str(m.numerics)
    raise ParityError(f"no card of the route's peers says in which numerics class they compute {route.model_id}",
                      503)


def _reference_device(peer: Peer, kind: str) -> str:
    """A device of ``kind`` here: the served model's, the configured one, or the kind's first."""
    if peer.served is not None and peer.served.info.numerics.device_kind == kind:
        return peer.served.info.numerics.device
    try:
        configured = resolve_device(peer.config.device)
    except (ValueError, RuntimeError):
        configured = ""
    return configured if configured.split(":")[0] == kind else kind


def _reference_trace(model_dir: Path, n_layers: int, numerics: Numerics, manifest: Manifest, prompt: list[int],
                     chunk_tokens: int, decode_steps: int) -> ShardTrace:
    """The whole model loaded here, the prompt and ``decode_steps`` greedy tokens traced through it; the
    model is let go once traced (it may be large)."""
    shard = Shard(model_dir, 0, n_layers, numerics=numerics, manifest=manifest,
                  max_chunk_tokens=max(512, chunk_tokens))
    return trace_shard(shard, torch.tensor(prompt, dtype=torch.long), len(prompt), chunk_tokens, layers=True,
                       greedy_steps=decode_steps)


class TraceParity:
    """Runs trace parity for the control API, one trace at a time on this peer."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self._running = trio.Lock()

    @property
    def busy(self) -> bool:
        return self._running.locked()

    async def run(self, request: ParityRequest) -> dict[str, Any]:
        async with self._running:
            return await self._run(request)

    async def _route(self, request: ParityRequest) -> tuple[Route, str]:
        peer = self.peer
        if request.route:
            return explicit_route(peer, request.model, request.route), "--route"
        try:
            planned = await peer.routes.route_for(request.model)
        except NoRouteError as exc:
            raise ParityError(str(exc), 503) from None
        return planned.route, planned.source

    async def _prompt(self, request: ParityRequest, route: Route) -> list[int]:
        peer = self.peer
        try:
            codec = await peer.files.codec_for(route.model_id, route.compat_key, peer.control.view.sources_of)
        except ModelFilesUnavailable as exc:
            raise ParityError(f"the model's tokenizer could not be had: {exc}", 503) from None
        if request.raw:
            ids = codec.encode_text(request.prompt)
        elif not codec.has_chat_template:
            raise ParityError(f"{route.model_id} has no chat template; trace the prompt as plain text (--raw)")
        else:
            ids = codec.encode_chat([{"role": "user", "content": request.prompt}])
        positions = len(ids) + request.decode_steps
        limit = min(MAX_TRACE_POSITIONS, peer.control.view.context_length(route.model_id))
        if not ids:
            raise ParityError("the prompt encodes to no tokens")
        if positions > limit:
            raise ParityError(f"the prompt's {len(ids)} tokens and {request.decode_steps} decode steps make "
                              f"{positions} positions; a trace covers at most {limit}")
        return ids

    async def _reference_files(self, request: ParityRequest, route: Route) -> tuple[Path, Numerics, Manifest]:
        """Where the reference's weights are and how to compute them: checked to be the route's model."""
        peer = self.peer
        served = peer.served
        if request.model_dir is None:
            if (served is None or served.info.model_id != route.model_id
                    or served.info.compat_key != route.compat_key):
                raise ParityError(f"this peer holds no files of {route.model_id} under the route's compat key "
                                  f"{route.compat_key[:12]}; give the model's files with --model-dir")
            if served.info.numerics.backend != "torch":
                raise ParityError(f"trace parity compares torch shards; this mesh computes {route.model_id} "
                                  f"with {served.info.numerics.backend}")
            return served.info.model_dir, served.info.numerics, served.info.manifest
        path = Path(request.model_dir).expanduser()
        if not path.is_dir():
            raise ParityError(f"--model-dir {path} is not a model directory")
        name = _numerics_name(peer, route)
        try:
            numerics = numerics_from_name(name, _reference_device(peer, name.split("/")[0]))
        except ValueError as exc:
            raise ParityError(f"the reference cannot compute as the route does: {exc}") from None
        try:
            info = await trio.to_thread.run_sync(
                lambda: describe_model(path, route.model_id, numerics=numerics,
                                       cache_dir=peer.config.data_dir / "cache" / "manifests"))
        except (MeshError, OSError, ValueError) as exc:
            raise ParityError(f"--model-dir {path} cannot be read as a model: {exc}") from None
        if info.compat_key != route.compat_key:
            raise ParityError(f"the files at {path} are not the model the route computes: their compat key is "
                              f"{info.compat_key[:12]}, the route's {route.compat_key[:12]} (other weights, "
                              "tokenizer or config)")
        return path, numerics, info.manifest

    async def _reference(self, request: ParityRequest, route: Route, prompt: list[int]) -> Reference:
        model_dir, numerics, manifest = await self._reference_files(request, route)
        n_layers = route.hops[-1].end
        chunk = self.peer.config.chunk_tokens
        compute = ComputeThread(name="meshd-trace")
        started = time.perf_counter()
        try:
            trace = await compute.run(_reference_trace, model_dir, n_layers, numerics, manifest, prompt, chunk,
                                      request.decode_steps)
        except (MeshError, OSError) as exc:
            raise ParityError(f"the reference could not be computed from {model_dir}: {exc}"
                              + ("" if request.model_dir else "; give the model's complete files with --model-dir")
                              ) from None
        finally:
            compute.close()
        return Reference(model_dir, numerics, trace, (time.perf_counter() - started) * 1000)

    async def _ask(self, route: Route, index: int, inputs: torch.Tensor, prefill: int, layers: bool) -> HopAnswer:
        """One hop's trace of ``inputs``; :class:`MeshError` when it refuses or answers nonsense."""
        peer, hop = self.peer, route.hops[index]
        head = index == 0
        raw = inputs.numel() * inputs.element_size()
        if raw > MAX_TRACE_INPUT_BYTES:
            raise ParityError(f"hop {index}'s input is {raw} bytes, more than a peer request carries "
                              f"({MAX_TRACE_INPUT_BYTES}); trace a shorter prompt")
        bundle = trace_bundle(hop.start, hop.end, int(inputs.shape[0]), {INPUT_IDS if head else HIDDEN_STATES: inputs})
        request = tpb.TraceRequest(model_id=route.model_id, compat_key=route.compat_key, range_start=hop.start,
                                   range_end=hop.end, input=wire.encode(bundle, compress=True),
                                   prefill_tokens=prefill, chunk_tokens=peer.config.chunk_tokens, layers=layers)
        started = time.perf_counter()
        if hop.peer_id == peer.peer_id:
            reply = await peer.trace.serve(peer.peer_id, request)
        else:
            address = peer.control.view.address_of(hop.peer_id)
            if address is None:
                raise ParityError(f"no address is known for peer {hop.peer_id[:12]}", 503)
            answer = await call(peer.transport, hop.peer_id, address, rpb.PeerRequest(trace=request),
                                timeout=HOP_TIMEOUT_S)
            if answer.WhichOneof("body") != "traced":
                raise ParityError(f"peer {hop.peer_id[:12]} answered a trace with {answer.WhichOneof('body')!r}")
            reply = answer.traced
        elapsed = (time.perf_counter() - started) * 1000
        return HopAnswer(hop, _checked_trace(reply, inputs, hop, route, prefill, layers, index), reply.numerics,
                         elapsed)

    async def _run(self, request: ParityRequest) -> dict[str, Any]:
        peer = self.peer
        if request.model not in peer.control.view.known_models():
            raise ParityError(f"unknown model {request.model!r}; the mesh offers "
                              f"{', '.join(sorted(peer.control.view.known_models())) or 'none'}", 404)
        route, planned_by = await self._route(request)
        prompt = await self._prompt(request, route)
        log.info("trace parity of %s: %d prompt tokens, %d decode steps over %s", route.model_id, len(prompt),
                 request.decode_steps, route.describe())
        reference = await self._reference(request, route, prompt)
        tolerance = request.tolerance if request.tolerance is not None else default_tolerance(reference.numerics)
        ids = torch.tensor(prompt + reference.trace.tokens[: request.decode_steps], dtype=torch.long)
        answers: list[HopAnswer] = []
        error: dict[str, Any] | None = None
        inputs = ids
        for index, hop in enumerate(route.hops):
            try:
                answer = await self._ask(route, index, inputs, len(prompt), request.layers)
            except MeshError as exc:
                code = getattr(exc, "code", "")
                error = {"hop": index, "peer_id": hop.peer_id, "start": hop.start, "end": hop.end,
                         "code": str(code), "message": f"hop {index} (peer {hop.peer_id[:12]}, layers "
                                                       f"[{hop.start}, {hop.end})) gave no trace: {exc}"}
                log.warning("trace parity: %s", error["message"])
                break
            answers.append(answer)
            inputs = answer.trace.hidden
        verdict = judge(answers, reference.trace, tolerance, request.layers)
        return report_json(request, route, planned_by, prompt, reference, answers, verdict, tolerance, error)


def _checked_trace(reply: tpb.TraceReply, inputs: torch.Tensor, hop: Hop, route: Route, prefill: int, layers: bool,
                   index: int) -> ShardTrace:
    """The hop's answer as a trace, once its tensors have the shapes asked for."""
    out = wire.decode(reply.output)
    n = int(inputs.shape[0])
    hidden = out.tensors.get(HIDDEN_STATES)
    who = f"peer {hop.peer_id[:12]}"
    if hidden is None or hidden.dim() != 2 or hidden.shape[0] != n:
        raise ParityError(f"{who} answered hidden states of shape "
                          f"{None if hidden is None else list(hidden.shape)} for {n} positions")
    per_layer = out.tensors.get(LAYERS)
    if layers and (per_layer is None or tuple(per_layer.shape) != (hop.end - hop.start, *hidden.shape)):
        raise ParityError(f"{who} answered no per-layer outputs of shape [{hop.end - hop.start}, {n}, "
                          f"{hidden.shape[1]}]")
    logits = out.tensors.get(LOGITS)
    tail = index == len(route.hops) - 1
    if tail and (logits is None or logits.dim() != 2 or logits.shape[0] != n - prefill + 1):
        raise ParityError(f"{who} (the tail) answered no logits for its {n - prefill + 1} sampled positions")
    return ShardTrace(hidden=hidden, layers=per_layer if layers else None, logits=logits if tail else None,
                      tokens=[], compute_ms=reply.compute_ms)


def report_json(request: ParityRequest, route: Route, planned_by: str, prompt: list[int], reference: Reference,
                answers: list[HopAnswer], verdict: Verdict, tolerance: float,
                error: dict[str, Any] | None) -> dict[str, Any]:
    """The report (schema: meshd/cli/schemas/trace-parity.json)."""
    ref_tokens = list(reference.trace.tokens)
    if reference.trace.logits is not None:
        ref_tokens.append(int(torch.argmax(reference.trace.logits[-1])))
    tail = answers[-1].trace if len(answers) == len(route.hops) and answers else None
    mesh_tokens = ([int(t) for t in torch.argmax(tail.logits, dim=-1)]
                   if tail is not None and tail.logits is not None else None)
    first = verdict.first_failure
    passed = error is None and first is None
    return {
        "model": route.model_id, "compat_key": route.compat_key, "numerics": reference.numerics.name,
        "planned_by": planned_by,
        "route": [{"peer_id": h.peer_id, "start": h.start, "end": h.end} for h in route.hops],
        "prompt_tokens": len(prompt), "decode_steps": request.decode_steps,
        "positions": len(prompt) + request.decode_steps, "layers": request.layers, "tolerance": tolerance,
        "reference": {"model_dir": str(reference.model_dir), "ms": round(reference.elapsed_ms, 3)},
        "hops": [{"hop": i, "peer_id": a.hop.peer_id, "start": a.hop.start, "end": a.hop.end, "numerics": a.numerics,
                  "compute_ms": round(a.trace.compute_ms, 3), "ms": round(a.elapsed_ms, 3)}
                 for i, a in enumerate(answers)],
        "comparisons": [c.as_json() for c in verdict.comparisons],
        "tokens": {"reference": ref_tokens, "mesh": mesh_tokens,
                   "identical": mesh_tokens is not None and mesh_tokens == ref_tokens},
        "passed": passed,
        "first_failure": None if first is None else {**first.as_json(), "where": first.where()},
        "error": error,
    }


def trace_parity_endpoint(peer: Peer) -> Callable[[Request], Awaitable[JSONResponse]]:
    """``POST /trace-parity`` of the control API: the body is a :class:`ParityRequest`, the answer
    the report (200 whether parity holds or not), or ``{"error": ...}`` with 400, 404, 409 or 503."""
    runner = TraceParity(peer)

    async def endpoint(request: Request) -> JSONResponse:
        try:
            asked = ParityRequest.from_json(json.loads(await request.body() or b"{}"))
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        if runner.busy:
            return JSONResponse({"error": "a trace is running on this peer; try again when it ends"}, status_code=409)
        try:
            return JSONResponse(await runner.run(asked))
        except ParityError as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)

    return endpoint
