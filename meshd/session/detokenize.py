"""Turn a stream of token ids into text increments without splitting UTF-8 characters."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Decode the whole generated sequence each time and hand out only what is new.

    A byte-level token can end in the middle of a multi-byte character; the decoded text then ends
    in U+FFFD, and that increment is held back until a later token completes it (or the generation
    ends, when :meth:`flush` hands out whatever is left).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = str(self._tokenizer.decode(self._ids, skip_special_tokens=True))
        if text.endswith("\ufffd") or not text.startswith(self._emitted):
            return ""
        delta = text[len(self._emitted):]
        self._emitted = text
        return delta

    def flush(self) -> str:
        text = str(self._tokenizer.decode(self._ids, skip_special_tokens=True))
        delta = text[len(self._emitted):] if text.startswith(self._emitted) else ""
        self._emitted = text
        return delta
