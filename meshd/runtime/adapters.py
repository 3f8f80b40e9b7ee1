"""Architecture adapters: the explicit list of model families a shard knows how to run.

An adapter names the transformers building blocks of one architecture (decoder layer, norm,
rotary embedding), where its tensors live in a checkpoint, and which layers use sliding-window
attention. A model whose architecture is not listed here is refused with a clear message: a shard
never runs a model it only half understands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from meshd.errors import UnsupportedArchitecture


@dataclass(frozen=True)
class ArchitectureAdapter:
    name: str
    model_type: str
    architecture: str
    decoder_layer: type[nn.Module]
    norm: type[nn.Module]
    rotary_embedding: type[nn.Module]
    sliding_window_of: Callable[[PretrainedConfig, int], int | None]
    embed_tensor: str = "model.embed_tokens.weight"
    norm_tensor: str = "model.norm.weight"
    lm_head_tensor: str = "lm_head.weight"
    layer_prefix: str = "model.layers."

    def layer_tensor_prefix(self, layer: int) -> str:
        return f"{self.layer_prefix}{layer}."

    def kv_heads_and_dim(self, config: PretrainedConfig) -> tuple[int, int]:
        """Key/value heads and head size of one attention layer: what one token's KV takes per layer."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return int(kv_heads), int(head_dim)


def _no_window(_config: PretrainedConfig, _layer: int) -> int | None:
    return None


def _mistral_window(config: PretrainedConfig, _layer: int) -> int | None:
    return getattr(config, "sliding_window", None)


def _qwen2_window(config: PretrainedConfig, layer: int) -> int | None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[layer] == "sliding_attention":
        return config.sliding_window
    return None


def _build_registry() -> dict[str, ArchitectureAdapter]:
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    adapters = [
        ArchitectureAdapter(
            name="Llama", model_type="llama", architecture="LlamaForCausalLM",
            decoder_layer=llama.LlamaDecoderLayer, norm=llama.LlamaRMSNorm,
            rotary_embedding=llama.LlamaRotaryEmbedding, sliding_window_of=_no_window,
        ),
        ArchitectureAdapter(
            name="Mistral", model_type="mistral", architecture="MistralForCausalLM",
            decoder_layer=mistral.MistralDecoderLayer, norm=mistral.MistralRMSNorm,
            rotary_embedding=mistral.MistralRotaryEmbedding, sliding_window_of=_mistral_window,
        ),
        ArchitectureAdapter(
            name="Qwen2", model_type="qwen2", architecture="Qwen2ForCausalLM",
            decoder_layer=qwen2.Qwen2DecoderLayer, norm=qwen2.Qwen2RMSNorm,
            rotary_embedding=qwen2.Qwen2RotaryEmbedding, sliding_window_of=_qwen2_window,
        ),
    ]
    return {a.model_type: a for a in adapters}


_REGISTRY: dict[str, ArchitectureAdapter] | None = None


def registry() -> dict[str, ArchitectureAdapter]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _build_registry()
    return _REGISTRY


def supported_architectures() -> list[str]:
    return [a.architecture for a in registry().values()]


def adapter_for(config: PretrainedConfig) -> ArchitectureAdapter:
    """The adapter for a model config, or :class:`UnsupportedArchitecture`."""
    model_type = getattr(config, "model_type", None)
    archs = list(getattr(config, "architectures", None) or [])
    adapter = registry().get(model_type or "")
    if adapter is None or (archs and archs != [adapter.architecture]):
        shown = ", ".join(archs) or model_type or "unknown"
        raise UnsupportedArchitecture(
            f"architecture {shown} is not supported; supported: {', '.join(supported_architectures())}"
        )
    return adapter
