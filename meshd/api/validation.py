"""Turning OpenAI request bodies into :class:`GenerationRequest`, refusing what we cannot honour.

Nothing is accepted and then ignored. Every parameter of the two endpoints is either honoured
(checked for type and range, so a bad value is a 400 naming it rather than a failure deep in the
mesh), accepted only in the value that changes nothing (``n`` of 1, a zero penalty, ``response_format``
of ``text``), or refused with a 400 that says so; a parameter OpenAI does not have is refused as
unrecognized, as OpenAI refuses it. ``user`` identifies the end user and is logged with the request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from meshd.api.backend import GenerationRequest, RequestKind
from meshd.api.errors import BadRequest
from meshd.errors import ErrorCode
from meshd.limits import parse_json
from meshd.wire.limits import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4
MAX_LEGACY_LOGPROBS = 5
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream", "stream_options",
                    "ignore_eos", "logprobs", "frequency_penalty", "presence_penalty", "logit_bias", "user"})
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                 "response_format", "store", "metadata", "service_tier", "reasoning_effort", "modalities", "audio",
                 "prediction", "web_search_options", "functions", "function_call"}
COMPLETION = COMMON | {"prompt", "echo", "best_of", "suffix"}


@dataclass(frozen=True)
class ParsedRequest:
    generation: GenerationRequest
    include_usage: bool


def decode_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = parse_json(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}", code=ErrorCode.INVALID_JSON) from None
    except ValueError as exc:  # JSON Python will not hold: nested too deeply, an integer of thousands of digits
        raise BadRequest(f"The request body holds a value that cannot be read: {exc}",
                         code=ErrorCode.INVALID_JSON) from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.", code=ErrorCode.INVALID_TYPE)
    where = _unencodable_text(body)
    if where is not None:
        raise BadRequest(f"{where} holds an unpaired surrogate (\\ud800-\\udfff escape), which is not text.", where,
                         code=ErrorCode.INVALID_VALUE)
    return body


def _unencodable_text(body: dict[str, Any]) -> str | None:
    """Where ``body`` holds a string that is not text (JSON's escapes can spell a lone UTF-16 surrogate,
    which no tokenizer, log or reply can encode), as a parameter path; None when it holds none."""
    pending: list[tuple[str, object]] = [("", body)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, str):
            texts = [value]
        elif isinstance(value, dict):
            texts = list(value)
            pending.extend((f"{where}.{k}" if where else k, v) for k, v in value.items())
        elif isinstance(value, list):
            texts = []
            pending.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
        else:
            continue
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return where or "the request body"
    return None


def parse_chat(body: dict[str, Any], request_id: str) -> ParsedRequest:
    return _parse(body, "chat", request_id)


def parse_completion(body: dict[str, Any], request_id: str) -> ParsedRequest:
    return _parse(body, "completion", request_id)


def _parse(body: dict[str, Any], kind: RequestKind, request_id: str) -> ParsedRequest:
    unknown = sorted(set(body) - (CHAT if kind == "chat" else COMPLETION))
    if unknown:
        raise BadRequest(f"Unrecognized request argument supplied: {', '.join(unknown)}.", unknown[0],
                         code=ErrorCode.INVALID_REQUEST)
    _refuse_unsupported(body, kind)
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
    logprobs, top_logprobs = _logprobs(body, kind)
    tools = _tools(body) if kind == "chat" else None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _type_error("parallel_tool_calls", "a boolean")
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
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        tools=tools,
        parallel_tool_calls=parallel,
    )
    include_usage = _include_usage(body)
    if body.get("stream_options") is not None and not stream:
        raise _value_error("stream_options", "stream_options is only allowed when stream is true.")
    return ParsedRequest(generation, include_usage=include_usage)


def _refuse_unsupported(body: dict[str, Any], kind: RequestKind) -> None:
    """Parameters this mesh cannot honour are refused, unless they ask for what it does anyway."""
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, 0.0) != 0:
            raise _value_error(name, f"{name} is not supported; only 0 (no penalty) is accepted.")
    _typed(body, "logit_bias", dict, "an object")
    if body.get("logit_bias"):
        raise _value_error("logit_bias", "logit_bias is not supported.")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _type_error("user", "a string")
    if kind == "completion":
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise _type_error("echo", "a boolean")
        if echo:
            raise _value_error("echo", "echo is not supported.")
        best_of = body.get("best_of")
        if best_of is not None and not _is_int(best_of):
            raise _type_error("best_of", "an integer")
        if best_of is not None and best_of != 1:
            raise _value_error("best_of", "Only best_of=1 is supported.")
        _typed(body, "suffix", str, "a string")
        if body.get("suffix"):
            raise _value_error("suffix", "suffix (insertion) is not supported.")
        return
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
            raise _type_error("response_format", "an object with a type")
        if response_format["type"] != "text":
            raise _value_error("response_format", f"response_format {response_format['type']!r} is not supported: "
                               "this mesh does not constrain decoding; only 'text' is accepted.")
    _typed(body, "store", bool, "a boolean")
    _typed(body, "metadata", dict, "an object")
    if body.get("store"):
        raise _value_error("store", "store is not supported: replies are not stored.")
    if body.get("metadata"):
        raise _value_error("metadata", "metadata is only kept with store, which is not supported.")
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default"):
        raise _value_error("service_tier", "Only the default service tier exists here.")
    for name in ("reasoning_effort", "modalities", "audio", "prediction", "web_search_options", "functions",
                 "function_call"):
        if body.get(name) is not None and not (name == "modalities" and body[name] == ["text"]):
            raise _value_error(name, f"{name} is not supported.")


def _logprobs(body: dict[str, Any], kind: RequestKind) -> tuple[bool, int]:
    value = body.get("logprobs")
    if kind == "completion":  # the legacy endpoint: logprobs is how many alternatives
        if value is None:
            return False, 0
        if not _is_int(value) or not 0 <= value <= MAX_LEGACY_LOGPROBS:
            raise _value_error("logprobs", f"logprobs must be an integer from 0 to {MAX_LEGACY_LOGPROBS}.")
        return True, int(value)
    if value is not None and not isinstance(value, bool):
        raise _type_error("logprobs", "a boolean")
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _value_error("top_logprobs", f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}.")
        if not value:
            raise _value_error("top_logprobs", "top_logprobs needs logprobs set to true.")
    return bool(value), int(top or 0)


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise _value_error("tool_choice", "tool_choice needs tools.")
        return None
    if not isinstance(tools, list) or not tools:
        raise _type_error("tools", "a non-empty array")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise _value_error(f"tools[{i}]", f"tools[{i}] must be a function tool with a name.")
    if choice in (None, "auto"):
        return [dict(t) for t in tools]
    if choice == "none":
        return None
    raise _value_error("tool_choice", "tool_choice 'auto' and 'none' are supported; this mesh cannot force a call.")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
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
        calls = message.get("tool_calls")
        entry: dict[str, Any] = {"role": role,
                                 "content": _content(message.get("content"), role, f"{where}.content",
                                                     optional=bool(calls))}
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise _value_error(f"{where}.tool_calls", "tool_calls belong to assistant messages, as an array.")
            entry["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _missing_or_type(f"{where}.tool_call_id", "a string", {})
            entry["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        out.append(entry)
    return out


def _tool_call(call: object, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _value_error(where, f"{where} must have a function with a name.")
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": function["name"], "arguments": function.get("arguments", "{}")}}


def _content(content: object, role: str, where: str, optional: bool = False) -> str:
    """A string, or the list-of-text-parts form newer clients send; other part types are refused."""
    if isinstance(content, str):
        return content
    if content is None and (role == "assistant" or optional):
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
    """The output bound; the chat endpoint's two names for it (``max_tokens`` the older) must agree."""
    names = ["max_completion_tokens", "max_tokens"] if kind == "chat" else ["max_tokens"]
    given: dict[str, int] = {}
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value):
            raise _type_error(name, "an integer")
        if value < 1:
            raise _value_error(name, f"{name} must be at least 1, got {value}.")
        given[name] = value
    if len(set(given.values())) > 1:
        raise _value_error("max_tokens", f"max_tokens ({given['max_tokens']}) and max_completion_tokens "
                           f"({given['max_completion_tokens']}) disagree; give one of them.")
    return next(iter(given.values()), None)


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


def _typed(body: dict[str, Any], name: str, kind: type, expected: str) -> None:
    """Refuse ``name`` unless it is absent, null or of ``kind`` (a parameter accepted only in the value
    that changes nothing must still be of its type: ``store: 0`` is no boolean)."""
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise _type_error(name, expected)


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
