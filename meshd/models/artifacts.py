"""A model's small files (config and tokenizer) for peers that do not hold the model directory.

Every peer answers the API, so an entry peer needs the tokenizer of every model it routes, not only
its own. A peer that serves a model hands out its config and tokenizer files; the peer that asks
checks them against the compat key it routes by (the key hashes exactly these files, the adapter and
the weights' digest), so a peer cannot hand out a tokenizer for other weights. Checked files are kept
under the data directory by compat key, and loaded from there after a restart, checked again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import trio

from meshd.errors import ErrorCode, MeshError
from meshd.files import staged_directory
from meshd.models.text import TextCodec
from meshd.rpc.router import NoSourceAnswered, ask_in_turn
from meshd.runtime.model_info import CONFIG_FILES, TOKENIZER_FILES, ModelInfo, compat_key_of, read_small_files
from meshd.runtime.model_info import tokenizer_digest_of as digest_of
from meshd.transport.streams import StreamOpener
from meshd.wire import rpc_pb2 as pb

log = logging.getLogger("meshd.models")

FETCH_TIMEOUT_S = 10.0
SOURCE_FILE = "meshd-source.json"  # architecture, weights digest and numerics: with the files, the compat key
ALLOWED_FILES = frozenset((*CONFIG_FILES, *TOKENIZER_FILES))

Sources = Callable[[str], list[tuple[str, str]]]
"""``sources(compat_key)``: (peer id, address) of peers that serve that compat key, best first."""


class UnknownModel(MeshError):
    """This peer does not serve the model asked for."""

    code = ErrorCode.UNKNOWN_MODEL


class ModelFilesUnavailable(MeshError):
    """No peer handed out files that match the compat key."""

    code = ErrorCode.NO_ROUTE


def check_files(files: dict[str, bytes], architecture: str, weights_digest: str, numerics: str,
                compat_key: str) -> None:
    """Raise unless ``files`` are exactly what ``compat_key`` commits to (and only files we know)."""
    unexpected = set(files) - ALLOWED_FILES
    if unexpected:
        raise ModelFilesUnavailable(f"unexpected files {sorted(unexpected)}")
    got = compat_key_of(architecture, digest_of(files), weights_digest, numerics)
    if got != compat_key:
        raise ModelFilesUnavailable(f"the files hash to compat key {got}, expected {compat_key}")


class ModelFilesCache:
    """Tokenizers by compat key: this peer's own model's, or files fetched from a serving peer."""

    def __init__(self, data_dir: Path, local: ModelInfo | None, opener: StreamOpener) -> None:
        self.root = Path(data_dir) / "models"
        self.local = local
        self.opener = opener
        self._codecs: dict[str, TextCodec] = {}
        self._locks: dict[str, trio.Lock] = {}

    # -- serving ---------------------------------------------------------------------------------

    async def serve(self, sender: str, request: pb.ModelFilesRequest) -> pb.ModelFiles:
        local = self.local
        if local is None or request.model_id != local.model_id:
            raise UnknownModel(f"this peer does not serve {request.model_id!r}")
        if request.compat_key and request.compat_key != local.compat_key:
            raise UnknownModel(f"this peer serves {local.model_id} with compat key {local.compat_key}")
        files = await trio.to_thread.run_sync(read_small_files, local.model_dir)
        return pb.ModelFiles(files=files, architecture=local.architecture, weights_digest=local.weights_digest,
                             numerics=local.numerics.name)

    # -- asking ----------------------------------------------------------------------------------

    async def codec_for(self, model_id: str, compat_key: str, sources: Sources) -> TextCodec:
        """The model's tokenizer, template and stop tokens, by the compat key a route runs."""
        codec = self._codecs.get(compat_key)
        if codec is not None:
            return codec
        async with self._locks.setdefault(compat_key, trio.Lock()):
            codec = self._codecs.get(compat_key)
            if codec is None:
                directory = await self.directory_for(model_id, compat_key, sources)
                codec = await trio.to_thread.run_sync(TextCodec.load, directory)
                self._codecs[compat_key] = codec
        return codec

    async def directory_for(self, model_id: str, compat_key: str, sources: Sources) -> Path:
        """The directory holding the model's config and tokenizer (and :data:`SOURCE_FILE`), checked
        against ``compat_key``: this peer's own, one stored before, or files fetched from ``sources``."""
        if self.local is not None and self.local.compat_key == compat_key:
            return self.local.model_dir
        stored = self.root / compat_key
        if await trio.to_thread.run_sync(_stored_is_valid, stored, compat_key):
            return stored

        def checked(got: pb.ModelFiles) -> pb.ModelFiles:
            check_files(dict(got.files), got.architecture, got.weights_digest, got.numerics, compat_key)
            return got

        request = pb.PeerRequest(model_files=pb.ModelFilesRequest(model_id=model_id, compat_key=compat_key))
        try:
            peer_id, got = await ask_in_turn(self.opener, sources(compat_key), request, "model_files", checked,
                                             FETCH_TIMEOUT_S, f"the files of {model_id} ({compat_key})")
        except NoSourceAnswered as exc:
            raise ModelFilesUnavailable(str(exc)) from exc
        await trio.to_thread.run_sync(_store, stored, dict(got.files), got.architecture, got.weights_digest,
                                      got.numerics)
        log.info("fetched the tokenizer of %s from %s (compat key verified)", model_id, str(peer_id)[:12])
        return stored


def _stored_is_valid(directory: Path, compat_key: str) -> bool:
    source = directory / SOURCE_FILE
    if not source.is_file():
        return False
    try:
        doc = json.loads(source.read_text())
        files = read_small_files(directory)
        check_files(files, str(doc["architecture"]), str(doc["weights_digest"]), str(doc["numerics"]), compat_key)
    except (OSError, ValueError, KeyError, ModelFilesUnavailable) as exc:
        log.warning("stored files for %s are not usable (%s); fetching them again", compat_key, exc)
        return False
    return True


def _store(directory: Path, files: dict[str, bytes], architecture: str, weights_digest: str,
           numerics: str) -> None:
    """Write checked files into a staging directory, then move it into place whole."""
    with staged_directory(directory) as staging:
        for name, data in files.items():
            (staging / name).write_bytes(data)
        (staging / SOURCE_FILE).write_text(json.dumps({"architecture": architecture,
                                                       "weights_digest": weights_digest, "numerics": numerics}))
