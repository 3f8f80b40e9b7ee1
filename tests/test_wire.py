"""The hidden-state bundle codec, and the committed protobuf code matching its schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshd.errors import BundleError
from meshd.wire import bundle as wire
from meshd.wire import codegen
from meshd.wire import hidden_state_pb2 as pb
from meshd.wire.bundle import HiddenStateBundle, Phase, Sampling


def sample_bundle(**overrides) -> HiddenStateBundle:
    fields = dict(
        session_id="s", epoch=3, phase=Phase.PREFILL, start_position=0, token_count=5,
        tensors={"hidden_states": torch.randn(5, 8)}, range_start=2, range_end=4, step=0, sample=True,
        sampling=Sampling(temperature=0.5, top_p=0.9, top_k=7, seed=42),
    )
    fields.update(overrides)
    return HiddenStateBundle(**fields)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32])
def test_round_trip_is_exact(dtype):
    tensor = (torch.randn(5, 8) * 100).to(dtype)
    out = wire.decode(wire.encode(sample_bundle(tensors={"x": tensor})))
    assert out.tensors["x"].dtype == dtype
    assert torch.equal(out.tensors["x"], tensor)
    assert (out.session_id, out.epoch, out.phase, out.token_count, out.range_start, out.range_end) == (
        "s", 3, Phase.PREFILL, 5, 2, 4)
    assert out.sampling == Sampling(temperature=0.5, top_p=pytest.approx(0.9), top_k=7, seed=42)


def test_raw_bytes_are_little_endian_float32():
    msg = pb.HiddenStateBundle()
    msg.ParseFromString(wire.encode(sample_bundle(tensors={"x": torch.tensor([1.0, -2.0])}, token_count=2)))
    assert msg.tensors[0].data == b"\x00\x00\x80\x3f\x00\x00\x00\xc0"


def _raw(**changes) -> bytes:
    msg = pb.HiddenStateBundle()
    msg.ParseFromString(wire.encode(sample_bundle()))
    for path, value in changes.items():
        target = msg
        parts = path.split(".")
        for p in parts[:-1]:
            target = target.tensors[0] if p == "tensor" else getattr(target, p)
        if isinstance(value, list):
            del getattr(target, parts[-1])[:]
            getattr(target, parts[-1]).extend(value)
        else:
            setattr(target, parts[-1], value)
    return msg.SerializeToString()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": 9}, "schema version 9"),
        ({"phase": 0}, "phase"),
        ({"session_id": ""}, "no session id"),
        ({"token_count": 0}, "no tokens"),
        ({"range_end": 2}, "empty layer range"),
        ({"tensor.shape": [5, 9]}, "needs 180 bytes, got 160"),
        ({"tensor.data": b"\x00" * 12}, "needs 160 bytes, got 12"),
        ({"tensor.dtype": 77}, "unknown dtype"),
        ({"tensor.shape": []}, "rank 0"),
        ({"sampling.temperature": float("nan")}, "temperature"),
        ({"sampling.top_p": 1.5}, "top_p"),
    ],
)
def test_inconsistent_bundles_are_rejected(changes, message):
    with pytest.raises(BundleError, match=message):
        wire.decode(_raw(**changes))


def test_garbage_is_rejected():
    for blob in (b"\xff" * 40, b"\x0a\xff\xff\xff\xff\x0f"):
        with pytest.raises(BundleError):
            wire.decode(blob)


def test_decode_bundle_carries_one_token():
    bad = sample_bundle(phase=Phase.DECODE, start_position=5)
    with pytest.raises(BundleError, match="one token"):
        wire.decode(wire.encode(bad))


def test_committed_protobuf_code_matches_the_schema(tmp_path):
    for generated in codegen.generate(tmp_path):
        committed = Path(codegen.OUT_DIR) / generated.name
        assert committed.is_file(), f"{committed.name} is not committed; run `make proto`"
        assert committed.read_bytes() == generated.read_bytes(), f"{committed.name} is stale; run `make proto`"
