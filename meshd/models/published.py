"""Random-weight checkpoints with the exact shapes of models people run, written on the machine.

Llama-3.2-1B, Qwen2.5-0.5B, Qwen3-0.6B and Gemma-2-2B as their repositories lay them out: a
config with the published dimensions, rope settings and tied embeddings; bf16 weights in sharded
safetensors files with an index; a tokenizer of the published vocabulary size with the family's
special tokens at their ids, a chat template in the family's manner, and a generation config that
lists every id that ends a turn. The weights are random (nothing is downloaded), so these test
loading, splitting, memory and speed at real sizes, not what a model says.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from meshd.models.builtin import ProgressFn, write_model
from meshd.models.tokenizer import TokenizerLayout
from meshd.runtime.adapters import registry

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nYou may call a function, answering "
    "with JSON {\"name\": ..., \"parameters\": ...}. Functions: {{ tools | tojson }}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nFunctions you may call:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

_LLAMA3 = TokenizerLayout(
    specials=(("<|begin_of_text|>", 128000), ("<|end_of_text|>", 128001), ("<|start_header_id|>", 128006),
              ("<|end_header_id|>", 128007), ("<|eom_id|>", 128008), ("<|eot_id|>", 128009),
              ("<|python_tag|>", 128010), ("<|finetune_right_pad_id|>", 128004)),
    bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", chat_template=LLAMA3_TEMPLATE,
    stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
)
_QWEN = TokenizerLayout(
    specials=(("<|endoftext|>", 151643), ("<|im_start|>", 151644), ("<|im_end|>", 151645),
              ("<tool_call>", 151657), ("</tool_call>", 151658)),
    bos="<|im_start|>", eos="<|im_end|>", pad="<|endoftext|>", chat_template=QWEN_TEMPLATE,
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
)
_QWEN3 = TokenizerLayout(specials=_QWEN.specials, bos=_QWEN.bos, eos=_QWEN.eos, pad=_QWEN.pad,
                         chat_template=QWEN_TEMPLATE, template_file=True, stop_tokens=_QWEN.stop_tokens)
_GEMMA = TokenizerLayout(
    specials=(("<pad>", 0), ("<eos>", 1), ("<bos>", 2), ("<unk>", 3), ("<start_of_turn>", 106), ("<end_of_turn>", 107)),
    bos="<bos>", eos="<eos>", pad="<pad>", chat_template=GEMMA_TEMPLATE, stop_tokens=("<eos>", "<end_of_turn>"),
)


@dataclass(frozen=True)
class PublishedShape:
    name: str
    model_type: str
    layout: TokenizerLayout
    config: dict[str, Any]
    weight_files: int

    def make_config(self) -> PretrainedConfig:
        ids = dict(self.layout.specials)
        config = AutoConfig.for_model(self.model_type, bos_token_id=ids[self.layout.bos],
                                      eos_token_id=ids[self.layout.eos], pad_token_id=ids[self.layout.pad],
                                      **self.config)
        config.architectures = [registry()[self.model_type].architecture]
        return config


PUBLISHED: dict[str, PublishedShape] = {s.name: s for s in [
    PublishedShape("llama-3.2-1b", "llama", _LLAMA3, dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}), weight_files=2),
    PublishedShape("qwen2.5-0.5b", "qwen2", _QWEN, dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None, use_sliding_window=False), weight_files=1),
    PublishedShape("qwen3-0.6b", "qwen3", _QWEN3, dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), weight_files=2),
    PublishedShape("gemma-2-2b", "gemma2", _GEMMA, dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, max_position_embeddings=8192, rms_norm_eps=1e-6,
        tie_word_embeddings=True, sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh"), weight_files=3),
]}


def write_published(name: str, out_dir: Path, progress: ProgressFn | None = None,
                    dtype: torch.dtype = torch.bfloat16, seed: int = 11) -> Path:
    """Write the random-weight checkpoint of ``name`` (one of :data:`PUBLISHED`) into ``out_dir``."""
    shape = PUBLISHED[name]
    return write_model(Path(out_dir), shape.make_config(), seed, shape.weight_files, progress, dtype=dtype,
                       layout=shape.layout)
