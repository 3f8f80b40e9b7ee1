"""The standard workload: a fixed prompt of an exact token count, and timed streamed completions."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

PROMPT_TOKENS = 64
NEW_TOKENS = 128
CONCURRENCY = (1, 4, 8)
PEERS = (1, 2, 3)

_SEED_TEXT = (
    "The lighthouse keeper wrote down the weather every morning: wind from the west, a low grey sky, "
    "and the sea rising slowly over the black rocks below the tower. Ships passed far out, their lights "
    "moving in a line toward the harbour, and the keeper counted them one by one in a small blue book. "
)


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]


def build_prompt(tokenizer: Any, n_tokens: int, start: int = 0) -> Prompt:
    """Deterministic text that the tokenizer turns into exactly ``n_tokens`` ids (as the API will).

    The text is cut from a repeated paragraph at a token boundary, ``start`` tokens into it (so that
    prompts of one length can differ); because re-encoding a decoded piece can merge differently at
    its ends, nearby cuts are tried until one round-trips to the requested count. If none does, the
    closest is used and its real length is what gets recorded.
    """
    if n_tokens < 1 or start < 0:
        raise ValueError("the prompt needs at least one token and a start of at least 0")
    source = _SEED_TEXT
    while len(tokenizer(source)["input_ids"]) < start + n_tokens + 16:
        source += _SEED_TEXT
    ids = tokenizer(source)["input_ids"][start:]
    best: Prompt | None = None
    for cut in sorted(range(max(1, n_tokens - 8), n_tokens + 9), key=lambda c: (abs(c - n_tokens), c)):
        text = tokenizer.decode(ids[:cut])
        encoded = list(tokenizer(text)["input_ids"])
        if len(encoded) == n_tokens:
            return Prompt(text, encoded)
        if best is None or abs(len(encoded) - n_tokens) < abs(len(best.ids) - n_tokens):
            best = Prompt(text, encoded)
    assert best is not None
    return best


@dataclass(frozen=True)
class StreamTiming:
    """One streamed completion as the client saw it (times in seconds from sending the request)."""

    text: str
    completion_tokens: int
    first_s: float
    last_s: float
    chunks: int
    chunk_s: tuple[float, ...] = ()  # when each chunk with text arrived
    started: float = 0.0  # ``time.perf_counter()`` when the request was sent

    @property
    def ttft_ms(self) -> float:
        return self.first_s * 1000

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, over the time from the first streamed text to the last."""
        span = self.last_s - self.first_s
        return (self.completion_tokens - 1) / span if span > 0 and self.completion_tokens > 1 else 0.0


def stream_completion(client: Any, model: str, prompt: str, max_tokens: int) -> StreamTiming:
    """A greedy streamed ``/v1/completions`` request that runs to ``max_tokens`` (``ignore_eos``)."""
    parts: list[str] = []
    times: list[float] = []
    first = last = None
    usage = None
    started = time.perf_counter()
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        now = time.perf_counter() - started
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            times.append(now)
            first = now if first is None else first
            last = now
    if usage is None or first is None or last is None:
        raise RuntimeError(f"the streamed completion from {model!r} carried no text or no usage")
    return StreamTiming("".join(parts), usage.completion_tokens, first, last, len(parts), tuple(times), started)
