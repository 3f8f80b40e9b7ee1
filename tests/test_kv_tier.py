"""The KV tier's pieces: a snapshot survives encoding exactly, any change to it is refused before it
becomes a tensor, the tier store keeps its bounds and takes only what a chunk's publisher signed, and
placement is stable."""

from __future__ import annotations

import hashlib

import pytest
import torch

from meshd.identity import Identity
from meshd.kvtier.client import rendezvous
from meshd.kvtier.snapshots import Expected, SnapshotRefused, decode_snapshot, encode_snapshot, signed_bytes
from meshd.kvtier.store import TierRefused, TierStore
from meshd.runtime.prefix_kv import PrefixSnapshot, scoped_name
from meshd.wire import kv_tier_pb2 as pb

HOP = Identity.generate()


def expected(length: int = 40, **changes) -> Expected:
    fields = dict(key=b"k" * 32, model_id="tiny", compat_key="c" * 16, numerics="cpu/float32/x", range_start=1,
                  range_end=3, length=length, kv_heads=2, head_dim=8, dtype=torch.float32)
    fields.update(changes)
    return Expected(**fields)  # type: ignore[arg-type]


def snapshot(length: int = 40) -> PrefixSnapshot:
    g = torch.Generator().manual_seed(length)
    return PrefixSnapshot.of(length, {i: torch.randn(1, 2, length, 8, generator=g) for i in (1, 2)},
                             {i: torch.randn(1, 2, length, 8, generator=g) for i in (1, 2)})


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr("meshd.kvtier.snapshots.CHUNK_BYTES", 512)


def test_a_snapshot_comes_back_bit_for_bit_in_several_chunks(small_chunks):
    original = snapshot()
    described, chunks = encode_snapshot(original, expected(), HOP)
    assert len(chunks) > 1
    back = decode_snapshot(described, chunks, expected(), frozenset({HOP.peer_id}))
    for layer in (1, 2):
        assert torch.equal(back.keys[layer], original.keys[layer])
        assert torch.equal(back.values[layer], original.values[layer])
    assert back.length == 40 and back.nbytes == original.nbytes


@pytest.mark.parametrize("tamper", ["chunk", "order", "missing", "signature", "length", "numerics", "publisher",
                                    "key"])
def test_a_changed_snapshot_is_refused(small_chunks, tamper):
    described, chunks = encode_snapshot(snapshot(), expected(), HOP)
    wanted, trusted = expected(), frozenset({HOP.peer_id})
    if tamper == "chunk":
        chunks[1] = bytes([chunks[1][0] ^ 1]) + chunks[1][1:]
    elif tamper == "order":
        chunks[0], chunks[1] = chunks[1], chunks[0]
    elif tamper == "missing":
        chunks = chunks[:-1]
    elif tamper == "signature":
        described.length = 41
    elif tamper == "length":
        wanted = expected(length=41)
    elif tamper == "numerics":
        wanted = expected(numerics="cpu/bfloat16/x")
    elif tamper == "publisher":
        trusted = frozenset({Identity.generate().peer_id})
    elif tamper == "key":
        wanted = expected(key=b"x" * 32)
    with pytest.raises(SnapshotRefused):
        decode_snapshot(described, chunks, wanted, trusted)


def test_a_cache_of_another_shape_is_not_published():
    with pytest.raises(ValueError, match="is not"):
        encode_snapshot(snapshot(), expected(head_dim=16), HOP)


def puts(described: pb.KVSnapshot, chunks: list[bytes]) -> list[pb.KVPut]:
    return [pb.KVPut(snapshot=described, index=i, data=c) for i, c in enumerate(chunks)]


def get(described: pb.KVSnapshot, index: int) -> pb.KVGet:
    return pb.KVGet(key=described.key, compat_key=described.compat_key, range_start=described.range_start,
                    range_end=described.range_end, index=index)


def test_the_tier_serves_a_snapshot_once_every_chunk_arrived_and_only_from_its_publisher(small_chunks):
    store = TierStore(1024 * 1024)
    described, chunks = encode_snapshot(snapshot(), expected(), HOP)
    with pytest.raises(TierRefused, match="only the hop"):
        store.put(Identity.generate().peer_id, puts(described, chunks)[0])
    for put in puts(described, chunks)[:-1]:
        store.put(HOP.peer_id, put)
    assert store.get(get(described, 0)) is None, "half a snapshot is not served"
    store.put(HOP.peer_id, puts(described, chunks)[-1])
    served = [store.get(get(described, i)) for i in range(len(chunks))]
    assert [c.data for c in served if c is not None] == chunks
    assert store.get(get(described, len(chunks))) is None
    bad = puts(described, chunks)[0]
    bad.data = b"junk"
    with pytest.raises(TierRefused, match="digest"):
        store.put(HOP.peer_id, bad)


def test_the_tier_keeps_its_bytes_and_evicts_the_least_recently_used():
    _described, first_chunks = encode_snapshot(snapshot(40), expected(key=b"a" * 32), HOP)
    size = sum(len(c) for c in first_chunks)
    store = TierStore(int(size * 2.5))
    named = []
    for name in (b"a", b"b", b"c"):
        described, chunks = encode_snapshot(snapshot(40), expected(key=name * 32), HOP)
        for put in puts(described, chunks):
            store.put(HOP.peer_id, put)
        named.append(described)
    assert store.used_bytes <= store.max_bytes and store.evicted == 1
    assert store.get(get(named[0], 0)) is None and store.get(get(named[2], 0)) is not None
    huge, huge_chunks = encode_snapshot(snapshot(400), expected(key=b"h" * 32, length=400), HOP)
    with pytest.raises(TierRefused, match="larger"):
        for put in puts(huge, huge_chunks):
            store.put(HOP.peer_id, put)


def test_stale_half_uploads_are_dropped(small_chunks):
    now = [0.0]
    store = TierStore(1024 * 1024, clock=lambda: now[0])
    described, chunks = encode_snapshot(snapshot(), expected(), HOP)
    store.put(HOP.peer_id, puts(described, chunks)[0])
    now[0] = 120.0
    other, other_chunks = encode_snapshot(snapshot(), expected(key=b"z" * 32), HOP)
    store.put(HOP.peer_id, puts(other, other_chunks)[0])
    assert store.summary()["pending"] == 1


def empty_snapshot(key: bytes, chunks: int = 1) -> pb.KVSnapshot:
    """A signed description of a one-position snapshot whose chunks are empty."""
    empty = hashlib.sha256(b"").digest()
    described = pb.KVSnapshot(key=key, model_id="m", compat_key="c", numerics="n", range_start=0, range_end=1,
                              length=1, kv_heads=1, head_dim=1, dtype="float32", raw_bytes=8, raw_sha256=b"x",
                              chunk_sha256=[empty] * chunks, publisher=HOP.peer_id, public_key=HOP.public_key)
    described.signature = HOP.sign(signed_bytes(described))
    return described


def test_snapshots_of_empty_chunks_cannot_be_kept_without_bound():
    """Each snapshot held costs its description and a fixed amount, not only its chunks' bytes: empty
    chunks no longer make snapshots free to keep, complete or pending."""
    store = TierStore(256 * 1024, clock=lambda: 0.0)
    for i in range(2000):
        store.put(HOP.peer_id, pb.KVPut(snapshot=empty_snapshot(i.to_bytes(4, "big")), index=0, data=b""))
    summary = store.summary()
    assert summary["evicted"] > 1500 and summary["snapshots"] < 256 and store.used_bytes <= store.max_bytes
    assert summary["bytes"] == store.used_bytes  # the running count agrees with what is held
    for i in range(2000):  # the first of two chunks: they stay pending, and past the bound are refused
        try:
            store.put(HOP.peer_id, pb.KVPut(snapshot=empty_snapshot(b"p" + i.to_bytes(4, "big"), 2), index=0,
                                            data=b""))
        except TierRefused as exc:
            assert "full of snapshots still being put" in str(exc)
            break
    else:
        raise AssertionError("pending snapshots were never refused")
    assert store.used_bytes <= store.max_bytes


def test_placement_is_stable_and_moves_only_a_leaving_peers_share():
    peers = [f"peer{i}" for i in range(8)]
    names = [bytes([i]) * 32 for i in range(200)]
    before = {n: rendezvous(n, peers, 2) for n in names}
    assert before == {n: rendezvous(n, list(reversed(peers)), 2) for n in names}
    after = {n: rendezvous(n, peers[:-1], 2) for n in names}
    moved = [n for n in names if before[n] != after[n]]
    assert moved and all("peer7" in before[n] for n in moved)


def test_an_imported_prefix_continues_to_the_logits_of_a_local_recompute(tiny_model):
    from meshd.runtime.chain import prefill_bundles
    from meshd.runtime.shard import Shard
    from meshd.session.prefixes import plan_prefixes
    from meshd.wire.bundle import Sampling

    prompt = torch.randint(3, 200, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    plan = plan_prefixes(prompt, [100], 64, b"k" * 32, messages=True)

    def run(shard: Shard, session: str, start: int) -> torch.Tensor:
        result = None
        for bundle in prefill_bundles(session, 0, prompt, plan.spans(start, 120), (0, 4), Sampling(),
                                      prefix=plan.names[100] if start else b"", keep={100: plan.names[100]}):
            result = shard.forward(bundle)
        assert result is not None and result.logits is not None
        return result.logits

    publisher, importer = Shard(tiny_model, 0, 4, keep_logits=True), Shard(tiny_model, 0, 4, keep_logits=True)
    whole = run(publisher, "whole", 0)
    kv_heads, head_dim = publisher.adapter.kv_heads_and_dim(publisher.config)
    wanted = Expected(key=scoped_name(b"", plan.names[100]), model_id="tiny", compat_key="c",
                      numerics=publisher.numerics.name, range_start=0, range_end=4, length=100, kv_heads=kv_heads,
                      head_dim=head_dim, dtype=torch.float32)
    key = scoped_name(b"", plan.names[100])  # as a shard keeps a prefix named outside any hop's scope
    kept = publisher.kv.prefixes.peek(key)
    assert kept is not None
    imported = decode_snapshot(*encode_snapshot(kept, wanted, HOP), wanted, frozenset({HOP.peer_id}))
    assert importer.kv.keep_snapshot(key, imported)
    assert torch.equal(run(importer, "continued", 100), whole), "an imported prefix changed the logits"
