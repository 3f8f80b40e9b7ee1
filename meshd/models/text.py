"""A model's text side: tokenizer, chat template, the tokens that end a reply, and its tool calls.

Everything comes from the model directory as the model's authors wrote it: the tokenizer and its
special tokens, the chat template (``tokenizer_config.json`` or ``chat_template.jinja``), and the
tokens that end a reply (the tokenizer's end-of-sequence token and every id ``generation_config.json``
lists: Llama 3 ends a turn with ``<|eot_id|>``, not only with ``<|end_of_text|>``).

Tools reach the template only when the template takes them. A model then answers a call in its
family's format, which this module reads back into OpenAI's shape: ``<tool_call>{...}</tool_call>``
blocks (Qwen, Hermes) where the template names that tag, else a JSON object with ``name`` and
``parameters`` or ``arguments`` (Llama 3.1).
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from meshd.errors import ModelFormatError
from meshd.session.detokenize import IncrementalDetokenizer

CHAT_BOUNDARY_TAIL = 4  # without offsets: message ends looked for before the last message
MAX_CHAT_BOUNDARIES = 512  # messages whose every end is found; longer chats: the first and the last few
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ChatRefused(ValueError):
    """The model's chat template refused the conversation (its ``raise_exception``: roles out of
    order, a role it has none for), or failed on it: the request's fault, not the mesh's."""


class ToolFormat(enum.StrEnum):
    TAGGED = "tagged"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    JSON = "json"      # the whole reply is {"name": ..., "parameters": {...}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class TextCodec:
    def __init__(self, tokenizer: Any, stop_token_ids: frozenset[int], vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.vocab_size = vocab_size  # the model's token ids (its config's, which may pass the tokenizer's)
        template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
        self.has_chat_template = bool(template)
        self.tool_format: ToolFormat | None = None
        if template and "tools" in template:
            self.tool_format = ToolFormat.TAGGED if "<tool_call>" in template else ToolFormat.JSON

    @classmethod
    def load(cls, directory: Path) -> TextCodec:
        """The model's text side; a tokenizer that does not load, or a ``generation_config.json`` that
        does not read, is a model format error naming it (a peer would otherwise fail every request)."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(directory)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ModelFormatError(f"the tokenizer in {directory} does not load: {exc}") from None
        stops: set[int] = set()
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        generation = Path(directory) / "generation_config.json"
        if generation.is_file():
            try:
                doc = json.loads(generation.read_text())
            except (OSError, ValueError) as exc:
                raise ModelFormatError(f"{generation} does not read as JSON: {exc}") from None
            eos = doc.get("eos_token_id") if isinstance(doc, dict) else None
            stops.update(int(i) for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int))
        return cls(tokenizer, frozenset(stops), _vocab_size(Path(directory) / "config.json"))

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True, "return_dict": True}
        if tools:
            kwargs["tools"] = tools
        try:
            encoded = self.tokenizer.apply_chat_template([_for_template(m) for m in messages], **kwargs)
        except TemplateError as exc:  # the template's own refusal ("roles must alternate"), or its error
            raise ChatRefused(str(exc) or type(exc).__name__) from None
        return [int(i) for i in encoded["input_ids"]]

    def chat_boundaries(self, messages: list[dict[str, Any]], tokens: list[int],
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Where messages end in ``tokens`` (the encoded chat). Prefix KV is kept and found at these ends,
        and prefills are cut there, so every turn of a conversation must find every end its earlier
        turns found: each leading part of the conversation is rendered as text, and the whole chat is
        tokenized once with character offsets; a message ends at the token boundary that falls exactly
        where its rendering ends, when that rendering is a prefix of the whole (a template may render
        earlier messages differently once later ones follow) and no token spans the boundary. A
        tokenizer without offsets falls back to tokenizing the first and the last few renderings."""
        found = self._ends_by_offsets(messages, tokens, tools)
        return found if found is not None else self._ends_by_tokenizing(messages, tokens, tools)

    def _ends_by_offsets(self, messages: list[dict[str, Any]], tokens: list[int],
                         tools: list[dict[str, Any]] | None) -> list[int] | None:
        if len(messages) > MAX_CHAT_BOUNDARIES or not getattr(self.tokenizer, "is_fast", False):
            return None
        templated = [_for_template(m) for m in messages]
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        try:
            whole = self.tokenizer.apply_chat_template(templated, tokenize=False, add_generation_prompt=True, **extra)
            encoded = self.tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
        except Exception:  # a template or tokenizer that cannot: the other way
            return None
        if [int(i) for i in encoded["input_ids"]] != list(tokens):
            return None
        starts = [int(s) for s, _e in encoded["offset_mapping"]]
        ends = [int(e) for _s, e in encoded["offset_mapping"]]
        found: list[int] = []
        for count in range(1, len(messages) + 1):
            try:
                text = self.tokenizer.apply_chat_template(templated[:count], tokenize=False,
                                                          add_generation_prompt=False, **extra)
            except Exception:  # a template may refuse a conversation cut there (say, one ending in a tool call)
                continue
            if not isinstance(text, str) or not whole.startswith(text):
                continue
            boundary = bisect.bisect_right(ends, len(text))  # tokens that end by the rendering's end
            if 0 < boundary < len(tokens) and starts[boundary] >= len(text):
                found.append(boundary)
        return sorted(set(found))

    def _ends_by_tokenizing(self, messages: list[dict[str, Any]], tokens: list[int],
                            tools: list[dict[str, Any]] | None) -> list[int]:
        n = len(messages)
        counts = sorted({1, *range(max(1, n - CHAT_BOUNDARY_TAIL), n + 1)} - {0})
        kwargs: dict[str, Any] = {"add_generation_prompt": False, "tokenize": True, "return_dict": True}
        if tools:
            kwargs["tools"] = tools
        ends: list[int] = []
        for count in counts:
            try:
                encoded = self.tokenizer.apply_chat_template([_for_template(m) for m in messages[:count]], **kwargs)
            except Exception:  # a template may refuse a conversation cut there (say, one ending in a tool call)
                continue
            ids = [int(i) for i in encoded["input_ids"]]
            if 0 < len(ids) < len(tokens) and tokens[: len(ids)] == ids:
                ends.append(len(ids))
        return sorted(set(ends))

    def encode_text(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), for log-probability entries."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer)

    def tool_calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """The reply split into its plain content and the tool calls it makes (none: all content)."""
        if self.tool_format is None:
            return text, []
        if self.tool_format == ToolFormat.TAGGED:
            calls = [call for block in _TOOL_CALL.findall(text) if (call := _parse_call(block)) is not None]
            if not calls:
                return text, []
            return _TOOL_CALL.sub("", text).strip(), calls
        body = text.strip().removeprefix("<|python_tag|>").strip()
        call = _parse_call(body) if body.startswith("{") else None
        return ("", [call]) if call is not None else (text, [])

    def may_be_tool_call(self, text: str) -> bool:
        """Whether a reply that starts with ``text`` could still turn out to be a tool call."""
        if self.tool_format is None:
            return False
        head = text.lstrip()
        marker = "<tool_call>" if self.tool_format == ToolFormat.TAGGED else "{"
        python_tag = "<|python_tag|>"
        if self.tool_format == ToolFormat.JSON and (head.startswith(python_tag) or python_tag.startswith(head)):
            return True
        return head.startswith(marker) or (len(head) < len(marker) and marker.startswith(head))


def _parse_call(body: str) -> ToolCall | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        return None
    arguments = doc.get("arguments", doc.get("parameters", {}))
    return ToolCall(doc["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's message as chat templates take it: tool-call arguments as objects, not JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = dict(message)
    out["tool_calls"] = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):  # a template may take the text as it is
                function["arguments"] = json.loads(arguments)
        out["tool_calls"].append({**call, "function": function})
    return out


def _vocab_size(config: Path) -> int | None:
    """The model's vocabulary size from its ``config.json`` (or its text model's, for a multimodal
    one); None when the file does not say."""
    try:
        doc = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    for part in (doc, doc.get("text_config") if isinstance(doc, dict) else None):
        size = part.get("vocab_size") if isinstance(part, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None
