"""The contract between the HTTP API and whatever produces tokens.

The API knows nothing about shards or routes: it hands a :class:`GenerationRequest` to a
:class:`ChatBackend` and consumes the events it yields. Stop sequences are applied here, not in the
backend, so the backend only has to stop on EOS or ``max_tokens`` and release its session when the
generator is closed early.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]
RequestKind = Literal["chat", "completion"]


@dataclass(frozen=True)
class ModelInfo:
    """One entry of ``GET /v1/models``."""

    id: str
    owned_by: str = "meshd"
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request; exactly one of ``messages`` (chat) or ``prompt`` (completion) is set.

    ``messages`` are plain ``{"role", "content"}`` dicts, the shape chat templates take.
    """

    model: str
    kind: RequestKind
    request_id: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    ignore_eos: bool = False  # extension (as in vLLM): run to max_tokens even past end-of-sequence


@dataclass(frozen=True)
class Started:
    """Optional first event: lets usage stay exact when a stop sequence closes the generator early."""

    prompt_tokens: int


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; ``text`` is the decoded increment, "" while a UTF-8 sequence is incomplete."""

    text: str
    token_id: int


@dataclass(frozen=True)
class Finished:
    """Last event of a generation that ran to EOS (``stop``) or to ``max_tokens`` (``length``).

    ``text`` is what the tokens' increments held back at the end (an incomplete UTF-8 sequence), so
    that every token's text can go out as soon as the token exists."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    text: str = ""


BackendEvent = Started | TokenEvent | Finished


class ChatBackend(Protocol):
    def list_models(self) -> list[ModelInfo]: ...

    def generate(self, req: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
        """Yield (optionally ``Started``, then) ``TokenEvent``s, then exactly one ``Finished``.

        Raise :mod:`meshd.api.errors` types for refusals. The API may close the generator at any
        point (stop sequence, client gone); the backend must release its session on close.
        """
        ...
