"""Real daemons: a peer that measured its own numerics class takes the class of the peer already
serving the model before it loads its range, pinned or placed, so that the two share a route,
token-identical to one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshd.daemon.local_mesh import LocalMesh
from meshd.runtime.model_info import model_sizes
from tests.helpers import api_chat, chat_reference

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
QUESTION = "Which class do you compute in?"
N_TOKENS = 10
# given to the first peer; a bench peer measures a faster class than one row per GEMM (a band of rows,
# oneDNN's where torch has it), so the second peer starts in another class
FIRST_CLASS = "cpu/float32/prefill-native/decode-native-rows1"


@pytest.mark.parametrize("ranges", ["pinned", "placed"])
def test_a_peer_takes_the_class_of_the_peer_already_serving(bench_model, tmp_path, ranges):
    sizes = model_sizes(bench_model)
    with LocalMesh(tmp_path, env={"PYTHONPATH": str(REPO)}) as mesh:
        if ranges == "pinned":
            head = mesh.start_peer(model=bench_model, layers=(0, 6), extra=["--numerics", FIRST_CLASS])
            tail = mesh.start_peer(model=bench_model, layers=(6, sizes.n_layers))
        else:  # each holds a little over half the model: the tracker splits it between them
            budget = (sizes.n_layers // 2 + 2) * sizes.layer_bytes + 2 * sizes.edge_bytes
            head = mesh.start_peer(model=bench_model, memory_budget=budget, extra=["--numerics", FIRST_CLASS])
            tail = mesh.start_peer(model=bench_model, memory_budget=budget)
        mesh.wait_covered("bench", timeout=180)

        status = tail.get("/status")
        measured = status["numerics_measured_ms"]
        assert measured, "the second peer measured its class"
        assert status["numerics"] == FIRST_CLASS and status["numerics_from"] == head.peer_id, measured
        assert status["compat_key"] == head.get("/status")["compat_key"]
        assert status["range"] is not None and status["shard_error"] is None
        assert head.get("/status")["numerics_from"] is None, "the peer that served first keeps its class"
        log = tail.log_tail(400).splitlines()
        taken = [line for line in log if "taking numerics class" in line]
        assert len(taken) == 1 and FIRST_CLASS in taken[0] and head.peer_id[:8] in taken[0]
        loads = [line for line in log if "passed their checks" in line]
        assert len(loads) == 1, f"the range loaded once, in the class taken: {loads}"

        reply = api_chat(tail, QUESTION, max_tokens=N_TOKENS, model="bench", ignore_eos=True)
        assert reply == chat_reference(bench_model, QUESTION, N_TOKENS)
