"""Architecture adapters: the explicit list of model families a shard knows how to run.

An adapter is a small table of names and quirks over transformers' own modules: which module
defines the family, its class-name prefix (``Llama`` -> ``LlamaDecoderLayer``, ``LlamaRMSNorm``,
``LlamaRotaryEmbedding``), and what differs from plain Llama: a scaled embedding (Gemma), rotary
tables per layer type (Gemma 3), a soft cap on the logits (Gemma 2), attention that needs the eager
kernel (attention soft-capping), or checkpoints that store mixture-of-experts weights per expert
while the module holds them stacked. Which layers use a sliding window comes from the config
(``layer_types``, else ``sliding_window`` for every layer). A model whose architecture is not
listed is refused with a clear message: a shard never runs a model it only half understands.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from meshd.errors import ModelFormatError, UnsupportedArchitecture

SLIDING = "sliding_attention"

StateConverter = Callable[[dict[str, torch.Tensor], PretrainedConfig], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class ArchitectureAdapter:
    name: str
    model_type: str
    architecture: str          # the ``architectures`` entry of config.json
    module: str                # transformers.models.<module>.modeling_<module>
    prefix: str                # class-name prefix of the family's modules
    scaled_embedding: str | None = None      # class of an embedding that multiplies by sqrt(hidden)
    rotary_per_layer_type: bool = False      # one rotary table per layer type (local/global)
    eager_attention: bool = False            # attention soft-capping: sdpa would silently skip it
    checkpoint_layer: StateConverter | None = None  # checkpoint layout -> the module's parameters
    module_layer: StateConverter | None = None      # the module's parameters -> checkpoint layout
    embed_tensor: str = "model.embed_tokens.weight"
    norm_tensor: str = "model.norm.weight"
    lm_head_tensor: str = "lm_head.weight"
    layer_prefix: str = "model.layers."

    def _modeling(self) -> ModuleType:
        return importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")

    def _class(self, suffix: str) -> Any:
        return getattr(self._modeling(), f"{self.prefix}{suffix}")

    def layer_tensor_prefix(self, layer: int) -> str:
        return f"{self.layer_prefix}{layer}."

    def kv_heads_and_dim(self, config: PretrainedConfig) -> tuple[int, int]:
        """Key/value heads and head size of one attention layer: what one token's KV takes per layer."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return int(kv_heads), int(head_dim)

    def attention_implementation(self, config: PretrainedConfig) -> str:
        softcapped = getattr(config, "attn_logit_softcapping", None) is not None
        return "eager" if self.eager_attention and softcapped else "sdpa"

    def sliding_window_of(self, config: PretrainedConfig, layer: int) -> int | None:
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            return int(window) if layer_types[layer] == SLIDING and window else None
        return int(window) if window else None

    def layer_type_of(self, config: PretrainedConfig, layer: int) -> str:
        """Which rotary table a layer uses (only Gemma 3 has more than one)."""
        layer_types = getattr(config, "layer_types", None)
        return str(layer_types[layer]) if self.rotary_per_layer_type and layer_types else "full_attention"

    def decoder_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        module: nn.Module = self._class("DecoderLayer")(config, layer_idx=layer_idx)
        return module

    def norm(self, config: PretrainedConfig) -> nn.Module:
        module: nn.Module = self._class("RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
        return module

    def rotary_embedding(self, config: PretrainedConfig) -> nn.Module:
        module: nn.Module = self._class("RotaryEmbedding")(config=config)
        return module

    def position_embeddings(self, rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor,
                            layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary_per_layer_type:
            cos_sin: tuple[torch.Tensor, torch.Tensor] = rotary(hidden, position_ids, layer_type)
        else:
            cos_sin = rotary(hidden, position_ids)
        return cos_sin

    def embedding(self, config: PretrainedConfig, weight: torch.Tensor) -> nn.Module:
        """The token embedding over ``weight`` (frozen), scaled as the family scales it."""
        if self.scaled_embedding is None:
            return nn.Embedding.from_pretrained(weight, freeze=True, padding_idx=None)
        cls = getattr(self._modeling(), self.scaled_embedding)
        with torch.device("meta"):
            module: nn.Module = cls(config.vocab_size, config.hidden_size, config.pad_token_id,
                                    embed_scale=config.hidden_size**0.5)
        module.weight = nn.Parameter(weight, requires_grad=False)
        module.embed_scale = torch.tensor(config.hidden_size**0.5)
        return module

    def logits(self, config: PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's output as the family's CausalLM returns it (soft-capped where it caps)."""
        cap = getattr(config, "final_logit_softcapping", None)
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def layer_state(self, state: dict[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
        """One layer's tensors as read from the checkpoint -> as its module's parameters."""
        return state if self.checkpoint_layer is None else self.checkpoint_layer(state, config)


# -- mixture of experts: per-expert tensors in checkpoints, stacked tensors in the modules ---------------

_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _stack_experts(state: dict[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
    experts: dict[int, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    if not experts:
        return out  # already stacked (a checkpoint written in the module layout)
    n = int(config.num_experts)
    if sorted(experts) != list(range(n)) or any(len(parts) != 3 for parts in experts.values()):
        raise ModelFormatError(f"a mixture-of-experts layer needs gate, up and down tensors of all {n} experts")
    ordered = [experts[e] for e in range(n)]
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"], p["up_proj"]], dim=0) for p in ordered])
    out["mlp.experts.down_proj"] = torch.stack([p["down_proj"] for p in ordered])
    return out


def _split_experts(state: dict[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "mlp.experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"mlp.experts.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"mlp.experts.{e}.up_proj.weight"] = up[e].contiguous()
        elif name == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor
    return out


def _build_registry() -> dict[str, ArchitectureAdapter]:
    adapters = [
        ArchitectureAdapter(name="Llama", model_type="llama", architecture="LlamaForCausalLM", module="llama",
                            prefix="Llama"),
        ArchitectureAdapter(name="Mistral", model_type="mistral", architecture="MistralForCausalLM",
                            module="mistral", prefix="Mistral"),
        ArchitectureAdapter(name="Qwen2", model_type="qwen2", architecture="Qwen2ForCausalLM", module="qwen2",
                            prefix="Qwen2"),
        ArchitectureAdapter(name="Qwen3", model_type="qwen3", architecture="Qwen3ForCausalLM", module="qwen3",
                            prefix="Qwen3"),
        ArchitectureAdapter(name="Phi-3", model_type="phi3", architecture="Phi3ForCausalLM", module="phi3",
                            prefix="Phi3"),
        ArchitectureAdapter(name="Gemma 2", model_type="gemma2", architecture="Gemma2ForCausalLM", module="gemma2",
                            prefix="Gemma2", scaled_embedding="Gemma2TextScaledWordEmbedding",
                            eager_attention=True),
        ArchitectureAdapter(name="Gemma 3", model_type="gemma3_text", architecture="Gemma3ForCausalLM",
                            module="gemma3", prefix="Gemma3", scaled_embedding="Gemma3TextScaledWordEmbedding",
                            rotary_per_layer_type=True, eager_attention=True),
        ArchitectureAdapter(name="Qwen3-MoE", model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
                            module="qwen3_moe", prefix="Qwen3Moe", checkpoint_layer=_stack_experts,
                            module_layer=_split_experts),
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
