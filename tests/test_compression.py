"""zstd over byte planes for large bundles: exact round trips, bounded decoding, and the per-link policy."""

from __future__ import annotations

import pytest
import torch
import zstandard

from meshd.errors import BundleError
from meshd.session.link_compression import CompressionPolicy
from meshd.wire import bundle as wire
from meshd.wire import byte_planes
from meshd.wire import hidden_state_pb2 as pb
from meshd.wire.bundle import COMPRESS_MIN_BYTES, HiddenStateBundle, Phase

ROWS = 64  # 64 x 1024 float32 = 256 KiB, above the compression threshold


def prefill(tensor: torch.Tensor) -> HiddenStateBundle:
    return HiddenStateBundle(session_id="s", epoch=0, phase=Phase.PREFILL, start_position=0,
                             token_count=tensor.shape[0], tensors={"hidden_states": tensor}, range_start=4,
                             range_end=8)


def hidden(rows: int = ROWS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(rows, 1024, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)


def tensor_message(data: bytes) -> pb.Tensor:
    msg = pb.HiddenStateBundle()
    msg.ParseFromString(data)
    return msg.tensors[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compressed_bundles_decode_to_exactly_the_same_tensor(dtype):
    tensor = hidden(dtype=dtype)
    raw = wire.encode(prefill(tensor))
    packed = wire.encode(prefill(tensor), compress=True)
    assert tensor_message(packed).encoding == pb.ZSTD_BYTE_PLANES
    assert len(packed) < 0.95 * len(raw)  # hidden states of a model shrink by more than this
    out = wire.decode(packed)
    assert out.tensors["hidden_states"].dtype == dtype
    assert torch.equal(out.tensors["hidden_states"].view(torch.uint8), tensor.view(torch.uint8))


def test_byte_planes_shrink_floats_more_than_plain_zstd():
    raw = wire.tensor_bytes(hidden())
    plain = zstandard.ZstdCompressor(level=byte_planes.LEVEL).compress(raw)
    assert len(byte_planes.compress(raw, 4)) < len(plain)


def test_small_tensors_and_incompressible_ones_travel_raw():
    small = hidden(rows=COMPRESS_MIN_BYTES // 4096 - 1)
    assert tensor_message(wire.encode(prefill(small), compress=True)).encoding == pb.RAW
    noise = torch.randint(-(2**31), 2**31 - 1, (ROWS, 1024), dtype=torch.int32, generator=torch.Generator())
    assert tensor_message(wire.encode(prefill(noise), compress=True)).encoding == pb.RAW


def _tamper(encoded: bytes, **changes) -> bytes:
    msg = pb.HiddenStateBundle()
    msg.ParseFromString(encoded)
    for name, value in changes.items():
        if name == "shape":
            del msg.tensors[0].shape[:]
            msg.tensors[0].shape.extend(value)
        else:
            setattr(msg.tensors[0], name, value)
    return msg.SerializeToString()


@pytest.mark.parametrize(("changes", "message"), [
    ({"data": b"not zstd at all"}, "not a zstd frame"),
    ({"shape": [ROWS, 1000]}, "declares 262144 bytes, its shape needs 256000"),
    ({"encoding": 7}, "unknown encoding 7"),
])
def test_bad_compressed_tensors_are_rejected(changes, message):
    packed = wire.encode(prefill(hidden()), compress=True)
    with pytest.raises(BundleError, match=message):
        wire.decode(_tamper(packed, **changes))


def test_a_frame_without_its_size_or_cut_short_is_rejected():
    raw = wire.tensor_bytes(hidden())
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(raw)
    packed = wire.encode(prefill(hidden()), compress=True)
    with pytest.raises(BundleError, match="declares -1 bytes"):
        wire.decode(_tamper(packed, data=unsized))
    cut = tensor_message(packed).data[:-100]
    with pytest.raises(BundleError, match="does not decompress"):
        wire.decode(_tamper(packed, data=cut))


def test_a_small_frame_cannot_claim_a_huge_tensor():
    # a frame of a few hundred bytes set against a 4 GiB shape is refused before anything is allocated
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(1024 * 1024))
    packed = wire.encode(prefill(hidden()), compress=True)
    with pytest.raises(BundleError, match="the limit is"):
        wire.decode(_tamper(packed, data=bomb, shape=[1024 * 1024, 1024]))


# -- the policy -------------------------------------------------------------------------------------

BIG = 4 * 1024 * 1024
MB = 1e6


def measured(rate_bytes_per_s: float, saving: float = 0.16, cost_ns_per_byte: float = 1.5) -> CompressionPolicy:
    """A policy that has seen one large send at ``rate`` and one compression with these figures."""
    policy = CompressionPolicy(window_bytes=1024 * 1024)
    policy.record_send(BIG, BIG / rate_bytes_per_s)
    policy.record_compression(BIG, int(BIG * (1 - saving)), BIG * cost_ns_per_byte * 1e-9)
    return policy


def test_compression_is_chosen_on_a_slow_link_and_not_on_a_fast_one():
    assert measured(12.5 * MB).should_compress(BIG)  # 100 Mbit/s: 16% of the bytes is worth 2 ns/byte
    assert not measured(2000 * MB).should_compress(BIG)  # loopback
    # the break-even: saving / rate = cost x (1 + receiver's share) -> about 71 MB/s here
    assert measured(60 * MB).should_compress(BIG)
    assert not measured(90 * MB).should_compress(BIG)


def test_small_payloads_modes_and_unmeasured_links():
    slow = measured(1 * MB)
    assert not slow.should_compress(COMPRESS_MIN_BYTES - 1)  # a decode step is never compressed
    assert not CompressionPolicy().should_compress(BIG)  # nothing known about the link yet
    assert CompressionPolicy(mode="always").should_compress(BIG)
    assert not CompressionPolicy(mode="always").should_compress(4096)
    off = CompressionPolicy(mode="off")
    off.record_send(BIG, 10.0)
    assert not off.should_compress(BIG)
    with pytest.raises(ValueError, match="not one of"):
        CompressionPolicy(mode="sometimes")


def test_sends_within_one_window_do_not_measure_the_link():
    policy = CompressionPolicy(window_bytes=1024 * 1024)
    policy.record_send(512 * 1024, 1.0)  # fits the window: says nothing about the link
    assert policy.link_bytes_per_s is None
    policy.record_send(3 * 1024 * 1024, 0.5)
    policy.record_send(3 * 1024 * 1024, 2.0)  # a receiver busy computing slows a send: the best one counts
    assert policy.link_bytes_per_s == pytest.approx(3 * 1024 * 1024 / 0.5)


def test_a_slow_link_is_probed_first_then_follows_its_measurements():
    policy = CompressionPolicy(window_bytes=1024 * 1024, probe_every=4)
    policy.record_send(BIG, 3.0)  # about 1 MB/s
    assert policy.should_compress(BIG)  # nothing measured about compression yet: probe
    policy.record_compression(BIG, BIG, 0.01)  # this data does not shrink at all
    decisions = [policy.should_compress(BIG) for _ in range(8)]
    assert decisions.count(True) == 2  # only the periodic probes
    fast = CompressionPolicy(window_bytes=1024 * 1024, probe_every=1)
    fast.record_send(BIG, 0.001)
    fast.record_compression(BIG, BIG // 2, 0.002)
    assert not any(fast.should_compress(BIG) for _ in range(4))  # even a halving would not pay: no probes
