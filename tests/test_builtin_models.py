"""Built-in models: deterministic, ordinary Hugging Face directories, loadable offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshd.errors import UnsupportedArchitecture
from meshd.models.builtin import BUILTIN_MODELS, create_builtin, directory_digest
from meshd.runtime.adapters import adapter_for, supported_architectures
from meshd.runtime.loader import load_config
from meshd.runtime.shard import Shard


def test_tiny_is_byte_identical_every_time(tiny_model, tmp_path):
    again = create_builtin("tiny", tmp_path / "tiny-again")
    assert directory_digest(again) == directory_digest(tiny_model)
    names = sorted(p.name for p in tiny_model.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]


def test_tiny_loads_with_plain_transformers(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    spec = BUILTIN_MODELS["tiny"]
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads)
    assert len(tok) == cfg.vocab_size
    text = "héllo, mesh ✓"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|begin|><|user|>\nhi<|end|>\n<|assistant|>\n"


def test_refuses_to_overwrite_without_force(tiny_model, tmp_path):
    with pytest.raises(FileExistsError):
        create_builtin("tiny", tiny_model)
    with pytest.raises(ValueError, match="choose one of"):
        create_builtin("huge", tmp_path / "x")


def test_unsupported_architecture_is_refused(tiny_model, tmp_path):
    doc = json.loads((tiny_model / "config.json").read_text())
    doc.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    bad = tmp_path / "gpt2"
    bad.mkdir()
    for f in tiny_model.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps(doc))
    with pytest.raises(UnsupportedArchitecture) as info:
        Shard(bad, 0, 1)
    for name in supported_architectures():
        assert name in str(info.value)
    assert set(supported_architectures()) == {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
        "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"}


def test_mismatched_architecture_name_is_refused(tiny_model):
    cfg = load_config(tiny_model)
    cfg.architectures = ["LlamaForSequenceClassification"]
    with pytest.raises(UnsupportedArchitecture, match="LlamaForSequenceClassification"):
        adapter_for(cfg)


@pytest.mark.slow
def test_bench_is_deterministic_and_split_into_indexed_files(bench_model, tmp_path):
    files = sorted(p.name for p in bench_model.iterdir())
    assert "model.safetensors.index.json" in files
    weight_files = [f for f in files if f.endswith(".safetensors")]
    assert len(weight_files) == 4
    index = json.loads((bench_model / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(weight_files)
    cfg = json.loads((bench_model / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"]) == (1024, 16, 16, 4, 2816, 32000)
    assert len(AutoTokenizer.from_pretrained(bench_model)) == 32000
    again = create_builtin("bench", tmp_path / "bench-again")
    assert directory_digest(again) == directory_digest(bench_model)


@pytest.mark.slow
def test_bench_range_holds_only_its_own_parameters(bench_model):
    spec = BUILTIN_MODELS["bench"]
    h, kv, i = spec.hidden_size, spec.num_kv_heads * (spec.hidden_size // spec.num_heads), spec.intermediate_size
    layer_bytes = 4 * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)
    shard = Shard(Path(bench_model), 4, 8)
    assert shard.embed is None and shard.lm_head is None and shard.norm is None
    assert shard.parameter_bytes() == 4 * layer_bytes
    total_decoder = spec.num_layers * layer_bytes
    assert shard.parameter_bytes() == pytest.approx(total_decoder / 4)
    head, tail = Shard(Path(bench_model), 0, 1), Shard(Path(bench_model), 15, 16)
    assert head.parameter_bytes() == layer_bytes + 4 * spec.vocab_size * h
    assert tail.parameter_bytes() == layer_bytes + 4 * spec.vocab_size * h + 4 * h
