"""Weights shared between peers: manifests checked against the weights digest, chunks checked as they
arrive, lying and vanishing sources dropped, a stopped fetch resumed, and the result a model directory."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from meshd.errors import ModelFormatError
from meshd.runtime.adapters import adapter_for
from meshd.runtime.loader import SafetensorsIndex, load_config
from meshd.runtime.manifest import CHUNK_BYTES, Manifest, TensorEntry, tensor_digest, verify_tensor, weights_manifest
from meshd.runtime.model_info import describe_fetched, describe_model
from meshd.runtime.numerics import Numerics, numerics_from_name
from meshd.runtime.shard import Shard, range_tensors
from meshd.weights.fetch import FetchStats, SourceFailed, WeightsUnavailable, assemble, fetch_chunks, seed_from
from meshd.weights.source import BadManifest, WeightsRefused, WeightsSource, manifest_from_message, manifest_message
from meshd.wire import rpc_pb2 as pb


def entry_of(name: str, raw: bytes) -> TensorEntry:
    digest, chunks = tensor_digest(raw)
    return TensorEntry(name, "U8", (len(raw),), digest, len(raw), chunks)


@pytest.fixture
def tensors() -> dict[str, bytes]:
    """Three tensors: one of several chunks with a short last one, one of exactly one, one tiny."""
    rng = torch.Generator().manual_seed(7)
    sizes = {"a": 2 * CHUNK_BYTES + 12345, "b": CHUNK_BYTES, "c": 100}
    return {n: bytes(torch.randint(0, 256, (size,), generator=rng, dtype=torch.uint8).tolist()) for n, size in
            sizes.items()}


class Sources:
    """In-memory sources: honest ones serve the bytes, ``liars`` flip one, ``lacking`` lack some tensors,
    ``fail_after`` fail after some chunks."""

    def __init__(self, tensors: dict[str, bytes], liars: frozenset[str] = frozenset(),
                 lacking: dict[str, set[str]] | None = None, fail_after: dict[str, int] | None = None) -> None:
        self.tensors = tensors
        self.liars = liars
        self.lacking = lacking or {}
        self.fail_after = fail_after or {}
        self.asked: list[tuple[str, str, int]] = []

    async def ask(self, source: str, entry: TensorEntry, index: int) -> bytes:
        self.asked.append((source, entry.name, index))
        if entry.name in self.lacking.get(source, set()):
            raise SourceFailed("not held", lacks=True)
        if source in self.fail_after:
            if self.fail_after[source] <= 0:
                raise SourceFailed("unreachable")
            self.fail_after[source] -= 1
        offset, length = entry.chunk_span(index)
        data = bytearray(self.tensors[entry.name][offset : offset + length])
        if source in self.liars:
            data[-1] ^= 1
        return bytes(data)


def read_store(model_dir: Path) -> dict[str, bytes]:
    index = SafetensorsIndex(model_dir)
    out = {}
    for name in index.files:
        path, start, nbytes = index.location(name)
        with path.open("rb") as f:
            f.seek(start)
            out[name] = f.read(nbytes)
    return out


def test_a_tensor_digest_is_the_hash_of_its_chunk_hashes(tensors):
    raw = tensors["a"]
    digest, chunks = tensor_digest(raw)
    assert len(chunks) == 3
    assert chunks[2] == hashlib.sha256(raw[2 * CHUNK_BYTES:]).hexdigest()
    assert digest == hashlib.sha256(b"".join(bytes.fromhex(c) for c in chunks)).hexdigest()
    verify_tensor(entry_of("a", raw), raw)
    with pytest.raises(ModelFormatError, match="does not match"):
        verify_tensor(entry_of("a", raw), raw[:-1] + b"\0")


def test_the_manifest_of_a_file_lists_the_chunks_it_hashed(tiny_model):
    manifest = weights_manifest(sorted(tiny_model.glob("*.safetensors")))
    index = SafetensorsIndex(tiny_model)
    for name, entry in manifest.tensors.items():
        path, start, nbytes = index.location(name)
        with path.open("rb") as f:
            f.seek(start)
            assert tensor_digest(f.read(nbytes)) == (entry.digest, entry.chunks)


def test_a_manifest_on_the_wire_must_be_the_one_the_digest_commits_to(tensors):
    manifest = Manifest({n: entry_of(n, raw) for n, raw in tensors.items()})
    message = manifest_message(manifest)
    assert manifest_from_message(message, manifest.digest) == manifest
    with pytest.raises(BadManifest, match="commits to"):
        manifest_from_message(message, "0" * 64)
    forged = pb.WeightsManifest()
    forged.CopyFrom(message)
    forged.tensors[0].chunks[0] = b"\1" * 32  # a chunk hash that lets a liar's chunk pass
    with pytest.raises(BadManifest, match="commits to"):
        manifest_from_message(forged, manifest.digest)
    short = pb.WeightsManifest()
    short.CopyFrom(message)
    del short.tensors[0].chunks[-1]
    with pytest.raises(BadManifest, match="chunk hashes"):
        manifest_from_message(short, manifest.digest)


async def test_chunks_come_from_every_source_and_a_liar_is_dropped(tensors, tmp_path):
    entries = [entry_of(n, raw) for n, raw in tensors.items()]
    sources = Sources(tensors, liars={"liar"})
    stats = await fetch_chunks(entries, ["honest1", "honest2", "liar"], sources.ask, tmp_path / "staging")
    assert set(stats.dropped) == {"liar"} and "does not match the manifest" in stats.dropped["liar"]
    assert stats.bytes_fetched == stats.bytes_needed == sum(len(r) for r in tensors.values())
    assert stats.bytes_discarded > 0
    assert set(stats.by_source) == {"honest1", "honest2"}, "both honest sources were used"
    assert sum(1 for s, _, _ in sources.asked if s == "liar") == 1, "the liar was asked once, then never again"
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assemble(tmp_path / "staging", entries, model_dir)
    assert read_store(model_dir) == tensors
    assert not (tmp_path / "staging").exists()


async def test_a_source_that_lacks_a_tensor_is_asked_for_the_others(tensors, tmp_path):
    entries = [entry_of(n, raw) for n, raw in tensors.items()]
    sources = Sources(tensors, lacking={"partial": {"a"}})
    stats = await fetch_chunks(entries, ["full", "partial"], sources.ask, tmp_path / "staging")
    assert not stats.dropped and stats.bytes_fetched == stats.bytes_needed
    assert sum(1 for s, name, _ in sources.asked if (s, name) == ("partial", "a")) <= 2, \
        "once it said it lacks the tensor, it is not asked for it again (beyond asks already in flight)"


async def test_a_stopped_fetch_resumes_with_only_the_missing_chunks(tensors, tmp_path):
    entries = [entry_of(n, raw) for n, raw in tensors.items()]
    total = sum(len(e.chunks) for e in entries)
    staging = tmp_path / "staging"
    vanishing = Sources(tensors, fail_after={"only": 2})
    stats = FetchStats()
    with pytest.raises(WeightsUnavailable, match="kept for the next try"):
        await fetch_chunks(entries, ["only"], vanishing.ask, staging, stats=stats, workers_per_source=1)
    assert "failed 3 times" in stats.dropped["only"] and stats.bytes_fetched > 0
    # a half-written chunk on disk (a crash mid-write) is found by its hash and fetched again
    first = sorted(staging.iterdir())[0]
    with first.open("r+b") as f:
        f.write(b"\0\0\0")
    again = Sources(tensors)
    resumed = await fetch_chunks(entries, ["other"], again.ask, staging)
    assert 0 < len(again.asked) < total
    assert resumed.bytes_on_disk + resumed.bytes_fetched == resumed.bytes_needed
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assemble(staging, entries, model_dir)
    assert read_store(model_dir) == tensors
    # a later fetch of a range that shares tensors with what is stored takes them from the store
    seed_from(model_dir, tmp_path / "next", entries[:2])
    none_asked = Sources(tensors)
    stats = await fetch_chunks(entries[:2], ["other"], none_asked.ask, tmp_path / "next")
    assert none_asked.asked == [] and stats.bytes_on_disk == stats.bytes_needed


async def test_when_every_source_lies_the_fetch_fails_and_says_why(tensors, tmp_path):
    entries = [entry_of(n, raw) for n, raw in tensors.items()]
    with pytest.raises(WeightsUnavailable, match="does not match the manifest"):
        await fetch_chunks(entries, ["liar"], Sources(tensors, liars={"liar"}).ask, tmp_path / "staging")


def test_a_range_reads_its_layers_and_the_ends_it_touches(tiny_model):
    config = load_config(tiny_model)
    adapter = adapter_for(config)
    names = list(SafetensorsIndex(tiny_model).files)
    assert range_tensors(adapter, config, names, 1, 3) == sorted(n for n in names if n.startswith(
        (adapter.layer_tensor_prefix(1), adapter.layer_tensor_prefix(2))))
    head = range_tensors(adapter, config, names, 0, 1)
    assert adapter.embed_tensor in head and adapter.lm_head_tensor not in head
    tail = range_tensors(adapter, config, names, 3, 4)
    assert {adapter.norm_tensor, adapter.lm_head_tensor} <= set(tail) and adapter.embed_tensor not in tail
    tied = [n for n in names if n != adapter.lm_head_tensor]  # no head tensor: the embedding is the head
    assert adapter.embed_tensor in range_tensors(adapter, config, tied, 3, 4)


def test_a_directory_of_fetched_tensors_loads_the_range_and_keeps_the_compat_key(tiny_model, tmp_path):
    info = describe_model(tiny_model)
    config = load_config(tiny_model)
    names = range_tensors(adapter_for(config), config, info.manifest.tensors, 2, 4)
    entries = [info.manifest.tensors[n] for n in names]
    store = read_store(tiny_model)
    staging, fetched = tmp_path / "staging", tmp_path / "fetched"
    fetched.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        if (tiny_model / name).is_file():
            shutil.copy(tiny_model / name, fetched / name)
    seed_from(tiny_model, staging, entries)
    assemble(staging, entries, fetched)
    assert sorted(read_store(fetched)) == names and all(read_store(fetched)[n] == store[n] for n in names)
    again = describe_fetched(fetched, info.model_id, info.manifest, info.numerics)
    assert (again.compat_key, again.layer_bytes, again.edge_bytes) == (info.compat_key, info.layer_bytes,
                                                                         info.edge_bytes)
    shard = Shard(fetched, 2, 4, manifest=info.manifest)
    whole = Shard(tiny_model, 2, 4)
    for (name, a), (_, b) in zip(shard.weight_tensors(), whole.weight_tensors(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ModelFormatError):
        Shard(fetched, 0, 2, manifest=info.manifest)  # layers it never fetched


def test_a_source_refuses_damaged_and_unheld_tensors(tiny_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    info = describe_model(copy)
    source = WeightsSource()
    source.offer(info)
    name = sorted(info.manifest.tensors)[0]
    entry = info.manifest.tensors[name]
    assert hashlib.sha256(source.read_chunk(copy, entry, 0)).hexdigest() == entry.chunks[0]
    path, start, _ = SafetensorsIndex(copy).location(name)
    with path.open("r+b") as f:
        f.seek(start)
        byte = f.read(1)
        f.seek(start)
        f.write(bytes([byte[0] ^ 1]))
    fresh = WeightsSource()
    fresh.offer(info)
    with pytest.raises(WeightsRefused, match="damaged"):
        fresh.read_chunk(copy, entry, 0)
    with pytest.raises(WeightsRefused, match="no weights"):
        fresh._model("another-key")


def test_numerics_classes_are_read_back_from_their_names():
    for numerics in (Numerics(), Numerics(torch.bfloat16, "cpu", prefill_fp32=True, decode_rows=8),
                     Numerics(torch.float16, "cuda:0", decode_fp32=True, decode_rows=8, weights="gguf-q8_0")):
        assert numerics_from_name(numerics.name, numerics.device) == numerics
    with pytest.raises(ValueError, match="this peer's device is cpu"):
        numerics_from_name("cuda/float32/prefill-native/decode-native-rows8", "cpu")
    with pytest.raises(ValueError, match="shared as its file"):
        numerics_from_name("llama.cpp/cpu/gguf-q8_0", "cpu")
    with pytest.raises(ValueError, match="cannot run here"):
        numerics_from_name("cpu/int3/prefill-native/decode-native-rows1", "cpu")


async def test_bad_weight_requests_get_a_clear_refusal_and_good_ones_still_work(tiny_model):
    from meshd.errors import ErrorCode
    from meshd.rpc import RpcRouter

    info = describe_model(tiny_model)
    source = WeightsSource()
    router = RpcRouter()
    router.register("manifest", source.serve_manifest)
    router.register("chunk", source.serve_chunk)
    name = sorted(info.manifest.tensors)[0]
    ask = pb.PeerRequest(chunk=pb.ChunkRequest(compat_key=info.compat_key, tensor=name, index=0))
    reply = await router.dispatch("someone", ask)
    assert reply.error.code == ErrorCode.UNKNOWN_MODEL, "a peer that holds nothing refuses"
    source.offer(info)
    for bad in (pb.ChunkRequest(compat_key="other", tensor=name), pb.ChunkRequest(compat_key=info.compat_key,
                tensor="no.such.tensor"), pb.ChunkRequest(compat_key=info.compat_key, tensor=name, index=99)):
        reply = await router.dispatch("someone", pb.PeerRequest(chunk=bad))
        assert reply.WhichOneof("body") == "error" and reply.error.code == ErrorCode.UNKNOWN_MODEL, bad
    wrong_model = pb.PeerRequest(manifest=pb.ManifestRequest(model_id="other", compat_key=info.compat_key))
    assert (await router.dispatch("someone", wrong_model)).WhichOneof("body") == "error"
    good = await router.dispatch("someone", ask)
    assert hashlib.sha256(good.chunk.data).hexdigest() == info.manifest.tensors[name].chunks[0]
    manifest = await router.dispatch("someone", pb.PeerRequest(manifest=pb.ManifestRequest(
        model_id=info.model_id, compat_key=info.compat_key)))
    assert manifest_from_message(manifest.manifest, info.weights_digest) == info.manifest


def test_a_manifest_whose_sizes_do_not_follow_from_its_shapes_is_refused(tensors):
    """The digest covers names, dtypes, shapes and chunk hashes, not sizes: a size a few bytes off
    would have made every honest source look like a liar (its last chunk "too long")."""
    entries = {n: TensorEntry(n, "U8", (len(raw),), *tensor_digest(raw)[:1], len(raw), tensor_digest(raw)[1])
               for n, raw in tensors.items()}
    manifest = Manifest(entries)
    message = manifest_message(manifest)
    message.tensors[0].nbytes -= 3
    with pytest.raises(BadManifest, match="claims"):
        manifest_from_message(message, manifest.digest)
    message = manifest_message(manifest)
    message.tensors[0].dtype = "Q8_0"
    with pytest.raises(BadManifest):
        manifest_from_message(message, manifest.digest)


async def test_a_worker_waits_for_chunks_in_flight_elsewhere_before_giving_up(tensors, tmp_path):
    """A holds only one tensor, B everything but keeps failing: B's chunks come back to the queue
    after A's workers found nothing left for them, and A must still be there to take them."""
    entries = [entry_of(n, raw) for n, raw in tensors.items()]
    names = [e.name for e in entries]
    sources = Sources(tensors, lacking={"a-only": set(names[1:]), "full": set()}, fail_after={"flaky": 0})
    # "flaky" holds everything but never answers; "a-only" holds the first tensor; "full" holds the rest
    sources.lacking["full"] = {names[0]}
    stats = await fetch_chunks(entries, ["a-only", "flaky", "full"], sources.ask, tmp_path / "staging")
    assert stats.bytes_fetched == stats.bytes_needed and list(stats.dropped) == ["flaky"]


def test_loaded_tensors_start_on_a_cache_line_and_keep_their_values(tmp_path):
    from safetensors.torch import save_file

    from meshd.runtime.loader import ALIGNMENT

    model_dir = tmp_path / "odd"
    model_dir.mkdir()
    stored = {"a": torch.arange(7, dtype=torch.float32), "b": torch.randn(3, 5).to(torch.bfloat16),
              "c": torch.arange(5, dtype=torch.int64), "d": torch.randn(33, 17), "e": torch.tensor(2.5),
              "f": torch.zeros(0, 4)}
    save_file(stored, model_dir / "model.safetensors")
    index = SafetensorsIndex(model_dir)
    for name, original in stored.items():
        loaded = index.load([name], original.dtype)[name]
        assert loaded.dtype == original.dtype and loaded.shape == original.shape and torch.equal(loaded, original)
        assert loaded.numel() == 0 or loaded.data_ptr() % ALIGNMENT == 0, name
    upcast = index.load(["b"], torch.float32)["b"]
    assert torch.equal(upcast, stored["b"].float()) and upcast.data_ptr() % ALIGNMENT == 0


def test_every_weight_of_a_shard_starts_on_a_cache_line(tiny_model):
    from meshd.runtime.loader import ALIGNMENT

    info = describe_model(tiny_model)
    for shard in (Shard(tiny_model, 0, 4), Shard(tiny_model, 1, 3, manifest=info.manifest)):
        misplaced = [name for name, w in shard.weight_tensors() if w.data_ptr() % ALIGNMENT]
        assert not misplaced


def test_weights_off_a_cache_line_are_moved_onto_one_and_ties_kept():
    from meshd.runtime.loader import ALIGNMENT, aligned_weights

    backing = torch.randn(4 + 6 * 8 + 8)  # the first tensor starts 16 bytes into a 64-byte aligned block
    first = torch.nn.Linear(8, 6, bias=False)
    first.weight = torch.nn.Parameter(backing[4:52].view(6, 8), requires_grad=False)
    second = torch.nn.Linear(8, 6, bias=False)
    second.weight = first.weight  # tied, as an LM head to its embedding
    model = torch.nn.Sequential(first, second)
    model.register_buffer("scale", backing[5:9])
    assert first.weight.data_ptr() % ALIGNMENT and model.scale.data_ptr() % ALIGNMENT
    values = (first.weight.detach().clone(), model.scale.clone())
    assert aligned_weights(model) == 2
    assert first.weight.data_ptr() % ALIGNMENT == 0 and model.scale.data_ptr() % ALIGNMENT == 0
    assert second.weight is first.weight
    assert torch.equal(first.weight, values[0]) and torch.equal(model.scale, values[1])
    assert aligned_weights(model) == 0
