"""Tiny random configs, one or more per architecture adapter, built from transformers' config classes.

Each exercises what makes its family differ from plain Llama: rope scaling and tied embeddings
(Llama 3.2), biases (Qwen2), q/k norms and a head size apart from hidden/heads (Qwen3), fused
projections and a sliding window (Phi-3), scaled embeddings, extra norms, soft caps and alternating
sliding-window layers (Gemma 2 and 3), experts (Qwen3-MoE). Sliding windows are shorter than the
test sequences, so they bind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from transformers import PretrainedConfig

from meshd.models.builtin import BUILTIN_MODELS, make_config

TINY = BUILTIN_MODELS["tiny"]
GEMMA_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

ARCHS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: make_config("llama", TINY),
    "llama3": lambda: make_config(
        "llama", replace(TINY, tie_embeddings=True),
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": lambda: make_config("mistral", TINY, sliding_window=None),
    "mistral-window": lambda: make_config("mistral", TINY, sliding_window=12),
    "qwen2": lambda: make_config("qwen2", replace(TINY, tie_embeddings=True)),
    "qwen3": lambda: make_config("qwen3", TINY, head_dim=32),
    "phi3": lambda: make_config("phi3", TINY, sliding_window=12, resid_pdrop=0.0, embd_pdrop=0.0,
                                attention_dropout=0.0),
    "gemma2": lambda: make_config("gemma2", replace(TINY, tie_embeddings=True), head_dim=16, sliding_window=8,
                                  layer_types=GEMMA_TYPES, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                                  final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3": lambda: make_config("gemma3_text", replace(TINY, tie_embeddings=True), head_dim=16, sliding_window=8,
                                  layer_types=GEMMA_TYPES, query_pre_attn_scalar=16,
                                  hidden_activation="gelu_pytorch_tanh"),
    "qwen3-moe": lambda: make_config("qwen3_moe", TINY, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[2],
                                     norm_topk_prob=True),
}
