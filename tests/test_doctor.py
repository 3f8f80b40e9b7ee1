"""The doctor fails closed: each kind of damage to a checkpoint is named, and such a shard is never served."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshd.daemon.local_mesh import LocalMesh
from meshd.errors import ModelFormatError
from meshd.runtime.doctor import run_doctor
from meshd.runtime.model_info import describe_model
from meshd.runtime.shard import Shard

WEIGHTS = "model.safetensors"
VICTIM = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture
def copy(tiny_model, tmp_path):
    target = tmp_path / "tiny"
    shutil.copytree(tiny_model, target)
    return target


def rewrite(model_dir, change) -> None:
    tensors = load_file(str(model_dir / WEIGHTS))
    change(tensors)
    save_file(tensors, str(model_dir / WEIGHTS), metadata={"format": "pt"})


def test_a_healthy_range_passes_and_reports_what_a_card_says(tiny_model):
    report = run_doctor(tiny_model, (1, 3), "auto", "cpu")
    assert report.ok, report.error
    doc = report.as_json()
    assert doc["layers"] == [1, 3] and doc["dtype"] == "float32" and doc["device"] == "cpu"
    assert doc["compat_key"] == describe_model(tiny_model).compat_key and doc["decode_tok_s"] > 0
    assert [c["ok"] for c in doc["checks"]] == [True] * len(doc["checks"])


def test_a_truncated_file_is_named(copy):
    data = (copy / WEIGHTS).read_bytes()
    (copy / WEIGHTS).write_bytes(data[:-100])
    report = run_doctor(copy, (0, 2), "auto", "cpu")
    assert not report.ok and "truncated" in report.error


def test_a_missing_tensor_is_named(copy):
    rewrite(copy, lambda t: t.pop(VICTIM))
    report = run_doctor(copy, (0, 2), "auto", "cpu")
    assert not report.ok and "up_proj" in report.error
    assert run_doctor(copy, (2, 4), "auto", "cpu").ok  # other layers are fine


def test_a_tensor_full_of_nan_is_named(copy):
    rewrite(copy, lambda t: t[VICTIM].fill_(float("nan")))
    report = run_doctor(copy, (1, 2), "auto", "cpu")
    assert not report.ok and "not finite" in report.error and "up_proj" in report.error
    # the report keeps what passed before the failure, and the failing check itself
    by_name = {c.name: c.ok for c in report.checks}
    assert by_name["layers [1, 2) load"] is True and by_name["weights are finite"] is False


def test_a_config_that_does_not_match_the_weights_is_named(copy):
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] = 256
    (copy / "config.json").write_text(json.dumps(config))
    report = run_doctor(copy, (0, 1), "auto", "cpu")
    assert not report.ok and "does not match the config" in report.error


def _config(model_dir, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _shrink(name: str, rows: int):
    def change(tensors):
        tensors[name] = tensors[name][:rows].clone()
    return change


DAMAGE = {
    "the final norm's shape": (lambda d: rewrite(d, _shrink("model.norm.weight", 32)), "model.norm.weight has shape"),
    "the embedding's rows": (lambda d: rewrite(d, _shrink("model.embed_tokens.weight", 100)),
                             "model.embed_tokens.weight has shape [100, 64]"),
    "the LM head's rows": (lambda d: rewrite(d, _shrink("lm_head.weight", 100)), "lm_head.weight has shape [100, 64]"),
    "an untied head left out": (lambda d: rewrite(d, lambda t: t.pop("lm_head.weight")),
                                "no lm_head.weight, and config.json does not tie"),
    "more layers than the config names": (lambda d: _config(d, num_hidden_layers=2),
                                          "holds layers from 2 on, past the 2 config.json names"),
    "a weight stored as integers": (
        lambda d: rewrite(d, lambda t: t.update({"model.layers.1.self_attn.q_proj.weight": torch.zeros(
            t["model.layers.1.self_attn.q_proj.weight"].shape, dtype=torch.int32)})), "is stored as I32"),
    "a config field of the wrong type": (lambda d: _config(d, num_hidden_layers="four"),
                                         "not a config transformers can read"),
    "a rope type nobody has": (lambda d: _config(d, rope_parameters={"rope_type": "bogus", "rope_theta": 1e4}),
                               "cannot be built from config.json"),
    "no tokenizer": (lambda d: [(d / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
                     "the tokenizer in"),
    "a generation config that is not JSON": (lambda d: (d / "generation_config.json").write_text("{eos"),
                                             "generation_config.json does not read as JSON"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_what_the_config_and_the_model_code_would_trip_on_is_named(copy, damage):
    """Each is refused with one line naming what is wrong, not a traceback, nor served as if fine."""
    harm, says = DAMAGE[damage]
    harm(copy)
    report = run_doctor(copy, None, "auto", "cpu")
    assert not report.ok and says in report.error, report.error


def test_a_header_entry_of_the_wrong_types_is_named(copy):
    raw = (copy / WEIGHTS).read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    header["model.norm.weight"]["shape"] = "64"  # text, not a list of whole numbers
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)  # the same length: the data stays put
    assert len(text) == size
    (copy / WEIGHTS).write_bytes(raw[:8] + text + raw[8 + size:])
    report = run_doctor(copy, None, "auto", "cpu")
    assert not report.ok and "malformed header entry" in report.error, report.error


def test_bytes_changed_after_hashing_are_refused_at_load(copy):
    info = describe_model(copy)
    data = bytearray((copy / WEIGHTS).read_bytes())
    data[-4:] = bytes(4)  # the last tensor's last value, same size: only a hash can tell
    (copy / WEIGHTS).write_bytes(bytes(data))
    last = max(info.manifest.tensors, key=lambda n: n)
    with pytest.raises(ModelFormatError, match="does not match the checkpoint's manifest"):
        Shard(copy, 0, 4, manifest=info.manifest)
    assert last  # the manifest listed every tensor


def test_meshctl_doctor_exits_non_zero_and_says_why(copy):
    rewrite(copy, lambda t: t[VICTIM].fill_(float("nan")))
    run = subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", "doctor", "--model", str(copy),
                          "--layers", "0:2"], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1
    assert "FAIL" in run.stdout and "would not be served" in run.stderr and "not finite" in run.stderr
    ok = subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", "doctor", "--model", str(copy),
                         "--layers", "2:4", "--json"], capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True


@pytest.mark.slow
def test_a_peer_whose_shard_fails_its_checks_serves_nothing_and_says_why(copy, tmp_path):
    rewrite(copy, lambda t: t[VICTIM].fill_(float("nan")))
    with LocalMesh(tmp_path / "mesh") as mesh:
        peer = mesh.start_peer(model=copy, layers=(0, 4))
        status = mesh.wait_until(lambda: (s := peer.get("/status"))["shard_error"] and s, 60, "the check to fail")
        assert "not finite" in status["shard_error"] and status["range"] is None
        assert status["models_covered"] == []
        row = peer.get("/peers")["peers"][0]
        assert row["models"][0]["shard_error"] and row["models"][0]["end"] == 0
        assert peer.process.poll() is None  # the daemon runs on, without a range
    assert torch.isnan(load_file(str(copy / WEIGHTS))[VICTIM]).all()
