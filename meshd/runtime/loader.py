"""Read a Hugging Face model directory and load only the tensors a shard owns.

The checkpoint's index (or single file) tells which file holds each tensor; tensors are read one by
one with safetensors, so a shard never materialises layers, embeddings or heads it does not own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from meshd.errors import ModelFormatError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_config(model_dir: Path) -> PretrainedConfig:
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelFormatError(f"{model_dir} has no config.json; is it a Hugging Face model directory?")
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    config._attn_implementation = "sdpa"
    return config


class CheckpointIndex:
    """Where each tensor of a safetensors checkpoint lives."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / INDEX_FILE
        single = self.model_dir / SINGLE_FILE
        if index.is_file():
            doc = json.loads(index.read_text())
            self.files = {name: self.model_dir / f for name, f in doc["weight_map"].items()}
        elif single.is_file():
            with safe_open(str(single), framework="pt") as f:
                self.files = {name: single for name in f.keys()}  # noqa: SIM118 - safe_open has no iterator
        else:
            raise ModelFormatError(f"{self.model_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names_with_prefix(self, prefix: str) -> list[str]:
        return sorted(n for n in self.files if n.startswith(prefix))

    def load(self, names: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Read the named tensors (and nothing else), grouped by file."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self.files:
                raise ModelFormatError(f"tensor {name!r} is not in the checkpoint at {self.model_dir}")
            by_file.setdefault(self.files[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, file_names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name in file_names:
                    # Copy out of the file mapping: the shard owns its weights, and a model file
                    # replaced on disk while the peer runs cannot pull pages from under it.
                    out[name] = f.get_tensor(name).to(dtype).clone()
        return out
