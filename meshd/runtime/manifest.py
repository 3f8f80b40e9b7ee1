"""The weights manifest: every tensor of a checkpoint with its dtype, shape and the hash of its bytes.

Two peers with the same model name but different weights must never share a route, and a file
changed or damaged on disk must not be served as the model it was. So the compat key commits to the
tensors themselves, not to file names: the manifest lists every tensor's name, stored dtype, shape
and digest, and its own digest goes into the compat key. A tensor's digest is the SHA-256 of the
SHA-256s of its 1 MiB chunks, so a peer that fetches a tensor from others in chunks can check each
chunk as it arrives against hashes the compat key commits to (:func:`tensor_digest`). Hashing reads every byte
once, streamed a tensor at a time; the result is cached per file by its identity (path, size,
modification time, inode), so a restart hashes nothing that did not change. A shard checks the
tensors it loads against the manifest as it reads them (:func:`verify_tensor`).

Safetensors files are read here directly (an 8-byte header length, a JSON header, then the data),
so a truncated file or a header that points outside it is found and named.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshd.errors import ModelFormatError
from meshd.files import write_atomically

log = logging.getLogger("meshd.runtime")

HEADER_LIMIT = 100 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024  # the unit a tensor is hashed (and fetched from other peers) in
CACHE_VERSION = 2
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str            # safetensors' dtype name: F32, BF16, F16 ...
    shape: tuple[int, ...]
    digest: str           # SHA-256 over the SHA-256s of its chunks, in order
    nbytes: int
    chunks: tuple[str, ...] = ()  # SHA-256 of each CHUNK_BYTES piece of its raw bytes

    def chunk_span(self, index: int) -> tuple[int, int]:
        """Where chunk ``index`` lies in the tensor's bytes: (offset, length)."""
        offset = index * CHUNK_BYTES
        return offset, min(CHUNK_BYTES, self.nbytes - offset)


def entry_as_json(e: TensorEntry) -> dict[str, object]:
    return {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "digest": e.digest, "nbytes": e.nbytes,
            "chunks": list(e.chunks)}


def entry_from_json(doc: dict[str, Any]) -> TensorEntry:
    return TensorEntry(str(doc["name"]), str(doc["dtype"]), tuple(int(d) for d in doc["shape"]), str(doc["digest"]),
                       int(doc["nbytes"]), tuple(str(c) for c in doc["chunks"]))


def digest_of_chunks(chunks: Iterable[str]) -> str:
    """A tensor's digest from its chunks' hashes (a tensor of no bytes has none)."""
    h = hashlib.sha256()
    for c in chunks:
        h.update(bytes.fromhex(c))
    return h.hexdigest()


def tensor_digest(raw: bytes | bytearray | memoryview) -> tuple[str, tuple[str, ...]]:
    """The digest of a tensor's raw bytes and the hashes of its chunks."""
    view = memoryview(raw).cast("B")
    chunks = tuple(hashlib.sha256(view[i : i + CHUNK_BYTES]).hexdigest() for i in range(0, len(view), CHUNK_BYTES))
    return digest_of_chunks(chunks), chunks


def read_header(path: Path) -> tuple[dict[str, dict[str, object]], int]:
    """A safetensors file's tensor table and the offset where its data starts; checked against the file size."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelFormatError(f"{path} is not a safetensors file (shorter than its header length)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > HEADER_LIMIT or 8 + header_len > size:
            raise ModelFormatError(f"{path} is truncated or not a safetensors file (header of {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            raise ModelFormatError(f"{path} has a header that is not JSON") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path} has a malformed header")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    for name, info in header.items():
        offsets, shape = (info.get("data_offsets"), info.get("shape")) if isinstance(info, dict) else (None, None)
        if (not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or not _whole_numbers(offsets, 2)
                or not _whole_numbers(shape, None)):
            raise ModelFormatError(f"{path}: tensor {name!r} has a malformed header entry (dtype, shape and "
                                   "data_offsets: text, whole numbers, two whole numbers)")
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end or data_start + end > size:
            raise ModelFormatError(f"{path} is truncated: tensor {name!r} ends at byte {data_start + end}, "
                                   f"the file has {size}")
        expected = ITEMSIZE.get(str(info["dtype"]), 0) * _numel(info["shape"])
        if expected != end - begin:
            raise ModelFormatError(f"{path}: tensor {name!r} has {end - begin} bytes, its shape needs {expected}")
    return header, data_start


def _whole_numbers(value: object, count: int | None) -> bool:
    """Whether ``value`` is a list of non-negative whole numbers (``count`` of them, when given)."""
    return (isinstance(value, list) and (count is None or len(value) == count)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def hash_file(path: Path, progress: Callable[[int], None] | None = None) -> list[TensorEntry]:
    """Every tensor of one safetensors (or GGUF) file, hashed a tensor at a time."""
    if path.suffix == ".gguf" or path.resolve().suffix == ".gguf":
        from meshd.runtime.gguf_checkpoint import hash_gguf

        entries = hash_gguf(path)
        if progress is not None:
            progress(sum(e.nbytes for e in entries))
        return entries
    header, data_start = read_header(path)
    entries = []
    with path.open("rb") as f:
        for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):  # type: ignore[index]
            info = header[name]
            begin, end = (int(x) for x in info["data_offsets"])  # type: ignore[attr-defined]
            f.seek(data_start + begin)
            chunks = []
            remaining = end - begin
            while remaining:
                block = f.read(min(CHUNK_BYTES, remaining))
                if len(block) != min(CHUNK_BYTES, remaining):
                    raise ModelFormatError(f"{path} is truncated inside tensor {name!r}")
                chunks.append(hashlib.sha256(block).hexdigest())
                remaining -= len(block)
                if progress is not None:
                    progress(len(block))
            entries.append(TensorEntry(name, str(info["dtype"]), tuple(int(d) for d in info["shape"]),  # type: ignore[attr-defined]
                                       digest_of_chunks(chunks), end - begin, tuple(chunks)))
    return entries


def _identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _cached(path: Path, cache_dir: Path | None, progress: Callable[[int], None] | None) -> list[TensorEntry]:
    if cache_dir is None:
        return hash_file(path, progress)
    key = hashlib.sha256(_identity(path).encode()).hexdigest()[:32]
    cache = cache_dir / f"{key}.json"
    if cache.is_file():
        try:
            doc = json.loads(cache.read_text())
            if doc.get("version") == CACHE_VERSION and doc.get("identity") == _identity(path):
                return [entry_from_json(e) for e in doc["tensors"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    entries = hash_file(path, progress)
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(cache, json.dumps({"version": CACHE_VERSION, "identity": _identity(path),
                                        "tensors": [entry_as_json(e) for e in entries]}))
    return entries


@dataclass(frozen=True)
class Manifest:
    tensors: dict[str, TensorEntry]

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.tensors):
            e = self.tensors[name]
            h.update(f"{name}\0{e.dtype}\0{list(e.shape)}\0{e.digest}\n".encode())
        return h.hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())


def weights_manifest(files: list[Path], cache_dir: Path | None = None,
                     say: Callable[[str], None] | None = None) -> Manifest:
    """The manifest of a checkpoint's weight files (hashed once, then cached by file identity)."""
    tensors: dict[str, TensorEntry] = {}
    total = sum(p.stat().st_size for p in files)
    done = 0
    last_report = 0

    def progress(n: int) -> None:
        nonlocal done, last_report
        done += n
        if say is not None and (done - last_report >= total // 10 or done == total) and total > 256 * 1024**2:
            last_report = done
            say(f"hashing weights: {done / 1e9:.1f} of {total / 1e9:.1f} GB")

    for path in files:
        for entry in _cached(path, cache_dir, progress):
            if entry.name in tensors:
                raise ModelFormatError(f"tensor {entry.name!r} appears in two weight files")
            tensors[entry.name] = entry
    return Manifest(tensors)


def verify_tensor(entry: TensorEntry, raw: bytes | bytearray | memoryview) -> None:
    """Raise unless ``raw`` are exactly the bytes the manifest lists for the tensor."""
    if len(raw) != entry.nbytes or tensor_digest(raw)[0] != entry.digest:
        raise ModelFormatError(f"tensor {entry.name!r} does not match the checkpoint's manifest "
                               "(the file changed or is damaged)")


def env_cache_dir() -> Path | None:
    """Where tools that have no data directory keep manifests (``MESHD_HOME``), if set."""
    home = os.environ.get("MESHD_HOME")
    return Path(home) / "cache" / "manifests" if home else None
