"""KV state of the sessions running through one shard.

Each session, keyed by ``(session_id, epoch)``, owns the attention keys and values of this shard's
layers only. The manager accounts the bytes of the tensors it actually holds, and evicts by idle TTL,
by least-recent use when the byte budget is exceeded (kept prefixes, :mod:`meshd.runtime.prefix_kv`,
go first), and on request. A session that is gone is
remembered (boundedly) with the reason, so a late step gets an explicit cache miss that says why.
The manager's bookkeeping is guarded by a lock: steps run on the shard's compute thread while
sessions are released from the event loop.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshd.errors import CacheMiss, KVBudgetExceeded
from meshd.runtime.prefix_kv import DEFAULT_PREFIX_BYTES, PrefixSnapshot, PrefixStore
from meshd.wire.bundle import Sampling

SessionKey = tuple[str, int]

_GONE_MEMORY = 4096


def room_for(positions: int) -> int:
    """Positions a grown cache buffer holds: the ones needed and about an eighth more (at least 32), so
    that a decoding session copies its history about once every eighth of its length, not every step."""
    return positions + max(32, positions // 8)


@dataclass
class SessionKV:
    """One session's attention cache for this shard's layers.

    It is handed to the transformers attention modules as their cache: ``update`` appends the new
    keys and values of one layer and returns the whole history of that layer. ``keys`` and ``values``
    hold each layer's history as exactly ``length`` positions. A decode step writes its position into
    spare room of a buffer the session owns (``room``), so it does not copy the whole history per
    layer as a concatenation would (at 2000 tokens that copying was about a fifth of a decode step); a
    buffer is grown by about an eighth when full, never past what the shard's KV budget holds, and
    ``nbytes`` counts the spare room. Tensors the session does not own (a kept prefix's,
    which it shares) are never written: the first append copies them into a buffer of its own.
    """

    key: SessionKey
    sampling: Sampling
    length: int = 0
    confirmed: int = 0  # tokens certainly accepted; the next step may drop drafted positions past them
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    last_used: float = 0.0
    room: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    budget_bytes: int | None = None  # the shard's KV budget: spare room never reaches past what it holds

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_args: object,
               **_kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.keys.get(layer_idx)
        if held is None:  # the first chunk: kept as it is, without spare room
            self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
            return key_states, value_states
        start, end = held.shape[-2], held.shape[-2] + key_states.shape[-2]
        room = self.room.get(layer_idx)
        if room is None or room[0].shape[-2] < end:
            positions = room_for(end)
            if self.budget_bytes is not None:  # about what one position of every layer takes
                per_position = 2 * key_states[..., :1, :].numel() * key_states.element_size() * len(self.keys)
                positions = max(end, min(positions, self.budget_bytes // per_position))
            shape = (*key_states.shape[:-2], positions, key_states.shape[-1])
            room = (key_states.new_empty(shape), value_states.new_empty(shape))
            room[0][..., :start, :] = held
            room[1][..., :start, :] = self.values[layer_idx]
            self.room[layer_idx] = room
        room[0][..., start:end, :] = key_states
        room[1][..., start:end, :] = value_states
        self.keys[layer_idx], self.values[layer_idx] = room[0][..., :end, :], room[1][..., :end, :]
        return self.keys[layer_idx], self.values[layer_idx]

    def shared_with(self, snapshot: PrefixSnapshot) -> None:
        """``snapshot`` was taken of these caches: the session stops writing into the buffers it shares
        (a buffer that was exactly full), so what the snapshot holds never changes."""
        kept = {t.untyped_storage().data_ptr() for t in (*snapshot.keys.values(), *snapshot.values.values())}
        for layer, pair in list(self.room.items()):
            if any(t.untyped_storage().data_ptr() in kept for t in pair):
                del self.room[layer]

    def truncate(self, length: int) -> None:
        """Drop everything past ``length`` tokens (undoes a step that failed half-way)."""
        for store in (self.keys, self.values):
            for layer, tensor in list(store.items()):
                if length == 0:
                    del store[layer]
                elif tensor.shape[-2] > length:
                    store[layer] = tensor[..., :length, :]
        if length == 0:
            self.room.clear()
        self.length = length
        self.confirmed = min(self.confirmed, length)

    @property
    def nbytes(self) -> int:
        """The bytes this session's caches hold, spare room included."""
        held = [t for layer, t in (*self.keys.items(), *self.values.items()) if layer not in self.room]
        held += [t for pair in self.room.values() for t in pair]
        return sum(t.numel() * t.element_size() for t in held)


class KVManager:
    def __init__(
        self,
        budget_bytes: int | None = None,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        new_session: Callable[[SessionKey, Sampling, float], SessionKV] | None = None,
        on_forget: Callable[[SessionKV], None] | None = None,
        prefix_bytes: int = DEFAULT_PREFIX_BYTES,
    ) -> None:
        """``new_session`` and ``on_forget`` let an engine that keeps KV outside these tensors (llama.cpp's
        sequences) hand out its own sessions and learn when one is gone; ``prefix_bytes`` bounds the
        kept prefixes (0: none are kept)."""
        self.budget_bytes = budget_bytes
        self.prefixes = PrefixStore(prefix_bytes)
        self.ttl_s = ttl_s
        self._clock = clock
        self._new_session = new_session or (lambda key, sampling, now: SessionKV(key=key, sampling=sampling,
                                                                                 last_used=now))
        self._on_forget = on_forget
        self._sessions: OrderedDict[SessionKey, SessionKV] = OrderedDict()
        self._bytes: dict[SessionKey, int] = {}
        self._gone: OrderedDict[SessionKey, str] = OrderedDict()
        self._lock = threading.RLock()

    def with_sessions(self, new_session: Callable[[SessionKey, Sampling, float], SessionKV],
                      on_forget: Callable[[SessionKV], None]) -> KVManager:
        """An empty manager with the same budget, TTL and clock, handing out ``new_session``'s sessions
        (whose KV is not in tensors of ours, so no prefix of them is kept)."""
        return KVManager(self.budget_bytes, self.ttl_s, self._clock, new_session, on_forget, prefix_bytes=0)

    # -- queries ---------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._bytes.values())

    @property
    def free_bytes(self) -> int | None:
        return None if self.budget_bytes is None else max(0, self.budget_bytes - self.used_bytes)

    def __contains__(self, key: SessionKey) -> bool:
        return key in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def keys(self) -> list[SessionKey]:
        with self._lock:
            return list(self._sessions)

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self, key: SessionKey, sampling: Sampling, prefix: PrefixSnapshot | None = None) -> SessionKV:
        """A new session, empty or holding a kept ``prefix`` (whose tensors it shares, never writes)."""
        with self._lock:
            self.expire()
            if key in self._sessions:
                self._forget(key, "replaced")
            session = self._new_session(key, sampling, self._clock())
            session.budget_bytes = self.budget_bytes
            if prefix is not None:
                session.keys, session.values = dict(prefix.keys), dict(prefix.values)
                session.length = session.confirmed = prefix.length
            self._sessions[key] = session
            self._bytes[key] = 0
            self._gone.pop(key, None)
            return session

    def get(self, key: SessionKey) -> SessionKV:
        with self._lock:
            self.expire()
            session = self._sessions.get(key)
            if session is None:
                reason = self._gone.get(key, "unknown session")
                raise CacheMiss(key[0], key[1], reason)
            return session

    def commit(self, key: SessionKey) -> None:
        """Account a session after a step: refresh its bytes and recency, then enforce the budget."""
        with self._lock:
            session = self._sessions.get(key)
            if session is None:  # released while its step ran
                raise CacheMiss(key[0], key[1], self._gone.get(key, "unknown session"))
            session.last_used = self._clock()
            self._sessions.move_to_end(key)
            self._bytes[key] = session.nbytes
            if self.budget_bytes is None:
                return
            if self._bytes[key] > self.budget_bytes:
                self._forget(key, "evicted: session alone exceeds the KV budget")
                raise KVBudgetExceeded(
                    f"session {key[0]!r} needs {session.nbytes} KV bytes, budget is {self.budget_bytes}"
                )
            while self.used_bytes + self.prefixes.used_bytes > self.budget_bytes and self.prefixes.evict_oldest():
                pass
            while self.used_bytes > self.budget_bytes:
                oldest = next(iter(self._sessions))
                self._forget(oldest, "evicted: least recently used, KV budget full")

    def keep_prefix(self, name: bytes, key: SessionKey) -> bool:
        """Keep what session ``key`` holds now as the prefix ``name``, within the budgets."""
        with self._lock:
            session = self._sessions.get(key)
            if session is None or not session.length or self.prefixes.max_bytes == 0:
                return False
            snapshot = PrefixSnapshot.of(session.length, session.keys, session.values)
            session.shared_with(snapshot)
            return self.keep_snapshot(name, snapshot)

    def keep_snapshot(self, name: bytes, snapshot: PrefixSnapshot) -> bool:
        """Keep ``snapshot`` (computed here, or imported) as the prefix ``name``, within the budgets."""
        with self._lock:
            if self.prefixes.max_bytes == 0:
                return False
            if self.budget_bytes is not None and self.used_bytes + snapshot.nbytes > self.budget_bytes:
                return False  # running sessions come first
            if not self.prefixes.keep(name, snapshot):
                return False
            while (self.budget_bytes is not None and self.used_bytes + self.prefixes.used_bytes > self.budget_bytes
                   and self.prefixes.evict_oldest()):
                pass
            return self.prefixes.holds(name)

    def resume(self, old: SessionKey, new: SessionKey, length: int) -> int:
        """Carry a session's KV over to a new epoch, keeping its first ``length`` tokens (a repaired
        route whose upstream is unchanged); returns how many tokens were kept, 0 when it is gone."""
        with self._lock:
            session = self._sessions.get(old)
            if session is None or new in self._sessions:
                return 0
            keep = min(length, session.length)
            self._forget(old, f"resumed as epoch {new[1]}", dispose=False)
            session.truncate(keep)
            session.key = new
            session.last_used = self._clock()
            self._sessions[new] = session
            self._bytes[new] = session.nbytes
            self._gone.pop(new, None)
            return keep

    def release(self, key: SessionKey) -> bool:
        with self._lock:
            if key not in self._sessions:
                return False
            self._forget(key, "released")
            return True

    def expire(self) -> list[SessionKey]:
        with self._lock:
            now = self._clock()
            expired = [k for k, s in self._sessions.items() if now - s.last_used > self.ttl_s]
            for key in expired:
                self._forget(key, f"evicted: idle longer than {self.ttl_s:g}s")
            return expired

    def _forget(self, key: SessionKey, reason: str, dispose: bool = True) -> None:
        """Drop a session, remembering why (called with the lock held)."""
        session = self._sessions.pop(key, None)
        if session is not None and dispose and self._on_forget is not None:
            self._on_forget(session)
        self._bytes.pop(key, None)
        self._gone[key] = reason
        self._gone.move_to_end(key)
        while len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)
