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
from meshd.runtime.loader import INDEX_FILE, SINGLE_FILE, SafetensorsIndex, is_gguf_model
from meshd.runtime.manifest import CHUNK_BYTES, ITEMSIZE, Manifest, TensorEntry, digest_of_chunks
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
    entries = [TensorEntry(r.name, r.dtype, tuple(r.shape), "", r.nbytes, tuple(c.hex() for c in r.chunks))
               for r in message.tensors]
    return checked_manifest(entries, weights_digest)


def checked_manifest(entries: list[TensorEntry], weights_digest: str) -> Manifest:
    """The manifest of ``entries`` (from a peer, or stored on disk), once every tensor's size follows
    from its dtype and shape, its chunk hashes cover exactly that many bytes, and the whole hashes to
    ``weights_digest``. (The digest does not cover sizes; they must follow from what it covers.)"""
    tensors: dict[str, TensorEntry] = {}
    for e in entries:
        itemsize = ITEMSIZE.get(e.dtype)
        if itemsize is None or e.nbytes != itemsize * math.prod(e.shape):
            raise BadManifest(f"tensor {e.name!r} claims {e.nbytes} bytes of {e.dtype} in shape {list(e.shape)}")
        if any(len(c) != 64 for c in e.chunks) or len(e.chunks) != math.ceil(e.nbytes / CHUNK_BYTES):
            raise BadManifest(f"tensor {e.name!r} lists {len(e.chunks)} chunk hashes for {e.nbytes} bytes")
        if e.name in tensors:
            raise BadManifest(f"tensor {e.name!r} is listed twice")
        tensors[e.name] = TensorEntry(e.name, e.dtype, e.shape, digest_of_chunks(e.chunks), e.nbytes, e.chunks)
    manifest = Manifest(tensors)
    if manifest.digest != weights_digest:
        raise BadManifest(f"the manifest hashes to {manifest.digest[:16]}, the compat key commits to "
                          f"{weights_digest[:16]}")
    return manifest


class WeightsSource:
    """Answers ``manifest`` and ``chunk`` requests for the model this peer holds (none until it has one)."""

    def __init__(self) -> None:
        self.info: ModelInfo | None = None
        self._index: tuple[tuple[int, int, int], SafetensorsIndex] | None = None  # by the weight file's identity
        self.chunks_served = 0

    def offer(self, info: ModelInfo) -> None:
        self.info = info
        self._index = None

    def _index_of(self, model_dir: Path) -> SafetensorsIndex:
        """The directory's tensor index, read again whenever its weight file was rewritten (a peer that
        fetched another range writes a new one)."""
        top = model_dir / INDEX_FILE if (model_dir / INDEX_FILE).is_file() else model_dir / SINGLE_FILE
        try:
            st = top.stat()
        except OSError:
            raise WeightsRefused("this peer holds none of the model's tensors yet") from None
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._index
        if cached is not None and cached[0] == identity:
            return cached[1]
        try:
            index = SafetensorsIndex(model_dir)
        except ModelFormatError:
            raise WeightsRefused("this peer holds none of the model's tensors yet") from None
        self._index = (identity, index)
        return index

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
        index_ = self._index_of(model_dir)
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
