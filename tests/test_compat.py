"""The compat key commits to the tensors themselves: same name, other weights, never one route."""

from __future__ import annotations

import shutil

import httpx2 as httpx
import pytest
from safetensors.torch import load_file, save_file

from meshd.daemon.local_mesh import LocalMesh
from meshd.runtime.model_info import describe_model
from meshd.runtime.numerics import Numerics


@pytest.fixture(scope="module")
def twins(tiny_model, tmp_path_factory):
    """Two copies of tiny that differ in one value of one tensor: same names, shapes, sizes, headers."""
    root = tmp_path_factory.mktemp("twins")
    first, second = root / "a" / "tiny", root / "b" / "tiny"
    shutil.copytree(tiny_model, first)
    shutil.copytree(tiny_model, second)
    tensors = load_file(str(second / "model.safetensors"))
    tensors["model.layers.3.self_attn.o_proj.weight"][0, 0] += 1.0
    save_file(tensors, str(second / "model.safetensors"), metadata={"format": "pt"})
    return first, second


def test_one_changed_value_changes_the_compat_key(twins):
    a, b = (describe_model(m) for m in twins)
    assert (a.model_dir / "model.safetensors").stat().st_size == (b.model_dir / "model.safetensors").stat().st_size
    assert a.model_id == b.model_id and a.compat_key != b.compat_key and a.weights_digest != b.weights_digest
    changed = [n for n in a.manifest.tensors if a.manifest.tensors[n] != b.manifest.tensors[n]]
    assert changed == ["model.layers.3.self_attn.o_proj.weight"]


def test_the_numerics_class_is_in_the_compat_key(tiny_model):
    import torch

    fp32 = describe_model(tiny_model, numerics=Numerics(torch.float32))
    bf16 = describe_model(tiny_model, numerics=Numerics(torch.bfloat16, prefill_fp32=True))
    assert fp32.weights_digest == bf16.weights_digest and fp32.compat_key != bf16.compat_key


def test_the_manifest_is_hashed_once_and_then_read_from_its_cache(tiny_model, tmp_path, monkeypatch):
    from meshd.runtime import manifest

    calls = []
    real = manifest.hash_file
    monkeypatch.setattr(manifest, "hash_file", lambda path, progress=None: calls.append(path) or real(path, progress))
    first = describe_model(tiny_model, cache_dir=tmp_path)
    second = describe_model(tiny_model, cache_dir=tmp_path)
    assert first.compat_key == second.compat_key and len(calls) == 1


@pytest.mark.slow
def test_peers_with_other_weights_under_the_same_name_never_share_a_route(twins, tmp_path):
    a, b = twins
    with LocalMesh(tmp_path / "mesh") as mesh:
        head, other = mesh.start_peers([dict(model=a, layers=(0, 2)), dict(model=b, layers=(2, 4))])
        mesh.wait_until(lambda: len(head.get("/peers")["peers"]) == 2
                        and all(r["models"] and r["models"][0]["end"] for r in head.get("/peers")["peers"]), 60,
                        "both ranges loaded and gossiped")
        keys = {r["models"][0]["compat_key"] for r in head.get("/peers")["peers"]}
        assert len(keys) == 2
        response = httpx.post(f"http://{head.api}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
        message = response.json()["error"]["message"]
        assert response.status_code == 503 and ("[2, 4)" in message or "[0, 2)" in message)  # each key lacks half
        (match,) = mesh.start_peers([dict(model=a, layers=(2, 4))])
        mesh.wait_covered("tiny", timeout=60)
        reply = httpx.post(f"http://{head.api}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
        assert reply.status_code == 200
        assert other.get("/stats")["sessions_served"] == 0 and match.get("/stats")["sessions_served"] == 1
