"""Trace parity among real daemons: on an honest 3-hop route of ``tiny`` every seam and layer matches
one process exactly; through a peer whose layer 2 computes with perturbed weights (under the honest
compat key) the trace names that hop and that layer; files that are not the route's model are
refused as a reference; bad trace requests from a member get clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshd.daemon.local_mesh import LocalMesh
from meshd.identity import Identity
from meshd.rpc import RpcFailed
from meshd.rpc import call as rpc_call
from meshd.transport import Transport
from meshd.wire import rpc_pb2 as rpb
from meshd.wire import trace_pb2 as tpb
from tests.helpers import join_mesh
from tests.perturbed_hop import PERTURBED_LAYER

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Who computed this?"


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    with LocalMesh(tmp_path_factory.mktemp("trace"), env={"PYTHONPATH": str(REPO)}) as m:
        m.start_peer(model=tiny_model, layers=(0, 1))
        m.start_peer(model=tiny_model, layers=(1, 3))
        m.start_peer(model=tiny_model, layers=(1, 3), module="tests.perturbed_hop")
        m.start_peer(model=tiny_model, layers=(3, 4))
        m.wait_covered("tiny", timeout=60)
        yield m


def trace_parity(entry, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MESHD_CONTROL": entry.control}
    return subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", "trace-parity", "--model", "tiny",
                           "--prompt", PROMPT, *args], capture_output=True, text=True, env=env, timeout=300,
                          check=False)


def route_through(mesh, middle) -> str:
    head, _, _, tail = mesh.peers
    return ",".join(p.peer_id for p in (head, middle, tail))


def test_an_honest_route_matches_one_process_at_every_seam_and_layer(mesh):
    import jsonschema

    head, honest, _, tail = mesh.peers
    run = trace_parity(head, "--route", route_through(mesh, honest), "--layers", "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    schema = json.loads((REPO / "meshd" / "cli" / "schemas" / "trace-parity.json").read_text())
    jsonschema.validate(report, schema)
    assert report["passed"] and report["first_failure"] is None and report["error"] is None
    assert [(h["peer_id"], h["start"], h["end"]) for h in report["route"]] == [
        (head.peer_id, 0, 1), (honest.peer_id, 1, 3), (tail.peer_id, 3, 4)]
    assert [(c["hop"], c["what"], c["layer"]) for c in report["comparisons"]] == [
        (0, "layer", 0), (0, "seam", 0), (1, "layer", 1), (1, "layer", 2), (1, "seam", 2),
        (2, "layer", 3), (2, "seam", 3), (2, "logits", None)]
    # one numerics class on one machine: the very same computation, to the bit
    assert all(c["max_abs_diff"] == 0 and c["rel_error"] == 0 for c in report["comparisons"])
    assert report["tokens"]["identical"] and len(report["tokens"]["mesh"]) == report["decode_steps"] + 1
    # every hop let its trace session go
    for peer in mesh.peers:
        assert peer.get("/sessions")["sessions"] == []

    table = trace_parity(head, "--route", route_through(mesh, honest))
    assert table.returncode == 0, table.stdout + table.stderr
    assert "parity holds: every seam within 0.0001 of one process" in table.stdout
    assert "MAX ABS DIFF" in table.stdout and "identical" in table.stdout


def test_a_perturbed_peer_is_named_by_hop_and_layer(mesh):
    head, _, perturbed, _ = mesh.peers
    run = trace_parity(head, "--route", route_through(mesh, perturbed), "--layers", "--json")
    assert run.returncode == 1, run.stdout + run.stderr
    report = json.loads(run.stdout)
    first = report["first_failure"]
    assert not report["passed"] and report["error"] is None
    assert (first["hop"], first["peer_id"], first["what"], first["layer"]) == (1, perturbed.peer_id, "layer",
                                                                               PERTURBED_LAYER)
    assert first["rel_error"] > report["tolerance"]
    before = next(c for c in report["comparisons"] if c["what"] == "layer" and c["layer"] == PERTURBED_LAYER - 1)
    assert before["ok"] and before["max_abs_diff"] == 0, "the layer before the perturbed one is exact"

    table = trace_parity(head, "--route", route_through(mesh, perturbed))
    assert table.returncode == 1
    assert (f"PARITY FAILS first at hop 1 (peer {perturbed.peer_id[:12]}, layers [1, 3)), its output"
            in table.stdout), table.stdout
    layers = trace_parity(head, "--route", route_through(mesh, perturbed), "--layers")
    assert f"PARITY FAILS first at hop 1 (peer {perturbed.peer_id[:12]}, layers [1, 3)), layer 2:" in layers.stdout


def test_the_reference_must_be_the_routes_model(mesh, tiny_model, tmp_path):
    head, honest, _, _ = mesh.peers
    ok = trace_parity(head, "--route", route_through(mesh, honest), "--model-dir", str(tiny_model), "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout)["reference"]["model_dir"] == str(tiny_model.resolve())

    # one tensor's bytes changed in the files: another compat key, so not the route's model
    other = tmp_path / "tiny-changed"
    shutil.copytree(tiny_model, other)
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(4)
    weights.write_bytes(bytes(data))
    run = trace_parity(head, "--route", route_through(mesh, honest), "--model-dir", str(other))
    assert run.returncode == 1
    assert "are not the model the route computes" in run.stderr and "Traceback" not in run.stderr
    missing = trace_parity(head, "--model-dir", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "is not a model directory" in missing.stderr
    unknown = subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", "trace-parity", "--model", "huge",
                              "--prompt", "x", "--control", head.control], capture_output=True, text=True,
                             timeout=60, check=False)
    assert unknown.returncode == 1 and "unknown model 'huge'" in unknown.stderr


async def test_a_members_bad_trace_requests_get_clear_errors(mesh):
    head, honest, _, _ = mesh.peers
    status = honest.get("/status")
    asker = Identity.generate()
    async with Transport(asker) as transport:
        await join_mesh(transport, head)
        base = {"model_id": "tiny", "compat_key": status["compat_key"], "prefill_tokens": 4, "chunk_tokens": 4}
        hidden = torch.zeros(4, 64)
        from meshd.trace.service import trace_bundle
        from meshd.wire import bundle as wire

        def request(start: int, end: int, tensor: torch.Tensor, **extra) -> rpb.PeerRequest:
            data = wire.encode(trace_bundle(start, end, int(tensor.shape[0]), {"hidden_states": tensor}))
            return rpb.PeerRequest(trace=tpb.TraceRequest(range_start=start, range_end=end, input=data,
                                                          **{**base, **extra}))

        for bad, code in [(request(0, 3, hidden), "range_mismatch"), (request(1, 3, torch.zeros(4, 8)),
                                                                         "shape_mismatch"),
                          (request(1, 3, torch.zeros(40, 64)), "bad_request")]:
            with pytest.raises(RpcFailed) as caught:
                await rpc_call(transport, honest.peer_id, honest.listen, bad, timeout=30)
            assert caught.value.code == code, caught.value
        reply = await rpc_call(transport, honest.peer_id, honest.listen, request(1, 3, hidden), timeout=30)
        assert reply.WhichOneof("body") == "traced"
    assert honest.get("/sessions")["sessions"] == []
