"""Handing out weights: the manifest of the model this peer holds, and its tensors' bytes by chunk.

The manifest is what a fetching peer checks everything against: its digest is the weights digest
the compat key commits to, and each tensor's digest is the hash of its chunks' hashes, so one chunk
can be checked the moment it arrives. A source checks each chunk against its own manifest before
sending it too: a copy damaged on disk is refused, never handed on. A peer that fetched only some
layers hands out what it holds and refuses the rest, so later peers can fetch from it as well.
GGUF models are shared as their file: their tensors are not handed out.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import trio

from meshd.errors import ErrorCode, MeshError, ModelFormatError
from meshd.runtime.loader import SafetensorsIndex, is_gguf_model
from meshd.runtime.manifest import CHUNK_BYTES, Manifest, TensorEntry, digest_of_chunks
from meshd.runtime.model_info import ModelInfo
from meshd.wire import rpc_pb2 as pb

log = logging.getLogger("meshd.weights")


class WeightsRefused(MeshError):
    """This peer does not hand out the weights asked for (another model, a tensor it does not hold)."""

    code = ErrorCode.UNKNOWN_MODEL


class BadManifest(MeshError):
    """A manifest that is not the one the compat key commits to."""

    code = ErrorCode.BAD_MODEL


def manifest_message(manifest: Manifest) -> pb.WeightsManifest:
    return pb.WeightsManifest(tensors=[
        pb.TensorRecord(name=e.name, dtype=e.dtype, shape=list(e.shape), nbytes=e.nbytes,
                        chunks=[bytes.fromhex(c) for c in e.chunks])
        for e in sorted(manifest.tensors.values(), key=lambda e: e.name)])


def manifest_from_message(message: pb.WeightsManifest, weights_digest: str) -> Manifest:
    """The manifest a peer sent, once it is exactly the one ``weights_digest`` commits to."""
    tensors: dict[str, TensorEntry] = {}
    for record in message.tensors:
        chunks = tuple(c.hex() for c in record.chunks)
        if any(len(c) != 32 for c in record.chunks) or len(chunks) != math.ceil(record.nbytes / CHUNK_BYTES):
            raise BadManifest(f"tensor {record.name!r} lists {len(chunks)} chunk hashes for {record.nbytes} bytes")
        if record.name in tensors:
            raise BadManifest(f"tensor {record.name!r} is listed twice")
        tensors[record.name] = TensorEntry(record.name, record.dtype, tuple(record.shape),
                                           digest_of_chunks(chunks), record.nbytes, chunks)
    manifest = Manifest(tensors)
    if manifest.digest != weights_digest:
        raise BadManifest(f"the manifest hashes to {manifest.digest[:16]}, the compat key commits to "
                          f"{weights_digest[:16]}")
    return manifest


class WeightsSource:
    """Answers ``manifest`` and ``chunk`` requests for the model this peer holds (none until it has one)."""

    def __init__(self) -> None:
        self.info: ModelInfo | None = None
        self._index: SafetensorsIndex | None = None
        self.chunks_served = 0

    def offer(self, info: ModelInfo) -> None:
        self.info = info
        self._index = None

    def _model(self, compat_key: str) -> ModelInfo:
        info = self.info
        if info is None or info.compat_key != compat_key:
            raise WeightsRefused(f"this peer holds no weights of compat key {compat_key}")
        if info.numerics.backend == "llama.cpp" or is_gguf_model(info.model_dir):
            raise WeightsRefused(f"{info.model_id} is a GGUF model: copy its file to the joining machine")
        return info

    async def serve_manifest(self, sender: str, request: pb.ManifestRequest) -> pb.WeightsManifest:
        info = self._model(request.compat_key)
        if request.model_id != info.model_id:
            raise WeightsRefused(f"this peer serves {info.model_id!r}, not {request.model_id!r}")
        return manifest_message(info.manifest)

    async def serve_chunk(self, sender: str, request: pb.ChunkRequest) -> pb.TensorChunk:
        info = self._model(request.compat_key)
        entry = info.manifest.tensors.get(request.tensor)
        if entry is None or request.index >= len(entry.chunks):
            raise WeightsRefused(f"the model has no chunk {request.index} of tensor {request.tensor!r}")
        data = await trio.to_thread.run_sync(self.read_chunk, info.model_dir, entry, request.index)
        self.chunks_served += 1
        return pb.TensorChunk(data=data)

    def read_chunk(self, model_dir: Path, entry: TensorEntry, index: int) -> bytes:
        """Chunk ``index`` of the tensor from this peer's files, checked against the manifest."""
        if self._index is None:
            try:
                self._index = SafetensorsIndex(model_dir)
            except ModelFormatError:  # a peer that is still fetching its first range holds no tensors yet
                raise WeightsRefused("this peer holds none of the model's tensors yet") from None
        index_ = self._index
        if entry.name not in index_:
            raise WeightsRefused(f"this peer does not hold tensor {entry.name!r}")
        path, start, _nbytes = index_.location(entry.name)
        offset, length = entry.chunk_span(index)
        with path.open("rb") as f:
            f.seek(start + offset)
            data = f.read(length)
        if hashlib.sha256(data).hexdigest() != entry.chunks[index]:
            log.error("chunk %d of %s on disk does not match the manifest: not handing it out", index, entry.name)
            raise WeightsRefused(f"this peer's copy of {entry.name!r} is damaged")
        return data
