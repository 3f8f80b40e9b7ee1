"""``meshd`` whose peer hands out damaged weights: every chunk it serves has its first byte flipped,
though its own files (and so its manifest and compat key) are intact. Run as ``python -m`` with
``meshd run``'s arguments, by the tests that check a fetching peer drops such a source."""

from __future__ import annotations

from meshd.cli.meshd_main import main
from meshd.weights.source import WeightsSource

_honest = WeightsSource.read_chunk


def _lying(self, model_dir, entry, index):  # type: ignore[no-untyped-def]
    data = bytearray(_honest(self, model_dir, entry, index))
    data[0] ^= 0xFF
    return bytes(data)


WeightsSource.read_chunk = _lying  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
