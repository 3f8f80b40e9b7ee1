"""Trace parity in one process: tracing a split model gives exactly the whole model's hidden states,
a perturbed layer is named, and the hop's ``trace`` request refuses bad inputs with clear errors
while leaving every other session as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshd.cli.trace_cmd import print_report
from meshd.errors import ErrorCode, MeshError
from meshd.rpc.router import RATE_LIMITS, REQUEST_KINDS, RpcRouter
from meshd.runtime.chain import LocalChain
from meshd.runtime.host import InlineCompute, ShardHost
from meshd.runtime.model_info import describe_model
from meshd.runtime.numerics import default_numerics
from meshd.runtime.served_model import ServedModel
from meshd.runtime.shard import HIDDEN_STATES, INPUT_IDS, Shard
from meshd.trace import run as trace_run
from meshd.trace.compare import difference
from meshd.trace.parity import HopAnswer, ParityRequest, Reference, judge, report_json
from meshd.trace.service import TraceService, trace_bundle
from meshd.tracker.view import Hop, Route
from meshd.wire import bundle as wire
from meshd.wire import rpc_pb2 as rpb
from meshd.wire import trace_pb2 as tpb
from meshd.wire.bundle import HiddenStateBundle, Phase, Sampling
from tests.perturbed_hop import perturb

PROMPT = [5, 17, 42, 99, 7, 3, 11, 12, 250, 31]
STEPS = 3
RANGES = [(0, 1), (1, 3), (3, 4)]


def trace_route(shards: list[Shard], ids: torch.Tensor, prefill: int, layers: bool = True) -> list[HopAnswer]:
    """Each shard's trace of what the one before it gave, as the entry strings the hops together."""
    answers, x = [], ids
    for shard in shards:
        t = trace_run.trace_shard(shard, x, prefill, 4, layers=layers)
        answers.append(HopAnswer(Hop(f"peer{shard.spec.start}", shard.spec.start, shard.spec.end), t, "", 0.0))
        x = t.hidden
    return answers


@pytest.fixture(scope="module")
def reference(tiny_model):
    whole = Shard(tiny_model, 0, 4)
    return trace_run.trace_shard(whole, torch.tensor(PROMPT), len(PROMPT), 4, layers=True, greedy_steps=STEPS)


def test_a_split_trace_is_exactly_the_whole_models(tiny_model, reference):
    # the reference's greedy continuation is what a generation in one process picks
    generated = LocalChain([Shard(tiny_model, 0, 4)]).generate(PROMPT, STEPS, chunk_tokens=4).tokens
    assert reference.tokens == generated
    assert reference.layers is not None and reference.layers.shape == (4, len(PROMPT) + STEPS, 64)
    assert reference.logits is not None and reference.logits.shape == (STEPS + 1, 320)

    shards = [Shard(tiny_model, a, b) for a, b in RANGES]
    ids = torch.tensor(PROMPT + reference.tokens)
    answers = trace_route(shards, ids, len(PROMPT))
    verdict = judge(answers, reference, 1e-4, layers=True)
    assert verdict.first_failure is None
    assert [(c.hop, c.what, c.layer) for c in verdict.comparisons] == [
        (0, "layer", 0), (0, "seam", 0), (1, "layer", 1), (1, "layer", 2), (1, "seam", 2),
        (2, "layer", 3), (2, "seam", 3), (2, "logits", None)]
    assert all(c.difference.max_abs == 0.0 and c.difference.worst_position == -1 for c in verdict.comparisons)
    assert all(len(s.kv) == 0 for s in shards), "a trace's session is released"


def test_a_perturbed_layer_is_named_exactly(tiny_model, reference):
    shards = [Shard(tiny_model, a, b) for a, b in RANGES]
    perturb(shards[1], layer=2)
    ids = torch.tensor(PROMPT + reference.tokens)
    verdict = judge(trace_route(shards, ids, len(PROMPT)), reference, 1e-4, layers=True)
    first = verdict.first_failure
    assert first is not None and (first.hop, first.what, first.layer) == (1, "layer", 2)
    assert first.difference.rel_error > 1e-3 and "hop 1" in first.where() and "layer 2" in first.where()
    logits = next(c for c in verdict.comparisons if c.what == "logits")
    assert not logits.ok and len(PROMPT) - 1 <= logits.difference.worst_position < len(PROMPT) + STEPS
    layer1 = next(c for c in verdict.comparisons if c.layer == 1)
    assert layer1.ok and layer1.difference.max_abs == 0.0
    # without every layer's output, the hop's seam is the first to leave the tolerance
    seams = judge(trace_route(shards, ids, len(PROMPT), layers=False), reference, 1e-4, layers=False)
    assert seams.first_failure is not None and (seams.first_failure.hop, seams.first_failure.what) == (1, "seam")


def test_differences_are_measured_in_float64_and_say_where():
    want = torch.ones(4, 8)
    got = want.clone()
    got[2, 5] += 0.5
    d = difference(got, want)
    assert d.max_abs == 0.5 and d.worst_position == 2 and d.finite
    assert d.rel_error == pytest.approx(0.5 / (32 ** 0.5))
    got[1, 0] = float("nan")
    bad = difference(got, want)
    assert not bad.finite and not bad.within(1.0) and bad.worst_position == 1
    with pytest.raises(ValueError, match="shape"):
        difference(torch.ones(3, 8), want)


def test_a_parity_request_is_checked_field_by_field():
    ok = ParityRequest.from_json({"model": "tiny", "prompt": "hi", "layers": True, "route": "abc,def"})
    assert ok.layers and ok.route == "abc,def" and ok.decode_steps == 4
    for body, says in [({"prompt": "hi"}, "model"), ({"model": "tiny"}, "prompt"),
                       ({"model": "tiny", "prompt": "hi", "decode_steps": 33}, "decode_steps"),
                       ({"model": "tiny", "prompt": "hi", "tolerance": -1}, "tolerance"),
                       ({"model": "tiny", "prompt": "hi", "tolerance": 10**400}, "tolerance"),
                       ({"model": "tiny", "prompt": "hi", "tolerance": float("nan")}, "tolerance"),
                       ({"model": "tiny", "prompt": "hi", "layers": "yes"}, "layers"),
                       ({"model": "tiny", "prompt": "hi", "route": ["a"]}, "route"),
                       ({"model": "tiny", "prompt": "hi", "colour": 1}, "unknown fields: colour"), ([], "object")]:
        with pytest.raises(ValueError, match=says):
            ParityRequest.from_json(body)


# -- the hop's side ---------------------------------------------------------------------------------


async def served_range(tiny_model, start: int, end: int, kv_budget: int | None = None) -> ServedModel:
    info = describe_model(tiny_model, "tiny")
    host = ShardHost(tiny_model, numerics=info.numerics, manifest=info.manifest, compute=InlineCompute(),
                     kv_budget_bytes=kv_budget)
    await host.load(start, end)
    return ServedModel(info, host)


def request_for(served: ServedModel, inputs: torch.Tensor, prefill: int, **fields) -> tpb.TraceRequest:
    start, end = fields.pop("range", served.range)
    name = INPUT_IDS if start == 0 else HIDDEN_STATES
    data = fields.pop("input", None) or wire.encode(trace_bundle(start, end, int(inputs.shape[0]), {name: inputs}))
    return tpb.TraceRequest(model_id=fields.pop("model_id", "tiny"),
                            compat_key=fields.pop("compat_key", served.info.compat_key), range_start=start,
                            range_end=end, input=data, prefill_tokens=prefill, chunk_tokens=fields.pop("chunk", 4),
                            layers=fields.pop("layers", True))


def open_session(shard: Shard, session: str, n: int) -> torch.Tensor:
    """A client's session on ``shard`` with ``n`` prefilled positions; the hidden states it was fed."""
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(7))
    shard.forward(HiddenStateBundle(session_id=session, epoch=0, phase=Phase.PREFILL, start_position=0,
                                    token_count=n, tensors={HIDDEN_STATES: x}, range_start=1, range_end=3,
                                    sampling=Sampling()))
    return x


def next_step(shard: Shard, session: str, position: int) -> torch.Tensor:
    x = torch.full((1, 64), 0.25)
    result = shard.forward(HiddenStateBundle(session_id=session, epoch=0, phase=Phase.DECODE, start_position=position,
                                             token_count=1, tensors={HIDDEN_STATES: x}, range_start=1, range_end=3))
    assert result.hidden_states is not None
    return result.hidden_states


async def test_a_trace_answers_a_hops_hidden_states_and_leaves_other_sessions_alone(tiny_model, reference):
    served = await served_range(tiny_model, 1, 3)
    shard = served.host.require_shard()
    open_session(shard, "client", 5)
    service = TraceService(lambda: served)
    inputs = reference.layers[0].clone()  # what the head sends on
    reply = await service.serve("asker", request_for(served, inputs, len(PROMPT)))
    out = wire.decode(reply.output)
    assert torch.equal(out.tensors[HIDDEN_STATES], reference.layers[2])
    assert torch.equal(out.tensors["layers"], reference.layers[1:3])
    assert "logits" not in out.tensors and reply.numerics == served.info.numerics.name
    assert shard.kv.keys() == [("client", 0)] and shard.kv.get(("client", 0)).length == 5
    assert served.host.active_sessions == 1

    # the client's session goes on exactly as on a shard that never traced anything
    control = Shard(tiny_model, 1, 3)
    open_session(control, "client", 5)
    assert torch.equal(next_step(shard, "client", 5), next_step(control, "client", 5))


async def test_bad_trace_requests_get_clear_errors_and_change_nothing(tiny_model, monkeypatch):
    served = await served_range(tiny_model, 1, 3)
    shard = served.host.require_shard()
    open_session(shard, "client", 5)
    service = TraceService(lambda: served)
    good = torch.zeros(8, 64)
    cases = [
        (request_for(served, good, 8, model_id="other"), ErrorCode.BAD_REQUEST, "this peer serves 'tiny'"),
        (request_for(served, good, 8, compat_key="0" * 32), ErrorCode.BAD_REQUEST, "this peer serves"),
        (request_for(served, good, 8, range=(0, 2)), ErrorCode.RANGE_MISMATCH, "this peer holds [1, 3)"),
        (request_for(served, good, 8, input=b"\xff\x00junk"), ErrorCode.BAD_BUNDLE, "does not parse"),
        (request_for(served, torch.zeros(8, 32), 8), ErrorCode.SHAPE_MISMATCH, "[n, 64]"),
        (request_for(served, torch.zeros(8, 64, dtype=torch.float16), 8), ErrorCode.SHAPE_MISMATCH, "float16"),
        (request_for(served, torch.zeros(8, 64, 1), 8), ErrorCode.SHAPE_MISMATCH, "[n, 64]"),
        (request_for(served, good, 0), ErrorCode.BAD_REQUEST, "prefill_tokens"),
        (request_for(served, good, 9), ErrorCode.BAD_REQUEST, "prefill_tokens"),
        (request_for(served, torch.zeros(40, 64), 2), ErrorCode.BAD_REQUEST, "at most 32 decode steps"),
        (request_for(served, good, 8, chunk=0), ErrorCode.BAD_REQUEST, "chunk_tokens"),
        (request_for(served, good, 8, chunk=10_000), ErrorCode.BAD_REQUEST, "chunk_tokens"),
        (request_for(served, torch.zeros(trace_run.MAX_TRACE_POSITIONS + 1, 64), trace_run.MAX_TRACE_POSITIONS + 1),
         ErrorCode.BAD_REQUEST, "at most 2048 positions"),
    ]
    ids = wire.encode(trace_bundle(1, 3, 8, {INPUT_IDS: torch.zeros(8, dtype=torch.long)}))
    cases.append((request_for(served, good, 8, input=ids), ErrorCode.SHAPE_MISMATCH, "take one 'hidden_states'"))
    for request, code, says in cases:
        with pytest.raises(MeshError) as caught:
            await service.serve("asker", request)
        assert caught.value.code == code and says in str(caught.value), (code, says, caught.value)
    # an answer too large to carry (the bound, made small here) is refused before anything runs
    monkeypatch.setattr(trace_run, "MAX_TRACE_REPLY_BYTES", 4096)
    with pytest.raises(MeshError, match="without every layer's output") as caught:
        await service.serve("asker", request_for(served, good, 8))
    assert caught.value.code == ErrorCode.BAD_REQUEST
    assert shard.kv.keys() == [("client", 0)] and shard.kv.get(("client", 0)).length == 5
    assert service.traced == 0


async def test_a_trace_that_would_evict_a_session_is_refused(tiny_model):
    per_token = 2 * 2 * 2 * 16 * 4  # two layers, keys and values, two KV heads of 16 floats
    served = await served_range(tiny_model, 1, 3, kv_budget=8 * per_token)
    shard = served.host.require_shard()
    assert shard.kv_bytes_per_token() == per_token
    open_session(shard, "client", 5)
    service = TraceService(lambda: served)
    with pytest.raises(MeshError, match="needs 4096 KV bytes, and this hop has 1536 free") as caught:
        await service.serve("asker", request_for(served, torch.zeros(8, 64), 8))
    assert caught.value.code == ErrorCode.KV_BUDGET
    assert shard.kv.keys() == [("client", 0)] and shard.kv.get(("client", 0)).length == 5
    await service.serve("asker", request_for(served, torch.zeros(3, 64), 3))  # what fits runs
    assert shard.kv.keys() == [("client", 0)]


async def test_a_peer_without_a_model_or_range_refuses(tiny_model):
    with pytest.raises(MeshError, match="offers no model"):
        await TraceService(lambda: None).serve("asker", tpb.TraceRequest(model_id="tiny"))
    info = describe_model(tiny_model, "tiny")
    unloaded = ServedModel(info, ShardHost(tiny_model, numerics=info.numerics, compute=InlineCompute()))
    with pytest.raises(MeshError, match="serves no range"):
        await TraceService(lambda: unloaded).serve("asker", tpb.TraceRequest(model_id="tiny",
                                                                             compat_key=info.compat_key))


async def test_trace_is_a_peer_request_with_a_rate_limit(tiny_model):
    assert "trace" in REQUEST_KINDS and "trace" in RATE_LIMITS
    served = await served_range(tiny_model, 1, 3)
    router = RpcRouter(limits={"trace": (0.001, 2.0)})
    router.register("trace", TraceService(lambda: served).serve)
    bad = rpb.PeerRequest(trace=request_for(served, torch.zeros(8, 64), 8, range=(1, 4)))
    reply = await router.dispatch("asker", bad)
    assert reply.error.code == "range_mismatch" and "[1, 4)" in reply.error.message
    good = rpb.PeerRequest(trace=request_for(served, torch.zeros(8, 64), 8))
    assert (await router.dispatch("asker", good)).WhichOneof("body") == "traced"
    assert (await router.dispatch("asker", good)).error.code == "rate_limited"


def test_the_report_matches_its_schema_and_reads_as_a_verdict(tiny_model, reference, capsys):
    import jsonschema

    schema = json.loads((Path(__file__).parents[1] / "meshd" / "cli" / "schemas" / "trace-parity.json").read_text())
    shards = [Shard(tiny_model, a, b) for a, b in RANGES]
    perturb(shards[2], layer=3)
    ids = torch.tensor(PROMPT + reference.tokens)
    answers = trace_route(shards, ids, len(PROMPT))
    route = Route("tiny", "k" * 32, tuple(a.hop for a in answers), epoch=0, cost_ms=0.0)
    ref = Reference(tiny_model, default_numerics(torch.float32, "cpu"), reference, 12.0)
    request = ParityRequest(model="tiny", prompt="hi", layers=True, decode_steps=STEPS)
    failed = report_json(request, route, "--route", PROMPT, ref, answers,
                         judge(answers, reference, 1e-4, layers=True), 1e-4, None)
    jsonschema.validate(failed, schema)
    assert not failed["passed"] and failed["first_failure"]["layer"] == 3
    print_report(failed)
    out = capsys.readouterr().out
    assert "PARITY FAILS first at hop 2 (peer peer3, layers [3, 4)), layer 3: relative error" in out
    assert "LAYERS" in out and "OUT" in out

    # a hop that gave no trace ends the report there
    error = {"hop": 1, "peer_id": "peer1", "start": 1, "end": 3, "code": "kv_budget",
             "message": "hop 1 (peer peer1, layers [1, 3)) gave no trace: kv_budget: no room"}
    stopped = report_json(request, route, "--route", PROMPT, ref, answers[:1],
                          judge(answers[:1], reference, 1e-4, layers=True), 1e-4, error)
    jsonschema.validate(stopped, schema)
    assert not stopped["passed"] and stopped["first_failure"] is None and stopped["tokens"]["mesh"] is None
    print_report(stopped)
    assert "TRACE INCOMPLETE: hop 1 (peer peer1, layers [1, 3)) gave no trace" in capsys.readouterr().out


def test_a_trace_of_the_prompt_alone_samples_once(tiny_model):
    shard = Shard(tiny_model, 0, 4)
    t = trace_run.trace_shard(shard, torch.tensor(PROMPT), len(PROMPT), 64, layers=False)
    assert t.layers is None and t.logits is not None and t.logits.shape == (1, 320) and t.hidden.shape == (10, 64)
