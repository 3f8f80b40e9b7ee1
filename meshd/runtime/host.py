"""The Trio side of a shard: loads it and runs its compute in a worker thread, one step at a time.

Model compute is blocking and holds the CPU, so it runs through ``trio.to_thread.run_sync`` under a
lock owned by this host; the event loop stays free for gossip, seams and the API meanwhile.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio

from meshd.runtime.shard import Shard, StepResult
from meshd.wire.bundle import HiddenStateBundle

log = logging.getLogger("meshd.runtime")


class ShardHost:
    def __init__(self, model_dir: Path, *, max_chunk_tokens: int = 512, kv_budget_bytes: int | None = None,
                 session_ttl_s: float = 600.0) -> None:
        self.model_dir = Path(model_dir)
        self.shard: Shard | None = None
        self._lock = trio.Lock()
        self._options = dict(max_chunk_tokens=max_chunk_tokens, kv_budget_bytes=kv_budget_bytes,
                             session_ttl_s=session_ttl_s)
        self.loaded = trio.Event()

    @property
    def range(self) -> tuple[int, int] | None:
        return None if self.shard is None else (self.shard.spec.start, self.shard.spec.end)

    async def load(self, start: int, end: int) -> None:
        """Load ``[start, end)`` (replacing nothing: a host loads one range for its lifetime)."""
        if self.shard is not None:
            raise RuntimeError(f"already holding layers {self.range}")
        log.info("loading layers [%d, %d) of %s", start, end, self.model_dir)
        shard = await trio.to_thread.run_sync(lambda: Shard(self.model_dir, start, end, **self._options))
        self.shard = shard
        self.loaded.set()
        log.info("loaded layers [%d, %d): %.1f MB of weights", start, end, shard.parameter_bytes() / 1e6)

    async def forward(self, bundle: HiddenStateBundle) -> StepResult:
        shard = self._require()
        async with self._lock:
            return await trio.to_thread.run_sync(shard.forward, bundle)

    def release(self, session_id: str, epoch: int) -> bool:
        return self.shard is not None and self.shard.release(session_id, epoch)

    @property
    def active_sessions(self) -> int:
        return 0 if self.shard is None else len(self.shard.kv)

    @property
    def kv_free_bytes(self) -> int:
        if self.shard is None or self.shard.kv.free_bytes is None:
            return 0
        return self.shard.kv.free_bytes

    def _require(self) -> Shard:
        if self.shard is None:
            raise RuntimeError("no layers loaded yet")
        return self.shard
