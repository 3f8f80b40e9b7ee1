"""Errors the API reports to OpenAI clients, each with the HTTP status and code it maps to.

The backend raises these so that the HTTP layer never has to guess from prose: the status, the
OpenAI ``type``/``code`` pair and any ``Retry-After`` hint travel with the exception.
"""

from __future__ import annotations

import math

from meshd.errors import ErrorCode, MeshError


class ApiError(MeshError):
    """An error with a fixed place in the OpenAI error shape."""

    status = 500
    type = "server_error"
    code = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str, *, param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code.value}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class BadRequest(ApiError):
    """The request is malformed or asks for something outside the allowed ranges."""

    status = 400
    type = "invalid_request_error"
    code = ErrorCode.INVALID_REQUEST

    def __init__(self, message: str, param: str | None = None, *, code: ErrorCode | None = None) -> None:
        super().__init__(message, param=param)
        if code is not None:
            self.code = code


class PayloadTooLarge(ApiError):
    """The request body exceeds the configured limit; refused before parsing."""

    status = 413
    type = "invalid_request_error"
    code = ErrorCode.PAYLOAD_TOO_LARGE


class ModelNotFound(ApiError):
    """No peer in the mesh serves this model id."""

    status = 404
    type = "invalid_request_error"
    code = ErrorCode.MODEL_NOT_FOUND

    def __init__(self, model: str) -> None:
        super().__init__(f"The model {model!r} does not exist or is not served by this mesh.", param="model")
        self.model = model


class NoRoute(ApiError):
    """The model is known but some of its layers have no live holder right now.

    The missing ranges are half-open ``[start, end)`` layer intervals, named in the message so an
    operator can see which shards to bring up.
    """

    status = 503
    type = "server_error"
    code = ErrorCode.NO_ROUTE

    def __init__(self, model: str, missing_ranges: list[tuple[int, int]], *, retry_after: float = 5.0) -> None:
        ranges = ", ".join(f"[{start}, {end})" for start, end in missing_ranges) or "unknown"
        super().__init__(
            f"No complete route for model {model!r}: no live peer holds layers {ranges}.", retry_after=retry_after
        )
        self.model = model
        self.missing_ranges = list(missing_ranges)


class Overloaded(ApiError):
    """Every route is at capacity (KV budget, session limit); the client should retry later."""

    status = 503
    type = "server_error"
    code = ErrorCode.OVERLOADED

    def __init__(self, reason: str, *, retry_after: float = 1.0) -> None:
        super().__init__(f"The mesh is overloaded: {reason}", retry_after=retry_after)
        self.reason = reason


class RouteFailed(ApiError):
    """A generation could not be repaired within its attempts and time; names the last cause."""

    status = 503
    type = "server_error"
    code = ErrorCode.ROUTE_FAILED

    def __init__(self, cause: str, *, retry_after: float = 2.0) -> None:
        super().__init__(f"The generation failed and could not be repaired: {cause}", retry_after=retry_after)


class DeadlineExceeded(ApiError):
    """The request ran past the peer's request deadline; its session was released everywhere."""

    status = 504
    type = "server_error"
    code = ErrorCode.DEADLINE_EXCEEDED

    def __init__(self, seconds: float) -> None:
        super().__init__(f"The request did not finish within {seconds:g} s.")


class InternalError(ApiError):
    """Anything unexpected; the client sees a fixed message, the log gets the traceback."""

    def __init__(self) -> None:
        super().__init__("The server had an internal error while processing the request.")
