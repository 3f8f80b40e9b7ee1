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
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "tool_calls"]
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

    ``messages`` are ``{"role", "content"}`` dicts (with ``tool_calls`` or ``tool_call_id`` where
    OpenAI has them), the shape chat templates take. ``tools`` are OpenAI function tools; they reach
    the model's chat template, and ``tool_choice="none"`` keeps them from it.
    """

    model: str
    kind: RequestKind
    request_id: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    ignore_eos: bool = False  # extension (as in vLLM): run to max_tokens even past end-of-sequence
    logprobs: bool = False    # report each token's log-probability
    top_logprobs: int = 0     # ...and the most likely alternatives'
    tools: list[dict[str, Any]] | None = None
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class Started:
    """Optional first event: lets usage stay exact when a stop sequence closes the generator early."""

    prompt_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """A token's text and log-probability, and those of the most likely alternatives at its position."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; ``text`` is the decoded increment, "" while a UTF-8 sequence is incomplete
    (or while the reply may still turn out to be a tool call)."""

    text: str
    token_id: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class Finished:
    """Last event of a generation that ran to EOS (``stop``) or to ``max_tokens`` (``length``).

    ``text`` is what the tokens' increments held back at the end (an incomplete UTF-8 sequence), so
    that every token's text can go out as soon as the token exists."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape; finish_reason "tool_calls"


BackendEvent = Started | TokenEvent | Finished


class ChatBackend(Protocol):
    def list_models(self) -> list[ModelInfo]: ...

    def generate(self, req: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
        """Yield (optionally ``Started``, then) ``TokenEvent``s, then exactly one ``Finished``.

        Raise :mod:`meshd.api.errors` types for refusals. The API may close the generator at any
        point (stop sequence, client gone); the backend must release its session on close.
        """
        ...
