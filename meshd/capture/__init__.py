"""Capture and replay: a bounded, privacy-safe record of the requests this peer answered as the
entry, and the deterministic re-run of them on a chosen route to see whether replies still match.

- :mod:`meshd.capture.records` — what one record holds in each mode, keyed hashes, redaction.
- :mod:`meshd.capture.store` — the append-only JSONL segments in the data directory and their retention.
- :mod:`meshd.capture.recorder` — the daemon's writer: records leave the request path at once.
- :mod:`meshd.capture.replay` — route pinning, body matching and reply comparison (no I/O).
- :mod:`meshd.capture.replayer` — the daemon's side of ``meshctl replay``.
"""

from meshd.capture.records import CAPTURE_MODES

__all__ = ["CAPTURE_MODES"]
