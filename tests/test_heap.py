"""A daemon freezes its long-lived heap after a load, so that full collections stay short, and thaws it
when a shard is dropped, so that nothing the old shard left in reference cycles is kept for good."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from meshd.runtime import heap
from meshd.runtime.host import ShardHost


class Node:
    """An object the collector tracks, which can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def managed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(heap, "_managed", True)
    yield
    gc.unfreeze()


def _young(obj: object) -> bool:
    """Whether a full collection visits ``obj`` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


def test_a_process_that_does_not_manage_its_heap_keeps_the_collector_as_it_is(monkeypatch):
    monkeypatch.setattr(heap, "_managed", False)
    frozen = gc.get_freeze_count()
    heap.settle()
    heap.thaw()
    assert gc.get_freeze_count() == frozen


def test_settling_collects_garbage_and_freezes_what_survives(managed):
    kept, dropped = Node(), Node()
    dropped.other = dropped
    gone = weakref.ref(dropped)
    del dropped
    assert _young(kept)
    heap.settle()
    assert gone() is None  # garbage is collected before the freeze, not frozen with the rest
    assert gc.get_freeze_count() > 0 and not _young(kept)
    later = Node()
    assert _young(later)  # what is allocated after the freeze is collected as usual


def test_a_cycle_frozen_with_a_shard_is_collected_once_the_shard_is_dropped(managed):
    node = Node()
    node.other = Node()
    node.other.other = node
    ref = weakref.ref(node)
    heap.settle()
    del node
    gc.collect()
    assert ref() is not None  # frozen: no pass visits it
    heap.thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


async def test_a_host_freezes_after_loading_and_thaws_when_closed(managed, tiny_model):
    host = ShardHost(tiny_model)
    await host.load(0, 4)
    assert host.shard is not None
    assert gc.get_freeze_count() > 0 and not _young(host.shard)
    host.close()
    assert gc.get_freeze_count() == 0 and _young(host.shard)
