"""The API's fidelity on real daemons: log-probabilities from the tail, tools through the model's own
template, limits refused as they should be."""

from __future__ import annotations

import shutil

import httpx2 as httpx
import pytest
import torch
from openai import OpenAI

from meshd.daemon.local_mesh import LocalMesh
from meshd.models.text import TextCodec
from meshd.runtime.chain import LocalChain
from meshd.runtime.shard import Shard
from tests.test_text import TAGGED_TEMPLATE

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What do the layers say?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": CITY}}]
REFUSES_SYSTEM = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"


@pytest.fixture(scope="module")
def tools_model(tiny_model, tmp_path_factory):
    target = tmp_path_factory.mktemp("models") / "tiny-tools"
    shutil.copytree(tiny_model, target)
    # the template refuses a system message, as many real ones do (Mistral's, Gemma's)
    (target / "chat_template.jinja").write_text(REFUSES_SYSTEM + TAGGED_TEMPLATE)
    return target


@pytest.fixture(scope="module")
def mesh(tiny_model, tools_model, tmp_path_factory):
    with LocalMesh(tmp_path_factory.mktemp("api-mesh")) as m:
        m.start_peers([dict(model=tiny_model, layers=(0, 4)), dict(model=tools_model, layers=(0, 4))])
        m.wait_until(lambda: {"tiny", "tiny-tools"} <= set(m.peers[0].get("/status")["models_covered"]), 60,
                     "both models covered")
        yield m


def client(mesh) -> OpenAI:
    return OpenAI(base_url=f"http://{mesh.peers[0].api}/v1", api_key="x", timeout=60, max_retries=0)


def test_the_openai_client_receives_the_tails_logprobs(mesh, tiny_model):
    codec = TextCodec.load(tiny_model)
    prompt = codec.encode_chat(QUESTION)
    ref = LocalChain([Shard(tiny_model, 0, 4, keep_logits=True)]).generate(prompt, 6)
    expected = [float(torch.log_softmax(lg.double(), -1)[t]) for lg, t in zip(ref.logits, ref.tokens, strict=True)]
    reply = client(mesh).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [codec.token_text(t) for t in ref.tokens]
    assert [c.logprob for c in content] == pytest.approx(expected, abs=1e-5)
    for entry, logits in zip(content, ref.logits, strict=True):
        best = torch.topk(torch.log_softmax(logits.double(), -1), 3)
        assert [t.token for t in entry.top_logprobs] == [codec.token_text(int(i)) for i in best.indices]
        assert entry.top_logprobs[0].logprob >= entry.logprob  # greedy: the chosen token is the most likely
    streamed = [c for chunk in client(mesh).chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, stream=True,
        extra_body={"ignore_eos": True}) if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx(expected, abs=1e-5)


def test_tools_reach_a_template_that_takes_them_and_are_refused_by_one_that_does_not(mesh):
    with_tools = client(mesh).chat.completions.create(model="tiny-tools", messages=QUESTION, tools=TOOLS,
                                                      max_tokens=2, temperature=0)
    without = client(mesh).chat.completions.create(model="tiny-tools", messages=QUESTION, max_tokens=2,
                                                   temperature=0)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens  # the tool list is in the prompt
    response = httpx.post(f"http://{mesh.peers[0].api}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": QUESTION, "tools": TOOLS, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 5000}, "max_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
])
def test_limits_and_unsupported_parameters_are_refused(mesh, body, param):
    response = httpx.post(f"http://{mesh.peers[0].api}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": QUESTION, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_what_the_model_cannot_take_is_a_400_not_a_failed_route(mesh, tiny_model):
    """A chat its template refuses, and a prompt of no tokens, are the request's fault: a 400 at once,
    not route repairs and a 503 the client would retry."""
    api = f"http://{mesh.peers[0].api}/v1"
    system = [{"role": "system", "content": "Be brief."}, *QUESTION]
    response = httpx.post(f"{api}/chat/completions", timeout=60,
                          json={"model": "tiny-tools", "messages": system, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "System role not supported" in error["message"]
    assert TextCodec.load(tiny_model).encode_text("") == []  # the tiny model adds no start token
    for stream in (False, True):
        response = httpx.post(f"{api}/completions", timeout=60,
                              json={"model": "tiny", "prompt": "", "max_tokens": 2, "stream": stream})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt" and "no tokens" in response.json()["error"]["message"]
    reply = client(mesh).chat.completions.create(model="tiny-tools", messages=QUESTION, max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2
