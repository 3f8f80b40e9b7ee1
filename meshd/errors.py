"""Typed errors shared across planes.

Every error a peer can report to another carries a stable ``code`` so that it survives the wire
and the entry can react to it (repair, re-route, report to the client) without parsing prose.
"""

from __future__ import annotations


class MeshError(Exception):
    """Base of every error meshd reports on purpose."""

    code = "mesh_error"


class BundleError(MeshError):
    """A hidden-state bundle is malformed or inconsistent with itself."""

    code = "bad_bundle"


class ShapeMismatch(MeshError):
    """A bundle's tensors do not fit the receiving shard (hidden size, token count, dtype)."""

    code = "shape_mismatch"


class RangeMismatch(MeshError):
    """A bundle was addressed to a layer range this shard does not hold."""

    code = "range_mismatch"


class PositionMismatch(MeshError):
    """A bundle's start position is not the session's cached length on this hop."""

    code = "position_mismatch"


class CacheMiss(MeshError):
    """The session's KV state is not on this hop: never opened, released, or evicted."""

    code = "cache_miss"

    def __init__(self, session_id: str, epoch: int, reason: str) -> None:
        super().__init__(f"no KV state for session {session_id!r} epoch {epoch}: {reason}")
        self.session_id = session_id
        self.epoch = epoch
        self.reason = reason


class KVBudgetExceeded(MeshError):
    """A single session needs more KV bytes than the whole budget of this hop."""

    code = "kv_budget"


class UnsupportedArchitecture(MeshError):
    """The model's architecture has no adapter; it is refused rather than run half-right."""

    code = "unsupported_architecture"


class ModelFormatError(MeshError):
    """A model directory is missing files or tensors the runtime needs."""

    code = "bad_model"
