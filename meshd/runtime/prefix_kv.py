"""Prefix KV: immutable snapshots of a hop's KV for token prefixes, that later sessions start from.

Chat clients resend the whole conversation every turn and agents resend one long system prompt; a
hop that kept the KV of such a prefix computes only what follows it. A snapshot is what a session's
cache held right after the prefill chunk that ended at the prefix: the same tensors where they hold
exactly the prefix, never written again (a session writes only into buffers of its own, and stops
writing into those it hands to a snapshot), so keeping one costs little, and a session started from
it shares it.

Reuse never changes a reply. The entry cuts every prompt into prefill chunks at the same places
(message boundaries and multiples of the chunk size), and a prefix ends at one of them: a session
that starts from a snapshot computes exactly the chunks, over exactly the cache values, that it would
have computed after prefilling the prefix itself (:mod:`meshd.session.prefixes`).

Names are the entry's keyed hashes of the prefix; the hop scopes each name by the entry and the
upstream peer that sent it (:func:`scoped_name`), so that one entry's names can never reach another's
snapshots. The store is bounded by its own byte budget, least recently used first out, and gives way
to running sessions when the shard's KV budget is full (:class:`meshd.runtime.kv.KVManager`).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

DEFAULT_PREFIX_BYTES = 1024**3
MAX_PROBED_PREFIXES = 64  # prefixes one probe may ask a hop about


def scoped_name(scope: bytes, name: bytes) -> bytes:
    """The store's key for ``name`` as sent under ``scope`` (who asked, through whom)."""
    return hashlib.sha256(len(scope).to_bytes(4, "big") + scope + name).digest()


def prefix_scope(entry_peer_id: str, upstream_peer_id: str) -> bytes:
    """The scope of names a hop receives from ``upstream_peer_id`` for sessions of ``entry_peer_id``."""
    return f"{entry_peer_id}\n{upstream_peer_id}".encode()


@dataclass(frozen=True)
class PrefixSnapshot:
    """The KV of the first ``length`` tokens on one shard's layers."""

    length: int
    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    nbytes: int

    @classmethod
    def of(cls, length: int, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor]) -> PrefixSnapshot:
        """A snapshot of these caches (each layer's tensor holding exactly ``length`` positions)."""
        kept_keys, kept_values = {k: _own(t) for k, t in keys.items()}, {k: _own(t) for k, t in values.items()}
        for tensor in (*kept_keys.values(), *kept_values.values()):
            if tensor.shape[-2] != length:
                raise ValueError(f"a cache of {tensor.shape[-2]} positions is not a prefix of {length}")
        nbytes = sum(t.numel() * t.element_size() for t in (*kept_keys.values(), *kept_values.values()))
        return cls(length, kept_keys, kept_values, nbytes)


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a copy when it is a view into a larger buffer (which it would keep alive)."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


class PrefixStore:
    """Snapshots by scoped name, at most ``max_bytes`` of them, least recently used evicted first.

    Guarded by a lock: snapshots are kept on the compute thread and looked up from the event loop.
    """

    def __init__(self, max_bytes: int = DEFAULT_PREFIX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("the prefix KV budget cannot be negative")
        self.max_bytes = max_bytes
        self._snapshots: OrderedDict[bytes, PrefixSnapshot] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.kept = 0
        self.evicted = 0
        self.reused_tokens = 0

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._snapshots)

    def holds(self, key: bytes, length: int | None = None) -> bool:
        """Whether a snapshot named ``key`` (of ``length`` tokens, when given) is kept."""
        snapshot = self._snapshots.get(key)
        return snapshot is not None and (length is None or snapshot.length == length)

    def keep(self, key: bytes, snapshot: PrefixSnapshot) -> bool:
        """Keep ``snapshot`` under ``key`` (replacing one of the same name); False when it alone is larger
        than the whole budget."""
        if snapshot.nbytes > self.max_bytes:
            return False
        with self._lock:
            old = self._snapshots.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._snapshots[key] = snapshot
            self._bytes += snapshot.nbytes
            self.kept += 1
            while self._bytes > self.max_bytes:
                self._evict_oldest()
        return True

    def get(self, key: bytes, length: int) -> PrefixSnapshot | None:
        """The snapshot of ``length`` tokens named ``key``, now the most recently used; None when not kept."""
        with self._lock:
            snapshot = self._snapshots.get(key)
            if snapshot is None or snapshot.length != length:
                self.misses += 1
                return None
            self._snapshots.move_to_end(key)
            self.hits += 1
            self.reused_tokens += length
            return snapshot

    def peek(self, key: bytes) -> PrefixSnapshot | None:
        """The snapshot named ``key``, without counting a use (to copy it elsewhere)."""
        return self._snapshots.get(key)

    def evict_oldest(self) -> bool:
        """Drop the least recently used snapshot (to make room for sessions); False when none is left."""
        with self._lock:
            return self._evict_oldest()

    def _evict_oldest(self) -> bool:
        if not self._snapshots:
            return False
        _key, snapshot = self._snapshots.popitem(last=False)
        self._bytes -= snapshot.nbytes
        self.evicted += 1
        return True

    def summary(self) -> dict[str, object]:
        return {"snapshots": len(self._snapshots), "bytes": self._bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "kept": self.kept, "evicted": self.evicted,
                "reused_tokens": self.reused_tokens}
