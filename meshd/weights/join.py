"""Serving a model this peer was given no files of: ``--model-id NAME`` alone.

The peer waits until gossip shows peers that serve the model, and takes the compat key most of them
run. From those peers it fetches the config and tokenizer (checked against the compat key), then the
manifest (checked against the weights digest the key commits to), and adopts their numerics class,
so that its shard computes exactly as theirs. That is enough for its card: placement sizes a range
for it like for any other peer. Only when a range is placed (or pinned with ``--layers``) does it
fetch that range's tensors (:mod:`meshd.weights.fetch`), into the same directory under the data
directory as the tokenizer, which then reads like any model directory holding those layers.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import trio

from meshd.errors import ErrorCode
from meshd.files import write_atomically
from meshd.models.artifacts import SOURCE_FILE, ModelFilesCache
from meshd.rpc import RpcFailed, call
from meshd.rpc.router import NoSourceAnswered, ask_in_turn
from meshd.runtime.adapters import adapter_for
from meshd.runtime.loader import load_config
from meshd.runtime.manifest import Manifest, TensorEntry, entry_as_json, entry_from_json
from meshd.runtime.model_info import ModelInfo, describe_fetched
from meshd.runtime.numerics import numerics_from_name
from meshd.runtime.shard import range_tensors
from meshd.tracker.view import MeshView
from meshd.transport.streams import StreamOpener
from meshd.weights.fetch import FetchStats, SourceFailed, WeightsUnavailable, assemble, fetch_chunks, seed_from
from meshd.weights.source import BadManifest, checked_manifest, manifest_from_message
from meshd.wire import rpc_pb2 as pb

log = logging.getLogger("meshd.weights")

MANIFEST_FILE = "meshd-manifest.json"
WAIT_LOG_S = 30.0     # how often waiting for a serving peer is logged
POLL_S = 0.5
ASK_TIMEOUT_S = 30.0  # one chunk or one manifest


class ModelJoin:
    """The model this peer serves by name: chosen from what the mesh serves, fetched a range at a time."""

    def __init__(self, model_id: str, view: MeshView, files: ModelFilesCache, opener: StreamOpener,
                 device: str) -> None:
        self.model_id = model_id
        self.view = view
        self.files = files
        self.opener = opener
        self.device = device
        self.info: ModelInfo | None = None
        self.stats: FetchStats | None = None
        self.state = "waiting for a peer that serves it"

    def status(self) -> dict[str, object]:
        return {"model": self.model_id, "state": self.state,
                "fetch": self.stats.as_json() if self.stats is not None else None}

    # -- the model -------------------------------------------------------------------------------

    def _chosen_key(self) -> str | None:
        """The compat key most peers serving the model run (torch numerics), or None while there is none."""
        keys: Counter[str] = Counter()
        gguf = False
        for peer_id, card in self.view.cards().items():
            for m in card.models:
                if peer_id == self.view.self_id or m.model_id != self.model_id or m.shard_error:
                    continue
                if m.backend == "llama.cpp":
                    gguf = True
                    continue
                keys[m.compat_key] += 1
        if not keys and gguf:
            raise WeightsUnavailable(f"{self.model_id} is served from a GGUF file on llama.cpp; copy the file "
                                     "to this machine and start with --model FILE")
        if not keys:
            return None
        return min(keys, key=lambda k: (-keys[k], k))

    async def describe(self) -> ModelInfo:
        """Wait for peers that serve the model, then fetch what a card needs: config, tokenizer, manifest."""
        next_log = trio.current_time()
        while (key := self._chosen_key()) is None:
            if trio.current_time() >= next_log:
                log.info("waiting for a peer that serves %s to fetch it from", self.model_id)
                next_log += WAIT_LOG_S
            await trio.sleep(POLL_S)
        self.state = "fetching its config and manifest"
        directory = await self.files.directory_for(self.model_id, key, self.view.sources_of)
        source = json.loads((directory / SOURCE_FILE).read_text())
        try:
            numerics = numerics_from_name(str(source["numerics"]), self.device)
        except ValueError as exc:
            raise WeightsUnavailable(f"the peers serving {self.model_id} compute as {source['numerics']}, "
                                     f"which this peer cannot: {exc}") from None
        manifest = await self._manifest(directory, key, str(source["weights_digest"]))
        info = await trio.to_thread.run_sync(describe_fetched, directory, self.model_id, manifest, numerics)
        if info.compat_key != key:
            raise WeightsUnavailable(f"the fetched files of {self.model_id} make compat key {info.compat_key}, "
                                     f"not {key}")
        log.info("serving %s by fetching its layers from peers (compat key %s, %d tensors, %.1f MB in all, "
                 "numerics %s)", self.model_id, key, len(manifest.tensors), manifest.total_bytes / 1e6, numerics.name)
        self.info = info
        self.state = "waiting for a range"
        return info

    async def _manifest(self, directory: Path, compat_key: str, weights_digest: str) -> Manifest:
        stored = directory / MANIFEST_FILE
        if stored.is_file():
            try:
                return checked_manifest([entry_from_json(e) for e in json.loads(stored.read_text())], weights_digest)
            except (OSError, ValueError, KeyError, TypeError, BadManifest):
                pass
            log.warning("the stored manifest of %s does not match its compat key; fetching it again", self.model_id)
        request = pb.PeerRequest(manifest=pb.ManifestRequest(model_id=self.model_id, compat_key=compat_key))
        try:
            _peer, manifest = await ask_in_turn(
                self.opener, self.view.sources_of(compat_key), request, "manifest",
                lambda got: manifest_from_message(got, weights_digest), ASK_TIMEOUT_S,
                f"the manifest of {self.model_id} ({compat_key})")
        except NoSourceAnswered as exc:
            raise WeightsUnavailable(str(exc)) from exc
        entries = [entry_as_json(e) for e in manifest.tensors.values()]
        await trio.to_thread.run_sync(write_atomically, stored, json.dumps(entries))
        return manifest

    # -- a range's tensors -----------------------------------------------------------------------

    async def fetch_range(self, start: int, end: int) -> None:
        """Fetch the tensors of ``[start, end)`` that the model directory does not hold yet."""
        info = self.info
        assert info is not None, "describe() first"
        config = await trio.to_thread.run_sync(load_config, info.model_dir)
        names = range_tensors(adapter_for(config), config, info.manifest.tensors, start, end)
        missing = [n for n in names if n not in info.manifest.tensors]
        if missing:
            raise WeightsUnavailable(f"the manifest of {self.model_id} lacks {', '.join(missing)}")
        entries = [info.manifest.tensors[n] for n in names]
        staging = info.model_dir.parent / f"{info.model_dir.name}.partial"
        self.state = f"fetching layers [{start}, {end})"
        await trio.to_thread.run_sync(seed_from, info.model_dir, staging, entries)
        addresses = dict(self.view.sources_of(info.compat_key))

        async def ask(source: str, entry: TensorEntry, index: int) -> bytes:
            request = pb.PeerRequest(chunk=pb.ChunkRequest(compat_key=info.compat_key, tensor=entry.name, index=index))
            started = self.view.clock()
            try:
                reply = await call(self.opener, source, addresses[source], request, timeout=ASK_TIMEOUT_S)
            except RpcFailed as exc:
                raise SourceFailed(str(exc), lacks=exc.code == ErrorCode.UNKNOWN_MODEL) from None
            if reply.WhichOneof("body") != "chunk":
                raise SourceFailed(f"answered {reply.WhichOneof('body')!r}")
            # chunks are the one bulk traffic between peers outside sessions: they measure the link's rate
            self.view.record_transfer(source, len(reply.chunk.data), started, self.view.clock())
            return reply.chunk.data

        what = f"layers [{start}, {end}) of {self.model_id}"
        self.stats = FetchStats()
        try:
            await fetch_chunks(entries, sorted(addresses), ask, staging, what, self.stats)
        except WeightsUnavailable:
            self.state = f"fetching layers [{start}, {end}) failed"
            raise
        await trio.to_thread.run_sync(assemble, staging, entries, info.model_dir)
        s = self.stats
        log.info("fetched %s: %.1f MB from %d peers (%.1f MB already here, %.1f MB discarded)", what,
                 s.bytes_fetched / 1e6, len(s.by_source), s.bytes_on_disk / 1e6, s.bytes_discarded / 1e6)
        self.state = f"fetched layers [{start}, {end})"

