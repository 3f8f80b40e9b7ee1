"""A peer given only a model's name joins a mesh of real daemons: it fetches just the layers placed on
it, drops a source that hands out damaged chunks, and serves a route token-identical to one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from meshd.daemon.local_mesh import LocalMesh
from meshd.runtime.adapters import adapter_for
from meshd.runtime.loader import load_config
from meshd.runtime.model_info import describe_model, model_sizes
from meshd.runtime.shard import range_tensors
from tests.helpers import chat_reference

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
QUESTION = "What do you fetch?"
N_TOKENS = 12


def test_a_peer_without_files_fetches_only_its_range_and_serves_it(bench_model, tmp_path):
    sizes = model_sizes(bench_model)
    info = describe_model(bench_model)
    config = load_config(bench_model)
    gap = (6, 10)
    needed = sum(info.manifest.tensors[n].nbytes
                 for n in range_tensors(adapter_for(config), config, info.manifest.tensors, *gap))
    # one numerics class for every holder: each would measure its own, and under load they may differ
    same = ["--numerics", "cpu/float32/prefill-native/decode-native-rows1"]
    with LocalMesh(tmp_path, env={"PYTHONPATH": str(REPO)}) as mesh:
        head = mesh.start_peer(model=bench_model, layers=(0, gap[0]), extra=same)
        tail = mesh.start_peer(model=bench_model, layers=(gap[1], sizes.n_layers), extra=same)
        # holds the whole model too, but hands out every chunk with one byte flipped; too small to be placed
        liar = mesh.start_peer(model=bench_model, memory_budget=sizes.layer_bytes // 2, module="tests.lying_source",
                               extra=same)
        # the joiner takes its sources from the cards it holds when its range is placed: let the head, which
        # the joiner first exchanges cards with, know the liar by then
        mesh.wait_until(lambda: liar.peer_id in {p["peer_id"] for p in head.get("/peers")["peers"]}, 60,
                        "the head to know the liar")
        assert liar.status["compat_key"] == head.status["compat_key"] == info.compat_key
        joiner = mesh.start_peer(memory_budget=(gap[1] - gap[0]) * sizes.layer_bytes + sizes.layer_bytes // 2,
                                 extra=["--model-id", "bench"])
        mesh.wait_covered("bench", timeout=240)

        status = joiner.get("/status")
        fetch = status["weights_fetch"]["fetch"]
        assert status["range"] == list(gap) and status["compat_key"] == info.compat_key
        assert status["shard_error"] is None and all(c["ok"] for c in status["shard_checks"])
        assert fetch["bytes_needed"] == needed and fetch["bytes_fetched"] == needed, "exactly the range's tensors"
        assert needed < 0.3 * info.manifest.total_bytes
        assert list(fetch["dropped"]) == [liar.peer_id] and "does not match the manifest" in \
            fetch["dropped"][liar.peer_id]
        assert 0 < fetch["bytes_discarded"] <= 2 * 1024 * 1024, "at most one chunk per liar's worker was taken"
        assert set(fetch["by_source"]) == {head.peer_id, tail.peer_id}, "chunks came from both honest peers"
        print(f"\nfetched {fetch['bytes_fetched'] / 1e6:.1f} MB for layers {gap} of "
              f"{info.manifest.total_bytes / 1e6:.1f} MB in all; by source (MB): "
              f"{ {p[:8]: round(b / 1e6, 1) for p, b in fetch['by_source'].items()} }; "
              f"discarded {fetch['bytes_discarded'] / 1e6:.1f} MB from the liar")

        stored = Path(joiner.data_dir) / "models" / info.compat_key
        assert (stored / "model.safetensors").is_file() and not (stored.parent / f"{stored.name}.partial").exists()
        meshctl = subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", "status", "--json", "--control",
                                  joiner.control], capture_output=True, text=True, timeout=60, check=True)
        assert json.loads(meshctl.stdout)["weights_fetch"]["state"] == f"fetched layers [{gap[0]}, {gap[1]})"

        reference = chat_reference(bench_model, QUESTION, N_TOKENS)
        client = OpenAI(base_url=f"http://{joiner.api}/v1", api_key="unused", timeout=120, max_retries=0)
        reply = client.chat.completions.create(model="bench", messages=[{"role": "user", "content": QUESTION}],
                                               temperature=0, max_tokens=N_TOKENS, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == reference
        assert "dropped source" in joiner.log_tail(400)
