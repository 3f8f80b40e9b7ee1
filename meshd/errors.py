"""Error codes and the typed errors shared across planes.

Every error a peer can report to another, or the API to a client, carries one :class:`ErrorCode`,
so that it survives the wire and the receiver can react to it (repair, re-route, report to the
client) without parsing prose. The codes are the one vocabulary of failure: seam messages, peer RPC
replies and OpenAI error bodies all carry these strings.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    # bundles, shards and models
    BAD_BUNDLE = "bad_bundle"
    SHAPE_MISMATCH = "shape_mismatch"
    RANGE_MISMATCH = "range_mismatch"
    POSITION_MISMATCH = "position_mismatch"
    CACHE_MISS = "cache_miss"
    KV_BUDGET = "kv_budget"
    UNSUPPORTED_ARCHITECTURE = "unsupported_architecture"
    BAD_MODEL = "bad_model"
    # identity, cards and leases
    BAD_IDENTITY = "bad_identity"
    CARD_REJECTED = "card_rejected"
    LEASE_REJECTED = "lease_rejected"
    NOT_MEMBER = "not_member"
    INVITE_REFUSED = "invite_refused"
    # the transport
    TRANSPORT_ERROR = "transport_error"
    PEER_AUTH = "peer_auth"
    STREAM_RESET = "stream_reset"
    BAD_FRAMING = "bad_framing"
    MESSAGE_TOO_LARGE = "message_too_large"
    # sessions on seams
    UNREACHABLE = "unreachable"
    OVERLOADED = "overloaded"
    LEAVING = "leaving"
    SEAM_FAILED = "seam_failed"
    SEAM_CLOSED = "seam_closed"
    PEER_DEAD = "peer_dead"
    STEP_TIMEOUT = "step_timeout"
    PROTOCOL = "protocol"
    # peer RPC
    BAD_REQUEST = "bad_request"
    NOT_TRACKER = "not_tracker"
    UNKNOWN_MODEL = "unknown_model"
    RATE_LIMITED = "rate_limited"
    # the OpenAI API
    INVALID_REQUEST = "invalid_request"
    INVALID_JSON = "invalid_json"
    INVALID_TYPE = "invalid_type"
    INVALID_VALUE = "invalid_value"
    MISSING_PARAMETER = "missing_required_parameter"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HTTP_ERROR = "http_error"
    NO_ROUTE = "no_route"
    ROUTE_FAILED = "route_failed"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    # anything else
    INTERNAL_ERROR = "internal_error"
    MESH_ERROR = "mesh_error"
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, text: str) -> ErrorCode:
        """The code a remote peer sent; one this version does not know is ``UNKNOWN``, never an exception."""
        try:
            return cls(text)
        except ValueError:
            return cls.UNKNOWN


class MeshError(Exception):
    """Base of every error meshd reports on purpose."""

    code: ErrorCode = ErrorCode.MESH_ERROR


class BundleError(MeshError):
    """A hidden-state bundle is malformed or inconsistent with itself."""

    code = ErrorCode.BAD_BUNDLE


class ShapeMismatch(MeshError):
    """A bundle's tensors do not fit the receiving shard (hidden size, token count, dtype)."""

    code = ErrorCode.SHAPE_MISMATCH


class RangeMismatch(MeshError):
    """A bundle was addressed to a layer range this shard does not hold."""

    code = ErrorCode.RANGE_MISMATCH


class PositionMismatch(MeshError):
    """A bundle's start position is not the session's cached length on this hop."""

    code = ErrorCode.POSITION_MISMATCH


class CacheMiss(MeshError):
    """The session's KV state is not on this hop: never opened, released, or evicted."""

    code = ErrorCode.CACHE_MISS

    def __init__(self, session_id: str, epoch: int, reason: str) -> None:
        super().__init__(f"no KV state for session {session_id!r} epoch {epoch}: {reason}")
        self.session_id = session_id
        self.epoch = epoch
        self.reason = reason


class KVBudgetExceeded(MeshError):
    """A single session needs more KV bytes than the whole budget of this hop."""

    code = ErrorCode.KV_BUDGET


class UnsupportedArchitecture(MeshError):
    """The model's architecture has no adapter; it is refused rather than run half-right."""

    code = ErrorCode.UNSUPPORTED_ARCHITECTURE


class ModelFormatError(MeshError):
    """A model directory is missing files or tensors the runtime needs."""

    code = ErrorCode.BAD_MODEL


class ListenError(MeshError):
    """A listener could not be opened (port in use, address not on this machine, no permission)."""


class RemoteError(MeshError):
    """A peer answered with an error: its code, its message, and the peer it names as at fault."""

    def __init__(self, code: ErrorCode, message: str, peer_id: str = "") -> None:
        super().__init__(f"{code}: {message}" + (f" (peer {peer_id[:12]})" if peer_id else ""))
        self.code = code
        self.message = message
        self.peer_id = peer_id


def first_leaf(error: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: what a one-line report should name."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def reportable(error: BaseException) -> BaseException | None:
    """The error to report in one line when everything in ``error`` is an OS or meshd error, else None
    (a bug, whose traceback must be seen)."""
    if isinstance(error, BaseExceptionGroup):
        rest = error.split((OSError, MeshError))[1]
        return None if rest is not None else first_leaf(error)
    return error if isinstance(error, (OSError, MeshError)) else None

