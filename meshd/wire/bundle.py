"""Hidden-state bundle: typed view over the protobuf message, with strict validation.

Encoding writes tensors as raw little-endian bytes, or, when the sender asks for it, large tensors as
zstd over byte planes (:mod:`meshd.wire.byte_planes`) where that is smaller. Decoding checks every
tensor's dtype, shape and byte length, and the bundle's own counters, before any byte becomes a
tensor; anything inconsistent raises :class:`~meshd.errors.BundleError`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from enum import IntEnum
from typing import cast

import numpy as np
import torch
from google.protobuf.message import DecodeError

from meshd.errors import BundleError
from meshd.transport.framing import DEFAULT_MAX_MESSAGE_BYTES
from meshd.wire import byte_planes
from meshd.wire import hidden_state_pb2 as pb
from meshd.wire.limits import MAX_DRAFT_TOKENS, MAX_PREFIX_NAME_BYTES, MAX_TOP_LOGPROBS

SCHEMA_VERSION = 1
MAX_TENSORS = 16
MAX_RANK = 4
COMPRESS_MIN_BYTES = 64 * 1024  # smaller tensors (every decode step) always travel raw
MAX_TENSOR_BYTES = DEFAULT_MAX_MESSAGE_BYTES  # a compressed tensor may not decode to more than a raw one may be


class Phase(IntEnum):
    PREFILL = pb.PREFILL
    DECODE = pb.DECODE


_DTYPES: dict[int, tuple[torch.dtype, int]] = {
    pb.FLOAT32: (torch.float32, 4),
    pb.FLOAT16: (torch.float16, 2),
    pb.BFLOAT16: (torch.bfloat16, 2),
    pb.INT64: (torch.int64, 8),
    pb.INT32: (torch.int32, 4),
}
_WIRE_DTYPE = {torch_dtype: code for code, (torch_dtype, _) in _DTYPES.items()}




@dataclass(frozen=True)
class Sampling:
    """How the tail picks a token (``temperature == 0`` is greedy), and what it reports of the choice."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: bool = False   # report the sampled token's log-probability
    top_logprobs: int = 0    # ...and those of the most likely tokens

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class HiddenStateBundle:
    session_id: str
    epoch: int
    phase: Phase
    start_position: int
    token_count: int
    tensors: dict[str, torch.Tensor]
    range_start: int
    range_end: int
    step: int = 0
    sample: bool = False
    sampling: Sampling | None = None
    sent_at_ns: int = 0
    version: int = field(default=SCHEMA_VERSION)
    draft: tuple[int, ...] = ()  # decode: the drafted tokens after the first, which the tail verifies
    prefix: bytes = b""          # the session's first chunk continues the kept prefix of this name
    keep_prefix: bytes = b""     # keep the KV after this chunk as the prefix of this name
    # Not on the wire: set by the hop that received the bundle, so that prefix names of different
    # entries (and upstream peers) never meet in its store (meshd.session.hop_state).
    prefix_scope: bytes = b""

    @property
    def end_position(self) -> int:
        """The position just past this bundle's last token."""
        return self.start_position + self.token_count

    def part(self, start: int, end: int, tensors: dict[str, torch.Tensor] | None = None) -> HiddenStateBundle:
        """Positions ``[start, end)`` of this bundle: its own tensors sliced, or ``tensors`` in their place.

        The one rule for splitting a bundle: only the part that ends where the bundle ends asks the tail
        to sample (and keeps a prefix), and only the part that starts where it starts carries the
        sampling settings and the prefix it continues.
        """
        if not self.start_position <= start < end <= self.end_position:
            raise ValueError(f"[{start}, {end}) is not inside [{self.start_position}, {self.end_position})")
        if self.draft and (start, end) != (self.start_position, self.end_position):
            raise ValueError("a decode step with drafted tokens travels whole")
        if tensors is None:
            offset = start - self.start_position
            tensors = {name: t[offset : offset + end - start] for name, t in self.tensors.items()}
        return HiddenStateBundle(
            session_id=self.session_id, epoch=self.epoch, phase=self.phase, start_position=start,
            token_count=end - start, tensors=tensors, range_start=self.range_start, range_end=self.range_end,
            step=self.step, sample=self.sample and end == self.end_position,
            sampling=self.sampling if start == self.start_position else None, sent_at_ns=self.sent_at_ns,
            version=self.version, draft=self.draft, prefix=self.prefix if start == self.start_position else b"",
            keep_prefix=self.keep_prefix if end == self.end_position else b"", prefix_scope=self.prefix_scope,
        )

    def chunks(self, max_tokens: int) -> list[HiddenStateBundle]:
        """This bundle cut into parts of at most ``max_tokens`` tokens, in order."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.token_count <= max_tokens:
            return [self]
        return [self.part(s, min(s + max_tokens, self.end_position))
                for s in range(self.start_position, self.end_position, max_tokens)]


def encode(bundle: HiddenStateBundle, *, compress: bool = False) -> bytes:
    """The bundle's wire bytes. With ``compress``, each tensor of at least ``COMPRESS_MIN_BYTES`` is
    sent as zstd over byte planes when that is smaller than its raw bytes."""
    msg = pb.HiddenStateBundle(
        version=bundle.version,
        session_id=bundle.session_id,
        epoch=bundle.epoch,
        step=bundle.step,
        phase=cast(pb.Phase, int(bundle.phase)),
        start_position=bundle.start_position,
        token_count=bundle.token_count,
        range_start=bundle.range_start,
        range_end=bundle.range_end,
        sample=bundle.sample,
        sent_at_ns=bundle.sent_at_ns,
        draft=list(bundle.draft),
        prefix=bundle.prefix,
        keep_prefix=bundle.keep_prefix,
    )
    if bundle.sampling is not None:
        s = bundle.sampling
        msg.sampling.CopyFrom(
            pb.Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, logprobs=s.logprobs,
                        top_logprobs=s.top_logprobs)
        )
    for name, tensor in bundle.tensors.items():
        code = _WIRE_DTYPE.get(tensor.dtype)
        if code is None:
            raise BundleError(f"tensor {name!r}: dtype {tensor.dtype} has no wire encoding")
        data, encoding = tensor_bytes(tensor), pb.RAW
        if compress and len(data) >= COMPRESS_MIN_BYTES:
            packed = byte_planes.compress(data, _DTYPES[code][1])
            if len(packed) < len(data):
                data, encoding = packed, pb.ZSTD_BYTE_PLANES
        msg.tensors.append(pb.Tensor(name=name, dtype=cast(pb.DType, code), shape=list(tensor.shape), data=data,
                                     encoding=encoding))
    return msg.SerializeToString()


def raw_tensor_bytes(bundle: HiddenStateBundle) -> int:
    """What the bundle's tensors take uncompressed."""
    return sum(t.numel() * t.element_size() for t in bundle.tensors.values())


def decode(data: bytes) -> HiddenStateBundle:
    msg = pb.HiddenStateBundle()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise BundleError(f"bundle does not parse: {exc}") from None
    if msg.version != SCHEMA_VERSION:
        raise BundleError(f"bundle schema version {msg.version} is not supported (this peer: {SCHEMA_VERSION})")
    if msg.phase not in (pb.PREFILL, pb.DECODE):
        raise BundleError(f"bundle phase {msg.phase} is not prefill or decode")
    if not msg.session_id:
        raise BundleError("bundle has no session id")
    if msg.token_count < 1:
        raise BundleError("bundle carries no tokens")
    if msg.phase == pb.DECODE and msg.token_count != 1 + len(msg.draft):
        raise BundleError(f"a decode bundle carries one token and its {len(msg.draft)} drafted ones, not "
                          f"{msg.token_count}")
    if msg.phase == pb.PREFILL and msg.draft:
        raise BundleError("a prefill chunk carries no drafted tokens")
    if len(msg.draft) > MAX_DRAFT_TOKENS:
        raise BundleError(f"a decode step verifies at most {MAX_DRAFT_TOKENS} drafted tokens, not {len(msg.draft)}")
    if msg.draft and not msg.sample:
        raise BundleError("drafted tokens are verified only by a step the tail samples")
    if msg.range_end <= msg.range_start:
        raise BundleError(f"empty layer range [{msg.range_start}, {msg.range_end})")
    if (msg.prefix or msg.keep_prefix) and msg.phase != pb.PREFILL:
        raise BundleError("only prefill chunks continue or keep a prefix")
    if max(len(msg.prefix), len(msg.keep_prefix)) > MAX_PREFIX_NAME_BYTES:
        raise BundleError(f"a prefix name is at most {MAX_PREFIX_NAME_BYTES} bytes")
    if msg.prefix and msg.start_position == 0:
        raise BundleError("a chunk that continues a prefix starts after it, not at position 0")
    if len(msg.tensors) > MAX_TENSORS:
        raise BundleError(f"bundle has {len(msg.tensors)} tensors (limit {MAX_TENSORS})")
    tensors: dict[str, torch.Tensor] = {}
    for t in msg.tensors:
        if t.name in tensors:
            raise BundleError(f"tensor {t.name!r} appears twice")
        tensors[t.name] = _decode_tensor(t)
    sampling = None
    if msg.HasField("sampling"):
        s = msg.sampling
        if not (math.isfinite(s.temperature) and s.temperature >= 0):
            raise BundleError(f"sampling temperature {s.temperature} is not a finite non-negative number")
        if not (math.isfinite(s.top_p) and 0 <= s.top_p <= 1):
            raise BundleError(f"sampling top_p {s.top_p} is outside [0, 1]")
        if s.top_logprobs > MAX_TOP_LOGPROBS:
            raise BundleError(f"top_logprobs {s.top_logprobs} is above {MAX_TOP_LOGPROBS}")
        sampling = Sampling(temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k, seed=s.seed,
                            logprobs=s.logprobs, top_logprobs=s.top_logprobs)
    return HiddenStateBundle(
        session_id=msg.session_id,
        epoch=msg.epoch,
        phase=Phase(msg.phase),
        start_position=msg.start_position,
        token_count=msg.token_count,
        tensors=tensors,
        range_start=msg.range_start,
        range_end=msg.range_end,
        step=msg.step,
        sample=msg.sample,
        sampling=sampling,
        sent_at_ns=msg.sent_at_ns,
        version=msg.version,
        draft=tuple(int(t) for t in msg.draft),
        prefix=msg.prefix,
        keep_prefix=msg.keep_prefix,
    )


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's values as raw little-endian bytes (bfloat16 as its 16 bits), as the wire carries them."""
    t = tensor.detach().to("cpu").contiguous()
    raw = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    if sys.byteorder != "little":
        raw = raw.byteswap()
    return raw.tobytes()


def _decode_tensor(t: pb.Tensor) -> torch.Tensor:
    if t.dtype not in _DTYPES:
        raise BundleError(f"tensor {t.name!r}: unknown dtype code {t.dtype}")
    dtype, itemsize = _DTYPES[t.dtype]
    if not 1 <= len(t.shape) <= MAX_RANK:
        raise BundleError(f"tensor {t.name!r}: rank {len(t.shape)} is outside 1..{MAX_RANK}")
    shape = tuple(int(d) for d in t.shape)
    expected = math.prod(shape) * itemsize
    data = t.data
    if t.encoding == pb.ZSTD_BYTE_PLANES:
        try:
            data = byte_planes.decompress(data, itemsize, expected, MAX_TENSOR_BYTES)
        except BundleError as exc:
            raise BundleError(f"tensor {t.name!r}: {exc}") from None
    elif t.encoding != pb.RAW:
        raise BundleError(f"tensor {t.name!r}: unknown encoding {t.encoding}")
    if expected != len(data):
        raise BundleError(
            f"tensor {t.name!r}: shape {list(shape)} x {itemsize} bytes needs {expected} bytes, got {len(data)}"
        )
    if expected == 0:
        raise BundleError(f"tensor {t.name!r} is empty")
    return tensor_from_bytes(data, dtype, shape)


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor :func:`tensor_bytes` wrote (``data`` holds exactly ``shape`` of ``dtype``), in memory of its own."""
    np_dtype = {torch.bfloat16: np.int16}.get(dtype) or torch.empty(0, dtype=dtype).numpy().dtype
    array = np.frombuffer(data, dtype=np.dtype(np_dtype).newbyteorder("<")).reshape(shape)
    tensor = torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    return tensor
