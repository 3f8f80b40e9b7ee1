"""A hop's side of the KV tier on Trio: publish the prefixes it keeps, import one it lost.

Tier peers are those whose cards lend memory (``kv_tier_bytes``). Each snapshot goes to ``REPLICAS``
of them, chosen by rendezvous hashing of its name, so that every hop finds a snapshot where its
publisher put it without asking anyone else, and a tier peer leaving moves only its own share.
Publishing runs in the background from a bounded queue (a full queue drops the snapshot: the tier is
a cache), encoding off the event loop, and only while this peer has had no session for ``IDLE_S``:
moving a snapshot costs CPU (TLS, framing) that a session's steps would wait for. Importing asks the
placed tier peers in turn, checks what comes back in full (:func:`~meshd.kvtier.snapshots.decode_snapshot`),
and gives up on the first sign of trouble with each: a hop that cannot import prefills, it never
waits long.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable

import trio

from meshd.kvtier.snapshots import Encoded, Expected, SnapshotRefused, check_expected, decode_snapshot
from meshd.rpc import RpcFailed, call
from meshd.runtime.prefix_kv import PrefixSnapshot
from meshd.tracker.view import MeshView
from meshd.transport.streams import StreamOpener
from meshd.wire import kv_tier_pb2 as kpb
from meshd.wire import rpc_pb2 as rpb

log = logging.getLogger("meshd.kvtier")

REPLICAS = 2
PUBLISH_QUEUE = 16
RPC_TIMEOUT_S = 5.0
IMPORT_TIMEOUT_S = 8.0  # all of one import, every tier peer tried included
IDLE_S = 0.5  # publishing waits until this peer has run no session for this long
IDLE_POLL_S = 0.1


def rendezvous(name: bytes, peers: Iterable[str], count: int) -> list[str]:
    """The ``count`` peers that rank highest for ``name`` (highest random weight), best first."""
    return sorted(peers, key=lambda p: hashlib.sha256(p.encode() + b"\0" + name).digest(), reverse=True)[:count]


class TierClient:
    def __init__(self, opener: StreamOpener, view: MeshView, replicas: int = REPLICAS,
                 idle: Callable[[], bool] = lambda: True) -> None:
        """``idle``: whether this peer runs no session now."""
        self.opener = opener
        self.idle = idle
        self.view = view
        self.replicas = replicas
        self._queue_in, self._queue = trio.open_memory_channel[Callable[[], Encoded | None]](PUBLISH_QUEUE)
        self.stats = {"published": 0, "publish_failed": 0, "dropped": 0, "imported": 0, "import_failed": 0,
                      "from_workers": 0, "from_workers_failed": 0}

    def tier_peers(self) -> list[str]:
        return [peer for peer, card in self.view.cards().items()
                if card.kv_tier_bytes > 0 and self.view.is_alive(peer) and self.view.address_of(peer)]

    def publish_soon(self, encode: Callable[[], Encoded | None]) -> None:
        """Queue a snapshot for the tier (``encode`` runs in a worker thread); dropped when the queue is full."""
        if not self.tier_peers():
            return
        try:
            self._queue_in.send_nowait(encode)
        except trio.WouldBlock:
            self.stats["dropped"] += 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for encode in self._queue:
            await self._until_idle()
            try:
                encoded = await trio.to_thread.run_sync(encode)
            except Exception:
                log.exception("a prefix snapshot could not be encoded for the KV tier")
                continue
            if encoded is not None:
                await self._publish(*encoded)

    async def _publish(self, snapshot: kpb.KVSnapshot, chunks: list[bytes]) -> None:
        for peer in rendezvous(snapshot.key, self.tier_peers(), self.replicas):
            address = self.view.address_of(peer)
            try:
                assert address is not None
                for index, data in enumerate(chunks):
                    await self._until_idle()
                    put = rpb.PeerRequest(kv_put=kpb.KVPut(snapshot=snapshot, index=index, data=data))
                    await call(self.opener, peer, address, put, timeout=RPC_TIMEOUT_S)
            except RpcFailed as exc:
                self.stats["publish_failed"] += 1
                log.info("KV tier %s did not take a prefix snapshot: %s", peer[:12], exc)
            else:
                self.stats["published"] += 1

    async def _until_idle(self) -> None:
        quiet_since = trio.current_time()
        while trio.current_time() - quiet_since < IDLE_S:
            await trio.sleep(IDLE_POLL_S)
            if not self.idle():
                quiet_since = trio.current_time()

    async def fetch(self, expected: Expected, trusted: frozenset[str]) -> PrefixSnapshot | None:
        """The snapshot ``expected`` names, from the first placed tier peer that has it intact; None
        when none does within ``IMPORT_TIMEOUT_S``."""
        with trio.move_on_after(IMPORT_TIMEOUT_S):
            for peer in rendezvous(expected.key, self.tier_peers(), self.replicas):
                try:
                    snapshot = await self._fetch_from(peer, expected, trusted)
                except (RpcFailed, SnapshotRefused) as exc:
                    self.stats["import_failed"] += 1
                    log.warning("KV tier %s: prefix of %d tokens not imported: %s", peer[:12], expected.length, exc)
                    continue
                if snapshot is not None:
                    self.stats["imported"] += 1
                    return snapshot
        return None

    async def fetch_from_worker(self, peer: str, expected: Expected, trusted: frozenset[str]) -> PrefixSnapshot | None:
        """The snapshot ``expected`` names from ``peer``, a prefill worker that keeps it (the same
        requests and checks as from the tier); None when it does not have it intact within ``IMPORT_TIMEOUT_S``."""
        snapshot: PrefixSnapshot | None = None
        with trio.move_on_after(IMPORT_TIMEOUT_S):
            try:
                snapshot = await self._fetch_from(peer, expected, trusted)
            except (RpcFailed, SnapshotRefused) as exc:
                log.warning("prefill worker %s: prefix of %d tokens not imported: %s", peer[:12], expected.length, exc)
        self.stats["from_workers" if snapshot is not None else "from_workers_failed"] += 1
        return snapshot

    async def _fetch_from(self, peer: str, expected: Expected, trusted: frozenset[str]) -> PrefixSnapshot | None:
        address = self.view.address_of(peer)
        if address is None:
            return None
        chunks: list[bytes] = []
        described: kpb.KVSnapshot | None = None
        index = 0
        while described is None or index < len(described.chunk_sha256):
            get = kpb.KVGet(key=expected.key, compat_key=expected.compat_key, range_start=expected.range_start,
                            range_end=expected.range_end, index=index)
            reply = await call(self.opener, peer, address, rpb.PeerRequest(kv_get=get), timeout=RPC_TIMEOUT_S)
            if reply.WhichOneof("body") == "kv_missing":
                return None
            if reply.WhichOneof("body") != "kv_chunk" or reply.kv_chunk.index != index:
                raise SnapshotRefused(f"the tier answered {reply.WhichOneof('body')} for chunk {index}")
            if described is None:
                described = reply.kv_chunk.snapshot
                check_expected(described, expected, trusted)
            elif reply.kv_chunk.snapshot != described:
                raise SnapshotRefused("the snapshot changed while it was fetched")
            chunks.append(reply.kv_chunk.data)
            index += 1
        return await trio.to_thread.run_sync(decode_snapshot, described, chunks, expected, trusted)
