"""``meshd`` that cuts prefix snapshots for the KV tier into 16 KiB chunks instead of 1 MiB, so that a
tiny model's snapshots travel in several. Run as ``python -m`` with ``meshd run``'s arguments."""

from __future__ import annotations

import meshd.kvtier.snapshots as snapshots
from meshd.cli.meshd_main import main

if __name__ == "__main__":  # only in the daemon this module runs as
    snapshots.CHUNK_BYTES = 16 * 1024
    main()
