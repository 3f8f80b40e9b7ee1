"""Turning OpenAI request bodies into :class:`GenerationRequest`, refusing what we cannot honour.

Unknown fields are ignored, as OpenAI clients send many optional ones; known fields are checked
for type and range so a bad value is a 400 naming the parameter rather than a failure deep in the
mesh.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from meshd.api.backend import GenerationRequest, RequestKind
from meshd.api.errors import BadRequest
from meshd.errors import ErrorCode

MAX_STOP_STRINGS = 4
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class ParsedRequest:
    generation: GenerationRequest
    include_usage: bool


def decode_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}", code=ErrorCode.INVALID_JSON) from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.", code=ErrorCode.INVALID_TYPE)
    return body


def parse_chat(body: dict[str, Any], request_id: str) -> ParsedRequest:
    return _parse(body, "chat", request_id)


def parse_completion(body: dict[str, Any], request_id: str) -> ParsedRequest:
    return _parse(body, "completion", request_id)


def _parse(body: dict[str, Any], kind: RequestKind, request_id: str) -> ParsedRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _missing_or_type("model", "a non-empty string", body)
    messages = _messages(body) if kind == "chat" else None
    prompt = _prompt(body) if kind == "completion" else None
    max_tokens = _max_tokens(body, kind)
    temperature = _number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise _value_error("temperature", f"temperature must be between 0 and 2, got {temperature}.")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise _value_error("top_p", f"top_p must be in (0, 1], got {top_p}.")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise _value_error("n", "Only n=1 is supported.")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _type_error("seed", "an integer")
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise _type_error("stream", "a boolean")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _type_error("ignore_eos", "a boolean")
    generation = GenerationRequest(
        model=model,
        kind=kind,
        request_id=request_id,
        messages=messages,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=_stop(body),
        stream=stream,
        ignore_eos=ignore_eos,
    )
    return ParsedRequest(generation, include_usage=stream and _include_usage(body))


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _missing_or_type("messages", "a non-empty array", body)
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _type_error(where, "an object")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise _value_error(f"{where}.role", f"{where}.role must be one of {sorted(CHAT_ROLES)}.")
        out.append({"role": role, "content": _content(message.get("content"), role, f"{where}.content")})
    return out


def _content(content: object, role: str, where: str) -> str:
    """A string, or the list-of-text-parts form newer clients send; other part types are refused."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest(f"{where}[{j}] must be a text part; other part types are not supported.", where)
            texts.append(part["text"])
        return "".join(texts)
    raise _type_error(where, "a string")


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if not isinstance(prompt, str):
        raise _missing_or_type("prompt", "a string", body)
    return prompt


def _max_tokens(body: dict[str, Any], kind: RequestKind) -> int | None:
    names = ["max_completion_tokens", "max_tokens"] if kind == "chat" else ["max_tokens"]
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value):
            raise _type_error(name, "an integer")
        if value < 1:
            raise _value_error(name, f"{name} must be at least 1, got {value}.")
        return value
    return None


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or an array of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise _value_error("stop", f"stop accepts at most {MAX_STOP_STRINGS} strings.")
    if any(not s for s in stops):
        raise _value_error("stop", "stop strings must be non-empty.")
    return list(stops)


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise _type_error("stream_options.include_usage", "a boolean")
    return include


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _type_error(name, "a number")
    return float(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_error(param: str, expected: str) -> BadRequest:
    return BadRequest(f"{param} must be {expected}.", param, code=ErrorCode.INVALID_TYPE)


def _value_error(param: str, message: str) -> BadRequest:
    return BadRequest(message, param, code=ErrorCode.INVALID_VALUE)


def _missing_or_type(param: str, expected: str, body: dict[str, Any]) -> BadRequest:
    if body.get(param) is None:
        return BadRequest(f"Missing required parameter: {param!r}.", param, code=ErrorCode.MISSING_PARAMETER)
    return _type_error(param, expected)
