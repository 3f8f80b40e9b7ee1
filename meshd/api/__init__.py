"""OpenAI-compatible HTTP API in front of a token-producing backend."""

from meshd.api.backend import (
    BackendEvent,
    ChatBackend,
    Finished,
    GenerationRequest,
    ModelInfo,
    Started,
    TokenEvent,
)
from meshd.api.errors import ApiError, BadRequest, ModelNotFound, NoRoute, Overloaded
from meshd.api.openai_server import build_app, serve_api

__all__ = [
    "ApiError",
    "BackendEvent",
    "BadRequest",
    "ChatBackend",
    "Finished",
    "GenerationRequest",
    "ModelInfo",
    "ModelNotFound",
    "NoRoute",
    "Overloaded",
    "Started",
    "TokenEvent",
    "build_app",
    "serve_api",
]
