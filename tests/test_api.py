"""The OpenAI-compatible API over real loopback HTTP, against a deterministic fake backend."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from functools import partial
from typing import Any, TypeVar

import httpx2
import openai
import pytest
import trio

from meshd.api import (
    BackendEvent,
    Finished,
    GenerationRequest,
    ModelInfo,
    ModelNotFound,
    NoRoute,
    Overloaded,
    Started,
    TokenEvent,
    serve_api,
)
from meshd.api.backend import TokenLogprob
from meshd.api.stops import StopMatcher

MODEL = "tiny"
# One token is an incomplete UTF-8 sequence (""), and "world" is split across two tokens.
TOKENS = ["Hello", ",", " wo", "rld", "", " 😀", " How", " are", " you", "?"]
FULL_TEXT = "".join(TOKENS)
T = TypeVar("T")


class FakeBackend:
    """Yields TOKENS (up to max_tokens), then EOS; a few model ids stand for the refusal cases."""

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []
        self.started = trio.Event()
        self.closed = trio.Event()
        self.open_generations = 0

    def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(id=MODEL, created=1_700_000_000), ModelInfo(id="slow", created=1_700_000_000),
                ModelInfo(id="tooler", created=1_700_000_000)]

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
        self.requests.append(req)
        if req.model == "partial":
            raise NoRoute(req.model, [(4, 8), (12, 16)])
        if req.model == "busy":
            raise Overloaded("KV budget exhausted")
        if req.model == "boom":
            raise RuntimeError("secret internal detail")
        if req.model not in {MODEL, "slow", "breaks", "tooler"}:
            raise ModelNotFound(req.model)
        self.open_generations += 1
        self.started.set()
        try:
            text = req.prompt if req.prompt is not None else " ".join(m["content"] for m in req.messages or [])
            prompt_tokens = len(text.split())
            yield Started(prompt_tokens)
            if req.model == "slow":
                i = 0
                while True:
                    yield TokenEvent(" tick", i)
                    i += 1
                    await trio.sleep(0.01)
            if req.model == "breaks":
                yield TokenEvent("Hello", 0)
                raise NoRoute(req.model, [(0, 2)])
            if req.model == "tooler":
                for i in range(3):
                    yield TokenEvent("", i)  # held: the reply is a tool call
                call = {"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
                yield Finished("tool_calls", prompt_tokens, 3, tool_calls=[call])
                return
            limit = len(TOKENS) if req.max_tokens is None else min(req.max_tokens, len(TOKENS))
            for i, token in enumerate(TOKENS[:limit]):
                logprob = None
                if req.logprobs:
                    logprob = TokenLogprob(token, -0.5 * i, [(token, -0.5 * i), ("zz", -9.0)][: req.top_logprobs])
                yield TokenEvent(token, i, logprob)
            yield Finished("length" if limit < len(TOKENS) else "stop", prompt_tokens, limit)
        finally:
            self.open_generations -= 1
            self.closed.set()


@pytest.fixture
async def server(nursery: trio.Nursery) -> tuple[FakeBackend, str]:
    backend = FakeBackend()
    port = await nursery.start(serve_api, backend, "127.0.0.1:0")
    return backend, f"http://127.0.0.1:{port}"


@pytest.fixture
def client(server: tuple[FakeBackend, str]) -> Iterator[openai.OpenAI]:
    # The sync client, run in a worker thread: the async one leaves its SSE generators unfinalized
    # after [DONE], which Trio reports as ResourceWarnings.
    with openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


async def in_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    return await trio.to_thread.run_sync(partial(fn, *args, **kwargs))


async def stream_all(fn: Callable[..., Iterable[T]], /, **kwargs: Any) -> list[T]:
    return await trio.to_thread.run_sync(lambda: list(fn(stream=True, **kwargs)))


@pytest.fixture
async def http(server: tuple[FakeBackend, str]) -> AsyncGenerator[httpx2.AsyncClient, None]:
    async with httpx2.AsyncClient(base_url=server[1], timeout=5) as c:
        yield c


def chat_body(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "say hello please"}], **extra}


async def assert_still_serving(http: httpx2.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello,"


# --- stop matching, pure ---------------------------------------------------------------------------


def test_stop_matcher_holds_back_only_a_possible_prefix() -> None:
    matcher = StopMatcher(["world", "xx"])
    assert matcher.feed("Hello, wo") == "Hello, "
    assert matcher.feed("r") == ""
    assert matcher.feed("ld and more") == ""
    assert matcher.stopped


def test_stop_matcher_releases_a_false_start_and_flushes() -> None:
    matcher = StopMatcher(["abc"])
    assert matcher.feed("xab") == "x"
    assert matcher.feed("d") == "abd"
    assert matcher.feed("a") == ""
    assert matcher.flush() == "a"
    assert not matcher.stopped


def test_stop_matcher_cuts_at_the_earliest_stop() -> None:
    matcher = StopMatcher(["cd", "b"])
    assert matcher.feed("abcd") == "a"


# --- happy paths -----------------------------------------------------------------------------------


async def test_models_and_health(client: openai.OpenAI, http: httpx2.AsyncClient) -> None:
    models = await in_thread(client.models.list)
    assert [m.id for m in models.data] == [MODEL, "slow", "tooler"]
    assert models.data[0].owned_by == "meshd"
    assert (await in_thread(client.models.retrieve, MODEL)).id == MODEL
    assert (await http.get("/healthz")).json() == {"status": "ok"}


async def test_chat_non_streaming(client: openai.OpenAI, server: tuple[FakeBackend, str]) -> None:
    completion = await in_thread(
        client.chat.completions.create,
        model=MODEL,
        messages=[{"role": "user", "content": "say hello please"}],
        seed=7,
        temperature=0.5,
        top_p=0.9,
    )
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == FULL_TEXT
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, len(TOKENS))
    assert completion.usage.total_tokens == 3 + len(TOKENS)
    req = server[0].requests[-1]
    assert (req.kind, req.seed, req.temperature, req.top_p, req.stream) == ("chat", 7, 0.5, 0.9, False)
    assert req.messages == [{"role": "user", "content": "say hello please"}]


async def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    chunks = await stream_all(
        client.chat.completions.create,
        model=MODEL,
        messages=[{"role": "user", "content": "say hello please"}],
        stream_options={"include_usage": True},
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == FULL_TEXT
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(TOKENS)
    assert chunks[-1].usage.total_tokens == 3 + len(TOKENS)


async def test_stream_ends_with_done_and_no_usage_unless_asked(http: httpx2.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in events[:-1])


async def test_completions_non_streaming_and_streaming(client: openai.OpenAI, server: tuple[FakeBackend, str]) -> None:
    completion = await in_thread(client.completions.create, model=MODEL, prompt="once upon a time", max_tokens=4)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == "Hello, world"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (4, 4)
    assert server[0].requests[-1].max_tokens == 4
    assert server[0].requests[-1].prompt == "once upon a time"

    chunks = await stream_all(
        client.completions.create, model=MODEL, prompt="once upon a time", stream_options={"include_usage": True}
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == FULL_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(TOKENS)


async def test_max_tokens_reaches_backend_and_gives_length(
    client: openai.OpenAI, server: tuple[FakeBackend, str]
) -> None:
    completion = await in_thread(
        client.chat.completions.create, model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert completion.choices[0].message.content == "Hello, wo"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    assert server[0].requests[-1].max_tokens == 3


# --- stop sequences --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "text", "tokens"),
    [
        (["world"], "Hello, ", 4),  # split across " wo" + "rld"
        ("!", FULL_TEXT, len(TOKENS)),  # never appears: untouched, ends on EOS
        (["?", "u?"], "Hello, world 😀 How are yo", len(TOKENS)),  # the earlier of two overlapping stops
        ([",", "😀"], "Hello", 2),
    ],
)
async def test_stop_sequences(
    client: openai.OpenAI, server: tuple[FakeBackend, str], stop: list[str] | str, text: str, tokens: int
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    completion = await in_thread(client.chat.completions.create, model=MODEL, messages=messages, stop=stop)
    assert completion.choices[0].message.content == text
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (1, tokens)

    chunks = await stream_all(client.chat.completions.create, model=MODEL, messages=messages, stop=stop)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert server[0].open_generations == 0


async def test_stop_cut_closes_the_backend_generation(
    server: tuple[FakeBackend, str], http: httpx2.AsyncClient
) -> None:
    response = await http.post("/v1/completions", json={"model": "slow", "prompt": "x", "stop": "tick tick"})
    assert response.json()["choices"][0] == {"index": 0, "text": " ", "logprobs": None, "finish_reason": "stop"}
    assert server[0].closed.is_set() and server[0].open_generations == 0


# --- errors ----------------------------------------------------------------------------------------


async def test_invalid_json_is_400(http: httpx2.AsyncClient) -> None:
    response = await http.post(
        "/v1/chat/completions", content=b'{"model": "tiny", ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
    response = await http.post("/v1/completions", content=b"[1, 2]")
    assert response.status_code == 400
    await assert_still_serving(http)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(max_tokens=-1), "max_tokens"),
        (chat_body(max_tokens="12"), "max_tokens"),
        (chat_body(max_tokens=1.5), "max_tokens"),
        (chat_body(max_completion_tokens=0), "max_completion_tokens"),
        (chat_body(temperature=2.5), "temperature"),
        (chat_body(temperature="hot"), "temperature"),
        (chat_body(top_p=0), "top_p"),
        (chat_body(n=2), "n"),
        (chat_body(stop=["a", "b", "c", "d", "e"]), "stop"),
        (chat_body(stop=[1]), "stop"),
        (chat_body(seed="x"), "seed"),
        (chat_body(stream="yes"), "stream"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        # the older name is checked too when both are given, and the two must agree
        (chat_body(max_completion_tokens=2, max_tokens="garbage"), "max_tokens"),
        (chat_body(max_completion_tokens=2, max_tokens=-7), "max_tokens"),
        (chat_body(max_completion_tokens=2, max_tokens=3), "max_tokens"),
        # stream_options belongs to a stream
        (chat_body(stream_options={"include_usage": True}), "stream_options"),
        (chat_body(stream=False, stream_options="garbage"), "stream_options"),
        # parameters accepted only in the value that changes nothing must still be of their type
        (chat_body(frequency_penalty=False), "frequency_penalty"),
        (chat_body(presence_penalty="0"), "presence_penalty"),
        (chat_body(logit_bias=0), "logit_bias"),
        (chat_body(store=0), "store"),
        (chat_body(metadata="x"), "metadata"),
    ],
)
async def test_bad_fields_are_400(
    http: httpx2.AsyncClient, server: tuple[FakeBackend, str], body: dict[str, object], param: str
) -> None:
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert server[0].requests == []  # refused before reaching the backend
    await assert_still_serving(http)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"model": "tiny", "max_tokens": ' + b"9" * 5000 + b"}", "cannot be read"),  # past Python's digit limit
        (b'{"model": "tiny", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too deeply"),
    ],
)
async def test_json_python_cannot_hold_is_400(http: httpx2.AsyncClient, server: tuple[FakeBackend, str], raw: bytes,
                                             message: str) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = await http.post(path, content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_json" and message in response.json()["error"]["message"]
    assert server[0].requests == []
    await assert_still_serving(http)


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
         "messages[0].content"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": '
                                 b'[{"type": "text", "text": "ok \\ud83d"}]}]}', "messages[0].content[0].text"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                                 b'"stop": ["\\ud800"]}', "stop[0]"),
        ("/v1/chat/completions", b'{"model": "tiny", "\\ud800": 1}', "the request body"),
    ],
)
async def test_unpaired_surrogates_are_400(http: httpx2.AsyncClient, server: tuple[FakeBackend, str], path: str,
                                           raw: bytes, param: str) -> None:
    response = await http.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value") and "surrogate" in error["message"]
    assert server[0].requests == []
    # a surrogate pair escaped the same way is text, and reaches the backend
    fine = b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 1}'
    response = await http.post("/v1/completions", content=fine, headers={"content-type": "application/json"})
    assert response.status_code == 200 and server[0].requests[-1].prompt == "\U0001f600"


async def test_errors_carry_the_request_id(http: httpx2.AsyncClient) -> None:
    ids = []
    for body in (chat_body(n=2), {**chat_body(), "model": "boom"}, {**chat_body(stream=True), "model": "partial"}):
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code >= 400
        ids.append(response.headers["x-request-id"])
    assert len(set(ids)) == 3 and all(len(i) == 32 for i in ids)


async def test_bad_completion_prompt_and_unknown_fields(http: httpx2.AsyncClient) -> None:
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "frobnicate": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "frobnicate"
    assert "Unrecognized request argument" in response.json()["error"]["message"]


async def test_unknown_model_is_404(client: openai.OpenAI, http: httpx2.AsyncClient) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await in_thread(client.chat.completions.create, model="nope", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        await stream_all(client.chat.completions.create, model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        await in_thread(client.models.retrieve, "nope")
    await assert_still_serving(http)


async def test_no_route_is_503_with_ranges_and_retry_after(http: httpx2.AsyncClient) -> None:
    for stream in (False, True):
        response = await http.post("/v1/chat/completions", json={**chat_body(stream=stream), "model": "partial"})
        assert response.status_code == 503
        assert response.headers["retry-after"] == "5"
        error = response.json()["error"]
        assert error["code"] == "no_route"
        assert "[4, 8)" in error["message"] and "[12, 16)" in error["message"]
    response = await http.post("/v1/completions", json={"model": "busy", "prompt": "hi"})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "overloaded"
    await assert_still_serving(http)


async def test_unexpected_backend_error_is_500_without_details(http: httpx2.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", json={**chat_body(), "model": "boom"})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert "secret" not in response.text
    await assert_still_serving(http)


async def test_error_after_the_stream_started_is_an_sse_error(
    client: openai.OpenAI, server: tuple[FakeBackend, str], http: httpx2.AsyncClient
) -> None:
    with pytest.raises(openai.APIError) as caught:
        await stream_all(client.chat.completions.create, model="breaks", messages=[{"role": "user", "content": "hi"}])
    assert "[0, 2)" in caught.value.message
    response = await http.post("/v1/chat/completions", json={**chat_body(), "model": "breaks"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_route"
    assert server[0].open_generations == 0
    await assert_still_serving(http)


async def test_unknown_route_and_method_are_openai_shaped(http: httpx2.AsyncClient) -> None:
    response = await http.get("/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()
    response = await http.get("/v1/chat/completions")
    assert response.status_code == 405 and "error" in response.json()


async def test_oversized_body_is_413(nursery: trio.Nursery) -> None:
    port = await nursery.start(
        lambda task_status: serve_api(FakeBackend(), max_body_bytes=1024, task_status=task_status)
    )
    async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 2048})
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "payload_too_large"
        await assert_still_serving(http)


# --- lifecycle -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_closes_the_generation(server: tuple[FakeBackend, str], stream: bool) -> None:
    backend, url = server
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": "slow", "prompt": "x", "stream": stream}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    connection = await trio.open_tcp_stream("127.0.0.1", port)
    await connection.send_all(head + body)
    with trio.fail_after(5):
        if stream:
            received = b""
            while received.count(b"data: ") < 3:
                received += await connection.receive_some()
            assert received.startswith(b"HTTP/1.1 200")
        else:
            await backend.started.wait()
    await trio.sleep(0.05)
    assert not backend.closed.is_set()
    await connection.aclose()
    with trio.fail_after(10):
        await backend.closed.wait()
    assert backend.open_generations == 0


async def test_serve_api_stops_when_cancelled() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_api, FakeBackend(), "127.0.0.1:0")
        async with httpx2.AsyncClient(timeout=5) as http:
            assert (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
        nursery.cancel_scope.cancel()
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)


class _HeldTailBackend:
    """Two tokens whose second ends inside a UTF-8 character: its bytes' text comes with ``Finished``."""

    def list_models(self):
        return []

    async def generate(self, req):
        yield Started(3)
        yield TokenEvent("caf", 0)
        yield TokenEvent("", 1)
        yield Finished("length", 3, 2, text="é!")


@pytest.mark.parametrize(("stop", "shown", "reason"), [(None, "café!", "length"), (["é"], "caf", "stop")])
async def test_text_held_back_to_the_end_comes_with_finished(stop, shown, reason):
    from meshd.api.openai_server import run_generation

    out: list[str] = []

    async def on_text(text: str, _logprobs: list) -> None:
        out.append(text)

    req = GenerationRequest(model=MODEL, kind="completion", request_id="r", prompt="x", max_tokens=2,
                            stop=stop or [])
    outcome = await run_generation(_HeldTailBackend(), req, on_text)
    assert "".join(out) == shown and outcome.finish_reason == reason and outcome.completion_tokens == 2


# --- nothing accepted and ignored: logprobs, tools, refusals -----------------------------------------


async def test_the_openai_client_receives_logprobs_streamed_and_whole(client: openai.OpenAI) -> None:
    reply = await in_thread(client.chat.completions.create, model=MODEL, max_tokens=4, logprobs=True, top_logprobs=2,
                            messages=[{"role": "user", "content": "hi"}])
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == TOKENS[:4] and [c.logprob for c in content] == [0.0, -0.5, -1.0, -1.5]
    assert [t.token for t in content[1].top_logprobs] == [",", "zz"] and content[1].bytes == [44]
    chunks = await stream_all(client.chat.completions.create, model=MODEL, max_tokens=4, logprobs=True,
                              messages=[{"role": "user", "content": "hi"}])
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == TOKENS[:4] and all(c.top_logprobs == [] for c in streamed)
    legacy = await in_thread(client.completions.create, model=MODEL, prompt="hi", max_tokens=3, logprobs=1)
    assert legacy.choices[0].logprobs.tokens == TOKENS[:3]
    assert legacy.choices[0].logprobs.text_offset == [0, 5, 6]
    assert legacy.choices[0].logprobs.top_logprobs == [{"Hello": 0.0}, {",": -0.5}, {" wo": -1.0}]
    plain = await in_thread(client.chat.completions.create, model=MODEL, max_tokens=2,
                            messages=[{"role": "user", "content": "hi"}])
    assert plain.choices[0].logprobs is None


async def test_tool_calls_come_back_in_openais_shape(client: openai.OpenAI, server: tuple[FakeBackend, str]) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    reply = await in_thread(client.chat.completions.create, model="tooler", tools=tools,
                            messages=[{"role": "user", "content": "weather in Oslo?"}])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert server[0].requests[-1].tools == tools
    chunks = await stream_all(client.chat.completions.create, model="tooler", tools=tools,
                              messages=[{"role": "user", "content": "weather in Oslo?"}])
    calls = [c for chunk in chunks if chunk.choices and chunk.choices[0].delta.tool_calls
             for c in chunk.choices[0].delta.tool_calls]
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    none = await in_thread(client.chat.completions.create, model=MODEL, tools=tools, tool_choice="none",
                           max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert none.choices[0].message.content == "Hello," and server[0].requests[-1].tools is None
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    await in_thread(client.chat.completions.create, model=MODEL, max_tokens=1, tools=tools, messages=history)
    sent = server[0].requests[-1].messages
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather" and sent[2]["tool_call_id"] == "c1"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"store": True}, "store"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
async def test_what_cannot_be_honoured_is_refused_not_ignored(http: httpx2.AsyncClient, extra: dict[str, object],
                                                             param: str) -> None:
    response = await http.post("/v1/chat/completions", json=chat_body(**extra))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(("extra", "param"), [({"echo": True}, "echo"), ({"best_of": 3}, "best_of"),
                                              ({"suffix": "x"}, "suffix"), ({"logprobs": 6}, "logprobs"),
                                              ({"tools": []}, "tools"), ({"echo": 0}, "echo"),
                                              ({"best_of": True}, "best_of"), ({"best_of": 1.0}, "best_of"),
                                              ({"suffix": 0}, "suffix"), ({"stream_options": {}}, "stream_options")])
async def test_legacy_completion_parameters_that_cannot_be_honoured_are_refused(
        http: httpx2.AsyncClient, extra: dict[str, object], param: str) -> None:
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


async def test_parameters_asking_for_what_happens_anyway_are_accepted(http: httpx2.AsyncClient) -> None:
    body = chat_body(max_tokens=2, response_format={"type": "text"}, frequency_penalty=0, presence_penalty=0.0,
                     logit_bias={}, n=1, user="alice", service_tier="auto", parallel_tool_calls=True)
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "Hello,"
