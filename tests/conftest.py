"""Shared fixtures: built-in and per-architecture tiny models, generated once per test run."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from transformers.utils import logging as hf_logging

from meshd.models.builtin import BUILTIN_MODELS, create_builtin, make_config, write_model

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

TINY = BUILTIN_MODELS["tiny"]

# Tiny random configs, one per adapter (and variants that exercise tied embeddings, biases and a
# sliding window shorter than the test sequences).
ADAPTER_MODELS = {
    "llama": lambda: make_config("llama", TINY),
    "mistral": lambda: make_config("mistral", TINY, sliding_window=None),
    "qwen2": lambda: make_config("qwen2", replace(TINY, tie_embeddings=True)),
    "mistral-window": lambda: make_config("mistral", TINY, sliding_window=12),
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return create_builtin("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def adapter_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: write_model(root / name, make(), seed=100 + i)
        for i, (name, make) in enumerate(sorted(ADAPTER_MODELS.items()))
    }


@pytest.fixture(scope="session")
def bench_model(tmp_path_factory) -> Path:
    return create_builtin("bench", tmp_path_factory.mktemp("models") / "bench")
