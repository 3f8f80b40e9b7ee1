"""``meshd`` lending KV-tier memory that dies (the whole process, at once) when asked for the second
chunk of a snapshot: a tier peer lost in the middle of an import. Run as ``python -m`` with
``meshd run``'s arguments."""

from __future__ import annotations

import os

import meshd.kvtier.store as store
from meshd.cli.meshd_main import main
from meshd.wire import kv_tier_pb2 as pb

_get = store.TierStore.get


def _dying_get(self: store.TierStore, get: pb.KVGet) -> pb.KVChunk | None:
    if get.index >= 1:
        os._exit(17)
    return _get(self, get)


if __name__ == "__main__":  # only in the daemon this module runs as
    store.TierStore.get = _dying_get  # type: ignore[method-assign]
    main()
