"""Shared fixtures: built-in and per-architecture tiny models, generated once per test run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from transformers.utils import logging as hf_logging

from meshd.models.builtin import create_builtin, write_model
from tests.archs import ARCHS

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()


@pytest.fixture(scope="session", autouse=True)
def meshd_home(tmp_path_factory) -> Path:
    """Tools that keep files under ``$MESHD_HOME`` (derived GGUF directories, manifests) keep them here."""
    home = tmp_path_factory.mktemp("meshd-home")
    os.environ["MESHD_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return create_builtin("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def adapter_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: write_model(root / name, make(), seed=100 + i)
        for i, (name, make) in enumerate(sorted(ARCHS.items()))
    }


@pytest.fixture(scope="session")
def bench_model(tmp_path_factory) -> Path:
    return create_builtin("bench", tmp_path_factory.mktemp("models") / "bench")
