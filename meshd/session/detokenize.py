"""Turn a stream of token ids into text increments without splitting UTF-8 characters."""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decode a short window of the latest tokens each time and hand out only what is new.

    Decoding the whole reply at every token costs time in its length, so a long reply's tokens would
    grow dearer as it goes, on the event loop. The window instead holds the tokens not yet handed out
    and, before them, those of the last increment: a token's text can depend on the one before it (a
    SentencePiece word start is a space only after another word), so the new text is the window's
    decoding less that of its context.

    A byte-level token can end in the middle of a multi-byte character; the decoded text then ends
    in U+FFFD, and that increment is held back until a later token completes it (or the generation
    ends, when :meth:`flush` hands out whatever is left). So is a token that adds no text (a special
    token): the window keeps its context until one does.

    Later tokens can change the text of earlier ones: a run of byte tokens that turns out not to be
    UTF-8 decodes to U+FFFD throughout, letters already handed out included. What was handed out
    stays, and the stream goes on with the text past its length.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []  # the window: context, then the tokens not handed out yet
        self._pending = 0          # where the tokens not handed out yet start in it

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        context, text = self._decode()
        if text.endswith(REPLACEMENT) or len(text) <= len(context):
            return ""
        # what was pending is handed out now, and becomes the next window's context
        del self._ids[:self._pending]
        self._pending = len(self._ids)
        return text[len(context):]

    def flush(self) -> str:
        context, text = self._decode()
        self._ids.clear()
        self._pending = 0
        return text[len(context):]

    def _decode(self) -> tuple[str, str]:
        context = str(self._tokenizer.decode(self._ids[:self._pending], skip_special_tokens=True))
        text = str(self._tokenizer.decode(self._ids, skip_special_tokens=True))
        return context, text
