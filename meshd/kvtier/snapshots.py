"""A prefix snapshot as it travels to and from the KV tier: described, signed, compressed, chunked,
and on the way back checked in full before any byte becomes a tensor.

The payload is every layer's keys then values (layers in order), raw little-endian, compressed as one
zstd frame over byte planes (:mod:`meshd.wire.byte_planes`) and cut into chunks of ``CHUNK_BYTES``.
The description (:class:`~meshd.wire.kv_tier_pb2.KVSnapshot`) names the prefix, the model and
numerics class that computed it, the layer range, every size and digest, and is signed by the hop that
computed it; an importer accepts only what it expects (:class:`Expected`) from a publisher it trusts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshd.errors import BundleError
from meshd.identity import Identity
from meshd.identity.keys import public_key_matches, verify
from meshd.runtime.numerics import DTYPE_NAMES, DTYPES
from meshd.runtime.prefix_kv import PrefixSnapshot
from meshd.wire import byte_planes
from meshd.wire import kv_tier_pb2 as pb
from meshd.wire.bundle import tensor_bytes, tensor_from_bytes

CHUNK_BYTES = 1024 * 1024
MAX_SNAPSHOT_BYTES = 4 * 1024**3  # the payload of one snapshot, uncompressed
MAX_CHUNKS = MAX_SNAPSHOT_BYTES // CHUNK_BYTES


class SnapshotRefused(ValueError):
    """A snapshot from the tier that is not the one asked for, not intact, or not from a trusted hop."""


@dataclass(frozen=True)
class Expected:
    """What an importing hop needs a snapshot to be: its own model, numerics and layers, and the prefix asked."""

    key: bytes
    model_id: str
    compat_key: str
    numerics: str
    range_start: int
    range_end: int
    length: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


def signed_bytes(snapshot: pb.KVSnapshot) -> bytes:
    """What the publisher signs: the description without its signature."""
    unsigned = pb.KVSnapshot()
    unsigned.CopyFrom(snapshot)
    unsigned.signature = b""
    return unsigned.SerializeToString(deterministic=True)


Encoded = tuple[pb.KVSnapshot, list[bytes]]  # a snapshot's signed description and its compressed chunks


def encode_snapshot(snapshot: PrefixSnapshot, expected: Expected, identity: Identity) -> Encoded:
    """The signed description and the compressed chunks of ``snapshot`` (a hop's own, as ``expected``
    describes it)."""
    layers = range(expected.range_start, expected.range_end)
    shape = (1, expected.kv_heads, snapshot.length, expected.head_dim)
    parts: list[bytes] = []
    for layer in layers:
        for store in (snapshot.keys, snapshot.values):
            tensor = store.get(layer)
            if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != expected.dtype:
                raise ValueError(f"layer {layer}'s cache is not {list(shape)} in {expected.dtype}")
            parts.append(tensor_bytes(tensor))
    raw = b"".join(parts)
    itemsize = torch.empty((), dtype=expected.dtype).element_size()
    packed = byte_planes.compress(raw, itemsize)
    chunks = [packed[i : i + CHUNK_BYTES] for i in range(0, len(packed), CHUNK_BYTES)] or [b""]
    described = pb.KVSnapshot(
        key=expected.key, model_id=expected.model_id, compat_key=expected.compat_key, numerics=expected.numerics,
        range_start=expected.range_start, range_end=expected.range_end, length=snapshot.length,
        kv_heads=expected.kv_heads, head_dim=expected.head_dim, dtype=DTYPE_NAMES[expected.dtype],
        raw_bytes=len(raw), raw_sha256=hashlib.sha256(raw).digest(),
        chunk_sha256=[hashlib.sha256(c).digest() for c in chunks], publisher=identity.peer_id,
        public_key=identity.public_key)
    described.signature = identity.sign(signed_bytes(described))
    return described, chunks


def check_description(snapshot: pb.KVSnapshot) -> None:
    """A description's own consistency and signature (what the tier checks before storing a chunk)."""
    if not public_key_matches(snapshot.publisher, snapshot.public_key):
        raise SnapshotRefused("the snapshot's public key is not its publisher's")
    if not verify(snapshot.public_key, signed_bytes(snapshot), snapshot.signature):
        raise SnapshotRefused("the snapshot's signature does not verify")
    if snapshot.dtype not in DTYPES or snapshot.range_end <= snapshot.range_start or snapshot.length < 1:
        raise SnapshotRefused("the snapshot's dtype, layers or length are not valid")
    if not 1 <= len(snapshot.chunk_sha256) <= MAX_CHUNKS or snapshot.raw_bytes > MAX_SNAPSHOT_BYTES:
        raise SnapshotRefused(f"a snapshot has 1 to {MAX_CHUNKS} chunks and at most {MAX_SNAPSHOT_BYTES} bytes")
    itemsize = torch.empty((), dtype=DTYPES[snapshot.dtype]).element_size()
    layers = snapshot.range_end - snapshot.range_start
    if snapshot.raw_bytes != 2 * layers * snapshot.kv_heads * snapshot.length * snapshot.head_dim * itemsize:
        raise SnapshotRefused("the snapshot's size does not match its shape")


def check_chunk(snapshot: pb.KVSnapshot, index: int, data: bytes) -> None:
    if not 0 <= index < len(snapshot.chunk_sha256):
        raise SnapshotRefused(f"chunk {index} of a snapshot of {len(snapshot.chunk_sha256)} chunks")
    if len(data) > CHUNK_BYTES or hashlib.sha256(data).digest() != snapshot.chunk_sha256[index]:
        raise SnapshotRefused(f"chunk {index} does not match its digest")


def decode_snapshot(snapshot: pb.KVSnapshot, chunks: Sequence[bytes], expected: Expected,
                    trusted: frozenset[str]) -> PrefixSnapshot:
    """The tensors of a fetched snapshot, once it is exactly what ``expected`` says, signed by one of
    ``trusted`` (peers serving these layers in this numerics class), and every byte checks out."""
    check_expected(snapshot, expected, trusted)
    if len(chunks) != len(snapshot.chunk_sha256):
        raise SnapshotRefused(f"{len(chunks)} chunks of {len(snapshot.chunk_sha256)} arrived")
    for index, data in enumerate(chunks):
        check_chunk(snapshot, index, data)
    itemsize = torch.empty((), dtype=expected.dtype).element_size()
    try:
        raw = byte_planes.decompress(b"".join(chunks), itemsize, snapshot.raw_bytes, MAX_SNAPSHOT_BYTES)
    except BundleError as exc:
        raise SnapshotRefused(f"the snapshot does not decompress: {exc}") from None
    if hashlib.sha256(raw).digest() != snapshot.raw_sha256:
        raise SnapshotRefused("the snapshot's payload does not match its digest")
    shape = (1, expected.kv_heads, expected.length, expected.head_dim)
    per_tensor = len(raw) // (2 * (expected.range_end - expected.range_start))
    keys: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}
    at = 0
    for layer in range(expected.range_start, expected.range_end):
        for store in (keys, values):
            store[layer] = tensor_from_bytes(raw[at : at + per_tensor], expected.dtype, shape)
            at += per_tensor
    return PrefixSnapshot.of(expected.length, keys, values)


def check_expected(snapshot: pb.KVSnapshot, expected: Expected, trusted: frozenset[str]) -> None:
    """A fetched description is what ``expected`` says, signed by one of ``trusted``, and its chunks
    cannot add up to more than its payload (what an importer checks before fetching past chunk 0)."""
    check_description(snapshot)
    if len(snapshot.chunk_sha256) > snapshot.raw_bytes // CHUNK_BYTES + 2:
        raise SnapshotRefused("the snapshot has more chunks than its payload needs")
    if snapshot.publisher not in trusted:
        raise SnapshotRefused(f"the snapshot was published by {snapshot.publisher[:12]}, which does not serve "
                              "these layers in this numerics class")
    wanted = (expected.key, expected.model_id, expected.compat_key, expected.numerics, expected.range_start,
              expected.range_end, expected.length, expected.kv_heads, expected.head_dim, DTYPE_NAMES[expected.dtype])
    got = (snapshot.key, snapshot.model_id, snapshot.compat_key, snapshot.numerics, snapshot.range_start,
           snapshot.range_end, snapshot.length, snapshot.kv_heads, snapshot.head_dim, snapshot.dtype)
    if got != wanted:
        raise SnapshotRefused("the snapshot is not of this prefix, model, numerics class or layer range")
