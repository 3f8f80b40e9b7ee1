"""The daemon's capture writer: a request hands over what it saw and goes on; a task of its own
builds the record (hashes, redaction) and appends it in a worker thread.

Nothing here can slow or fail a request: :meth:`CaptureRecorder.submit` only puts the observation
on a bounded queue (a full queue drops it, counted and logged), and every error of building or
writing a record is logged and counted, never raised.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from meshd.api.backend import GenerationRequest
from meshd.capture.records import CaptureKey, CaptureKeyError, RequestObservation, build_record
from meshd.capture.store import CaptureStore, Retention, segment_files

log = logging.getLogger("meshd.capture")

QUEUE = 1024          # observations waiting to be written; beyond it new ones are dropped
PRUNE_EVERY_S = 60.0  # the age bound is applied this often even when nothing is written
CAPTURE_DIR = "capture"


class CaptureRecorder:
    """Records of the requests this peer answers as the entry, in ``mode`` (off, metadata, full)."""

    def __init__(self, data_dir: Path, mode: str, retention: Retention, entry_peer: str,
                 clock: Callable[[], float] = time.time) -> None:
        """``clock``: the wall clock, in seconds, that records are stamped and aged by."""
        self.data_dir = Path(data_dir)
        self.clock = clock
        self.directory = self.data_dir / CAPTURE_DIR
        self.mode = mode
        self.retention = retention
        self.entry_peer = entry_peer
        self.store: CaptureStore | None = None
        self.key: CaptureKey | None = None
        self.error = ""  # why capture is not running although asked for
        self.written = 0
        self.dropped = 0       # observations the full queue turned away
        self.write_errors = 0
        self._send, self._receive = trio.open_memory_channel[RequestObservation](QUEUE)

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and not self.error

    def submit(self, seen: RequestObservation) -> None:
        """Hand over one finished request; never blocks, never raises."""
        if not self.enabled:
            return
        try:
            self._send.send_nowait(seen)
        except trio.WouldBlock:
            self.dropped += 1
            if self.dropped == 1 or math.log2(self.dropped).is_integer():
                log.warning("capture: the writer is behind; %d records dropped so far", self.dropped)
        except Exception:  # a closed channel at shutdown, or anything else: the request goes on
            log.exception("capture: a record could not be queued")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the store and key (in a thread: the store reads its segments back), then write what
        comes; a store or key that cannot be opened turns capture off with the reason in the status."""
        if self.mode == "off":
            await self._age_earlier_records(task_status)
            return
        try:
            self.key, self.store = await trio.to_thread.run_sync(self._open)
        except (OSError, CaptureKeyError, ValueError) as exc:
            self.error = str(exc)
            log.error("capture is off: %s", exc)
            task_status.started()
            return
        log.info("capture (%s) of the requests answered here, in %s: up to %d records, %d bytes, %.0fs",
                 self.mode, self.directory, self.retention.max_records, self.retention.max_bytes,
                 self.retention.max_age_s)
        task_status.started()
        try:
            while True:
                batch: list[RequestObservation] = []
                with trio.move_on_after(PRUNE_EVERY_S):
                    batch.append(await self._receive.receive())
                while True:
                    try:
                        batch.append(self._receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                await trio.to_thread.run_sync(self._write, batch)
        finally:
            self._drain()

    async def _age_earlier_records(self, task_status: trio.TaskStatus[None]) -> None:
        """With capture off, records written while it was on stay readable (``meshctl replay``) and
        are still held to the retention bounds, pruned as often as when capture is on, until none is
        left: ``capture_max_age_s`` is how long a record is kept at most, whatever the mode now."""
        try:
            earlier = self.directory.is_dir() and bool(segment_files(self.directory))
            store = await trio.to_thread.run_sync(self._open_store) if earlier else None
        except (OSError, ValueError) as exc:
            log.error("capture is off, and the records kept from before cannot be pruned: %s", exc)
            store = None
        self.store = store
        task_status.started()
        if store is None:
            return
        if store.segments:
            log.info("capture is off; the %d records kept from before in %s age out within %.0fs",
                     store.records, self.directory, self.retention.max_age_s)
        try:
            while store.segments:
                await trio.sleep(PRUNE_EVERY_S)
                await trio.to_thread.run_sync(self._prune)
        finally:
            store.close()

    def _open(self) -> tuple[CaptureKey, CaptureStore]:
        key = CaptureKey.load_or_create(self.data_dir)
        return key, self._open_store()

    def _open_store(self) -> CaptureStore:
        return CaptureStore(self.directory, self.retention, clock=self.clock)

    def _write(self, batch: list[RequestObservation]) -> None:
        store, key = self.store, self.key
        assert store is not None and key is not None
        for seen in batch:
            try:
                record = build_record(seen, self.mode, key, self.entry_peer)
                if record is not None and store.append(record):
                    self.written += 1
            except Exception as exc:
                self.write_errors += 1
                if self.write_errors == 1 or math.log2(self.write_errors).is_integer():
                    log.error("capture: a record could not be written (%d so far): %s", self.write_errors, exc)
        self._prune()

    def _prune(self) -> None:
        assert self.store is not None
        try:
            self.store.prune()
        except OSError as exc:
            log.error("capture: retention could not drop old records: %s", exc)

    def _drain(self) -> None:
        """At shutdown: write what is still queued, here and now (the event loop is stopping anyway)."""
        left: list[RequestObservation] = []
        while True:
            try:
                left.append(self._receive.receive_nowait())
            except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                break
        try:
            if left and self.store is not None:
                self._write(left)
        except Exception:
            log.exception("capture: records queued at shutdown could not be written")
        if self.store is not None:
            self.store.close()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "directory": str(self.directory), "error": self.error or None,
                               "written": self.written, "dropped": self.dropped, "write_errors": self.write_errors,
                               "max_records": self.retention.max_records, "max_bytes": self.retention.max_bytes,
                               "max_age_s": self.retention.max_age_s, "key_id": self.key.key_id if self.key else None}
        if self.store is not None:
            out.update(self.store.status())
        return out


def observe(request: GenerationRequest) -> RequestObservation:
    """A fresh observation of ``request``, stamped now."""
    return RequestObservation(request=request, started=time.monotonic(), started_wall=time.time())
