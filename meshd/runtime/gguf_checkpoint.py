"""Read the tensors of a layer range from a GGUF file, dequantized into the shard's dtype.

This is the portable path for GGUF models: a torch shard holds its own range of a GGUF file exactly
as it holds a range of a safetensors checkpoint. The file is memory-mapped (``gguf.GGUFReader``), so a
peer touches only the bytes of the tensors it loads; each is checked against the weights manifest,
dequantized with the ``gguf`` package, and given back under its Hugging Face name, with the
family's GGUF conventions undone by transformers' own tensor processors (llama.cpp's rotary row
order for query and key, Gemma's offset norms). The config and tokenizer come from the GGUF
metadata through transformers (:mod:`meshd.models.gguf_model` writes them next to the file's link).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshd.errors import ModelFormatError
from meshd.runtime.manifest import Manifest, TensorEntry, tensor_digest, verify_tensor

GGUF_FILE = "model.gguf"  # the link to the GGUF file inside a GGUF model's directory
SUPPORTED = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # model_type -> GGUF arch


def open_gguf(path: Path) -> Any:
    """A memory-mapped reader of ``path``; a truncated or malformed file is a clear error."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ModelFormatError(f"{path} is not a readable GGUF file (truncated or malformed): {exc}") from None


def quantization_of(reader: Any) -> str:
    """The file's quantization as people name it (``q8_0``, ``q4_k_m``, ``f16`` ...)."""
    import gguf

    field = reader.fields.get("general.file_type")
    if field is None:
        return "unknown"
    try:
        name = gguf.LlamaFileType(int(field.parts[-1][0])).name
    except ValueError:
        return "unknown"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def raw_bytes(t: Any) -> np.ndarray:
    """A GGUF tensor's bytes as stored (quantized blocks included), flat."""
    return np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)


def checked_tensor(t: Any, manifest: Manifest | None) -> Any:
    """``t`` once its bytes are what ``manifest`` lists for it (no check without a manifest)."""
    if manifest is not None:
        entry = manifest.tensors.get(str(t.name))
        if entry is None:
            raise ModelFormatError(f"tensor {t.name!r} is not in the checkpoint's manifest")
        verify_tensor(entry, raw_bytes(t).data)
    return t


def hash_gguf(path: Path) -> list[TensorEntry]:
    """Every tensor of a GGUF file with its stored type, shape (Hugging Face order) and byte hash."""
    reader = open_gguf(path)
    entries = []
    for t in reader.tensors:
        raw = raw_bytes(t)
        if raw.size != int(t.n_bytes):
            raise ModelFormatError(f"{path} is truncated inside tensor {t.name!r}")
        digest, chunks = tensor_digest(raw.data)
        entries.append(TensorEntry(str(t.name), t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                                   digest, int(t.n_bytes), chunks))
    return entries


class GgufIndex:
    """The tensors of a GGUF model under their Hugging Face names, read one by one as asked."""

    def __init__(self, model_dir: Path, manifest: Manifest | None = None) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        from meshd.runtime.loader import load_config

        self.model_dir = Path(model_dir)
        self.path = self.model_dir / GGUF_FILE
        self.manifest = manifest
        self.reader = open_gguf(self.path)
        config = load_config(self.model_dir)
        arch = SUPPORTED.get(config.model_type)
        if arch is None:
            raise ModelFormatError(f"GGUF models of type {config.model_type} are not read by meshd; "
                                   f"read: {', '.join(sorted(SUPPORTED))}")
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        to_hf = get_gguf_hf_weights_map(skeleton, self.processor, model_type=arch)
        self.tensors: dict[str, Any] = {}
        for t in self.reader.tensors:
            hf = to_hf.get(str(t.name))
            if hf is None:
                continue  # tables llama.cpp keeps that a torch shard does not use (rope_freqs ...)
            self.tensors[hf] = t
        self.files = {name: self.path for name in self.tensors}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names_with_prefix(self, prefix: str) -> list[str]:
        return sorted(n for n in self.tensors if n.startswith(prefix))

    def entry(self, name: str) -> dict[str, object]:
        t = self.tensors[name]
        return {"dtype": t.tensor_type.name, "shape": [int(d) for d in reversed(t.shape)], "nbytes": int(t.n_bytes)}

    def load(self, names: Iterable[str], dtype: torch.dtype,
             device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The named tensors (and nothing else), dequantized, as ``dtype`` on ``device``."""
        from gguf import quants

        out: dict[str, torch.Tensor] = {}
        for name in sorted(names):
            t = self.tensors.get(name)
            if t is None:
                raise ModelFormatError(f"tensor {name!r} is not in the GGUF file {self.path.name}")
            data = checked_tensor(t, self.manifest).data
            try:
                weights = quants.dequantize(data, t.tensor_type)
            except NotImplementedError:
                raise ModelFormatError(f"tensor {t.name!r} is stored as {t.tensor_type.name}, which meshd "
                                       "cannot dequantize") from None
            weights = self.processor.process(weights, str(t.name)).weights
            # a copy, into torch's memory (see loader.ALIGNMENT): the reader's arrays are read-only
            # views of the mapped file
            tensor = torch.empty(weights.shape, dtype=torch.float32)
            np.copyto(tensor.numpy(), weights)
            out[name] = tensor.to(dtype=dtype, device=device)
        return out
