"""A session's KV cache: appends write into spare room instead of copying the history, and what a
kept prefix holds never changes, whatever the session that shared it does next."""

from __future__ import annotations

import pytest
import torch

from meshd.errors import KVBudgetExceeded
from meshd.runtime.kv import KVManager, room_for
from meshd.wire.bundle import Sampling

HEADS, DIM = 2, 4


def _states(start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values for positions ``[start, start + n)`` of one layer, each position its own numbers."""
    positions = torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1)
    keys = positions + torch.arange(HEADS * DIM, dtype=torch.float32).view(1, HEADS, 1, DIM) / 100
    return keys, -keys


def test_appends_fill_the_room_of_one_buffer_and_grow_it_when_full():
    kv = KVManager()
    session = kv.open(("s", 0), Sampling())
    session.update(*_states(0, 10), 0)
    keys, values = session.update(*_states(10, 1), 0)
    buffer = keys.untyped_storage().data_ptr()
    assert session.nbytes == 2 * room_for(11) * HEADS * DIM * 4, "the spare room is accounted"
    for position in range(11, room_for(11)):
        keys, values = session.update(*_states(position, 1), 0)
        assert keys.untyped_storage().data_ptr() == buffer, "an append within the room copied the history"
    assert keys.shape[-2] == room_for(11)
    keys, values = session.update(*_states(room_for(11), 3), 0)
    assert keys.untyped_storage().data_ptr() != buffer and keys.shape[-2] == room_for(11) + 3
    whole = _states(0, room_for(11) + 3)
    assert torch.equal(keys, whole[0]) and torch.equal(values, whole[1])
    assert torch.equal(session.keys[0], whole[0])


def test_a_truncated_session_rewrites_its_dropped_positions_in_place():
    kv = KVManager()
    session = kv.open(("s", 0), Sampling())
    session.update(*_states(0, 10), 0)
    session.update(*_states(10, 3), 0)  # a step with drafted positions
    session.length = 13
    session.truncate(11)  # two drafts rejected
    assert session.keys[0].shape[-2] == 11
    keys, values = session.update(*_states(100, 2), 0)
    expected = torch.cat([_states(0, 11)[0], _states(100, 2)[0]], dim=-2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    session.truncate(0)
    assert session.nbytes == 0 and not session.keys and not session.room


def test_a_kept_prefix_never_changes_while_the_session_that_shared_it_goes_on():
    kv = KVManager()
    key = ("s", 0)
    session = kv.open(key, Sampling())
    session.update(*_states(0, 8), 0)
    session.length = 8
    assert kv.keep_prefix(b"chunk", key)  # shares the chunk's own tensors
    for position in range(8, room_for(9)):  # fill the room exactly, so a snapshot shares the buffer too
        session.update(*_states(position, 1), 0)
    session.length = room_for(9)
    assert kv.keep_prefix(b"full", key)
    chunk, full = kv.prefixes.peek(b"chunk"), kv.prefixes.peek(b"full")
    assert chunk is not None and full is not None
    assert full.keys[0].untyped_storage().data_ptr() == session.keys[0].untyped_storage().data_ptr()
    kept = {name: (snapshot.keys[0].clone(), snapshot.values[0].clone())
            for name, snapshot in ((b"chunk", chunk), (b"full", full))}

    session.truncate(6)  # inside both snapshots
    session.update(*_states(200, 4), 0)
    session.length = 10
    session.update(*_states(300, 1), 0)
    assert torch.equal(session.keys[0][..., 6:, :], torch.cat([_states(200, 4)[0], _states(300, 1)[0]], dim=-2))
    for name, snapshot in ((b"chunk", chunk), (b"full", full)):
        assert torch.equal(snapshot.keys[0], kept[name][0]) and torch.equal(snapshot.values[0], kept[name][1])

    other = kv.open(("t", 0), Sampling(), prefix=full)  # a session started from the snapshot
    other.update(*_states(500, 1), 0)
    assert torch.equal(full.keys[0], kept[b"full"][0]), "a session started from a snapshot wrote into it"
    assert torch.equal(other.keys[0][..., : full.length, :], kept[b"full"][0])


def test_spare_room_never_reaches_past_the_kv_budget():
    budget = 20 * 2 * HEADS * DIM * 4  # twenty positions of the one layer
    kv = KVManager(budget_bytes=budget)
    key = ("s", 0)
    session = kv.open(key, Sampling())
    session.update(*_states(0, 8), 0)
    for position in range(8, 20):
        session.length = position
        kv.commit(key)
        session.update(*_states(position, 1), 0)
        assert session.nbytes <= budget, "the room alone would have pushed the session out"
    session.length = 20
    kv.commit(key)
    session.update(*_states(20, 1), 0)
    session.length = 21
    with pytest.raises(KVBudgetExceeded):
        kv.commit(key)
    assert key not in kv


def test_a_snapshot_that_copied_the_cache_leaves_the_session_its_room():
    kv = KVManager()
    key = ("s", 0)
    session = kv.open(key, Sampling())
    session.update(*_states(0, 8), 0)
    session.update(*_states(8, 2), 0)  # a buffer of room_for(10) positions, two of them spare at least
    session.length = 10
    held = session.nbytes
    assert kv.keep_prefix(b"p", key)
    snapshot = kv.prefixes.peek(b"p")
    assert snapshot is not None and snapshot.nbytes == 2 * 10 * HEADS * DIM * 4, "the snapshot keeps a copy"
    buffer = session.keys[0].untyped_storage().data_ptr()
    keys, _ = session.update(*_states(10, 1), 0)
    assert keys.untyped_storage().data_ptr() == buffer and session.nbytes == held
    assert torch.equal(snapshot.keys[0], _states(0, 10)[0])
