"""A model's text side: stop tokens from generation_config, templates from chat_template.jinja, tool calls."""

from __future__ import annotations

import json
import shutil

import pytest

from meshd.models.text import TextCodec, ToolFormat

TAGGED_TEMPLATE = (
    "{% if tools %}<|system|>\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
    "Answer a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(tiny_model, target)
    return target


def test_every_end_of_turn_id_in_generation_config_ends_a_reply(model_copy):
    doc = json.loads((model_copy / "generation_config.json").read_text())
    doc["eos_token_id"] = [1, 4]  # "<|end|>" and "<|assistant|>", as Llama 3 lists several
    (model_copy / "generation_config.json").write_text(json.dumps(doc))
    assert TextCodec.load(model_copy).stop_token_ids == {1, 4}


def test_a_chat_template_file_is_the_template_and_tools_reach_it(model_copy):
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_copy / "tokenizer_config.json").write_text(json.dumps(config))
    (model_copy / "chat_template.jinja").write_text(TAGGED_TEMPLATE)
    codec = TextCodec.load(model_copy)
    assert codec.has_chat_template and codec.tool_format == ToolFormat.TAGGED
    messages = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    plain, with_tools = codec.encode_chat(messages), codec.encode_chat(messages, tools)
    assert len(with_tools) > len(plain) and "get_weather" in codec.tokenizer.decode(with_tools)


def test_the_builtin_template_takes_no_tools(tiny_model):
    codec = TextCodec.load(tiny_model)
    assert codec.has_chat_template and codec.tool_format is None
    assert codec.tool_calls('<tool_call>{"name": "f"}</tool_call>') == ('<tool_call>{"name": "f"}</tool_call>', [])


def test_tagged_tool_calls_are_read_back_into_openais_shape(tiny_model):
    codec = TextCodec.load(tiny_model)
    codec.tool_format = ToolFormat.TAGGED
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>')
    content, calls = codec.tool_calls(text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}),
                                                                                  ("get_time", {})]
    assert calls[0].as_openai()["type"] == "function" and calls[0].as_openai()["id"].startswith("call_")
    assert codec.tool_calls("<tool_call>not json</tool_call>")[1] == []
    assert codec.may_be_tool_call("  <tool_") and not codec.may_be_tool_call("Sure, ")


def test_json_tool_calls_are_read_back_into_openais_shape(tiny_model):
    codec = TextCodec.load(tiny_model)
    codec.tool_format = ToolFormat.JSON
    content, calls = codec.tool_calls('<|python_tag|>{"name": "search", "parameters": {"q": "meshd"}}')
    assert content == "" and calls[0].name == "search" and json.loads(calls[0].arguments) == {"q": "meshd"}
    assert codec.tool_calls("plain words")[1] == [] and codec.may_be_tool_call("{")
    assert not codec.may_be_tool_call("plain")


def test_special_tokens_never_reach_the_text(tiny_model):
    codec = TextCodec.load(tiny_model)
    detok = codec.detokenizer()
    ids = [*codec.encode_text("hi"), 1, 4, *codec.encode_text(" there")]
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "hi there"


def test_multi_byte_characters_stream_whole(tiny_model):
    codec = TextCodec.load(tiny_model)
    text = "naïve café 😀 日本"
    ids = codec.encode_text(text)
    detok = codec.detokenizer()
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces)  # some bytes were held back until their character was complete


def test_the_codec_knows_the_models_vocabulary_from_its_config(tiny_model, tmp_path):
    import json as _json

    assert TextCodec.load(tiny_model).vocab_size == _json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    copy = tmp_path / "no-config"
    shutil.copytree(tiny_model, copy)
    (copy / "config.json").unlink()
    assert TextCodec.load(copy).vocab_size is None  # unknown: the entry then refuses only negative ids
