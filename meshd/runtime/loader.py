"""Read a model directory and load only the tensors a shard owns.

A model directory holds a Hugging Face checkpoint (safetensors files) or, for a GGUF model, a link
to the GGUF file beside the config and tokenizer derived from it (:mod:`meshd.models.gguf_model`);
:func:`open_checkpoint` gives the one reader or the other behind one interface.

The checkpoint's index (or single file) tells which file holds each tensor; tensors are read one by
one, straight from the safetensors data (:mod:`meshd.runtime.manifest` reads the headers), so a
shard never materialises layers, embeddings or heads it does not own. Given the weights manifest, each
tensor's bytes are checked against it as they are read: a file changed or damaged since the compat key
was computed is refused, not served.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PretrainedConfig

from meshd.errors import ModelFormatError
from meshd.runtime.manifest import Manifest, read_header, verify_tensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
                 "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "F64": torch.float64}
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Weights start on a cache line, as torch's own allocations do. oneDNN's GEMMs read them with vector
# loads, and over weights 16 bytes past a 64-byte boundary (where a Python bytearray's or a large numpy
# array's data starts) the bench model's decode steps took 5-14 % longer in one process on a 2-vCPU
# AMD EPYC machine.
ALIGNMENT = 64


def aligned_weights(module: torch.nn.Module) -> int:
    """Give every parameter and buffer of ``module`` whose data does not start on a cache line a copy
    that does (tied weights stay tied); how many were moved. For models loaded by other code
    (transformers' ``from_pretrained`` places about half of a checkpoint's tensors off the line)."""
    moved = 0
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.device.type == "cpu" and tensor.numel() and tensor.data_ptr() % ALIGNMENT:
                tensor.data = tensor.data.clone()
                moved += 1
    return moved


def load_config(model_dir: Path) -> PretrainedConfig:
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelFormatError(f"{model_dir} has no config.json; is it a Hugging Face model directory?")
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError, OSError, TypeError, StrictDataclassError) as exc:  # a field of the wrong type
        raise ModelFormatError(f"{model_dir}/config.json is not a config transformers can read: {exc}") from None
    config._attn_implementation = "sdpa"
    return config


class Checkpoint(Protocol):
    """Where each tensor of a checkpoint lives, and how to read exactly the tensors asked for."""

    files: dict[str, Path]  # tensor name -> the file holding it

    def __contains__(self, name: str) -> bool: ...

    def names_with_prefix(self, prefix: str) -> list[str]: ...

    def entry(self, name: str) -> dict[str, object]: ...

    def load(self, names: Iterable[str], dtype: torch.dtype,
             device: torch.device | str = "cpu") -> dict[str, torch.Tensor]: ...


def is_gguf_model(model_dir: Path) -> bool:
    from meshd.runtime.gguf_checkpoint import GGUF_FILE

    return (Path(model_dir) / GGUF_FILE).exists()


def open_checkpoint(model_dir: Path, manifest: Manifest | None = None) -> Checkpoint:
    """The reader of the directory's weights: its GGUF file, or its safetensors files."""
    if is_gguf_model(model_dir):
        from meshd.runtime.gguf_checkpoint import GgufIndex

        return GgufIndex(model_dir, manifest)
    return SafetensorsIndex(model_dir, manifest)


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, in name order."""
    if is_gguf_model(model_dir):
        from meshd.runtime.gguf_checkpoint import GGUF_FILE

        return [Path(model_dir) / GGUF_FILE]
    return sorted(set(SafetensorsIndex(model_dir).files.values()))


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """The dtype the checkpoint's layer weights are stored in; float32 for quantized GGUF weights,
    which a torch shard dequantizes."""
    index = open_checkpoint(model_dir)
    names = [n for n in index.files if ".layers." in n and n.endswith("proj.weight")] or list(index.files)
    stored = str(index.entry(names[0])["dtype"])
    if is_gguf_model(model_dir):
        return FLOAT_DTYPES.get(stored, torch.float32)
    if stored not in FLOAT_DTYPES:
        raise ModelFormatError(f"{model_dir} stores its weights as {stored}; meshd runs float32, bfloat16 and "
                               "float16 checkpoints")
    return FLOAT_DTYPES[stored]


class SafetensorsIndex:
    """Where each tensor of a safetensors checkpoint lives, and how to read exactly its bytes."""

    def __init__(self, model_dir: Path, manifest: Manifest | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.manifest = manifest
        index = self.model_dir / INDEX_FILE
        single = self.model_dir / SINGLE_FILE
        if index.is_file():
            try:
                doc = json.loads(index.read_text())
                self.files = {str(name): self.model_dir / str(f) for name, f in doc["weight_map"].items()}
            except (ValueError, KeyError, AttributeError) as exc:
                raise ModelFormatError(f"{index} is not a safetensors index: {exc}") from None
            missing = sorted({p.name for p in self.files.values() if not p.is_file()})
            if missing:
                raise ModelFormatError(f"{self.model_dir} lacks weight files its index names: {', '.join(missing)}")
        elif single.is_file():
            header, _ = read_header(single)
            self.files = {name: single for name in header}
        else:
            raise ModelFormatError(f"{self.model_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}")
        self._headers: dict[Path, tuple[dict[str, dict[str, object]], int]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names_with_prefix(self, prefix: str) -> list[str]:
        return sorted(n for n in self.files if n.startswith(prefix))

    def _header(self, path: Path) -> tuple[dict[str, dict[str, object]], int]:
        if path not in self._headers:
            self._headers[path] = read_header(path)
        return self._headers[path]

    def entry(self, name: str) -> dict[str, object]:
        """The tensor's header entry (``dtype``, ``shape``, ``data_offsets``)."""
        header, _ = self._header(self.files[name])
        if name not in header:
            raise ModelFormatError(f"tensor {name!r} is listed in the index but not in {self.files[name].name}")
        return header[name]

    def location(self, name: str) -> tuple[Path, int, int]:
        """The file holding the tensor, where its bytes start in it and how many there are."""
        path = self.files[name]
        _header, data_start = self._header(path)
        begin, end = (int(x) for x in self.entry(name)["data_offsets"])  # type: ignore[attr-defined]
        return path, data_start + begin, end - begin

    def load(self, names: Iterable[str], dtype: torch.dtype,
             device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Read the named tensors (and nothing else) as ``dtype`` on ``device``, checked against the
        manifest when there is one."""
        out: dict[str, torch.Tensor] = {}
        for name in sorted(names, key=lambda n: (str(self.files.get(n, "")), n)):
            if name not in self.files:
                raise ModelFormatError(f"tensor {name!r} is not in the checkpoint at {self.model_dir}")
            info = self.entry(name)
            stored = STORED_DTYPES.get(str(info["dtype"]))
            if stored is None:
                raise ModelFormatError(f"tensor {name!r} is stored as {info['dtype']}, which meshd does not read")
            if dtype.is_floating_point and not stored.is_floating_point:  # read as floats, integers are nonsense
                raise ModelFormatError(f"tensor {name!r} is stored as {info['dtype']}; meshd reads weights stored "
                                       "as floating point (a quantized checkpoint needs its own loader)")
            path, start, nbytes = self.location(name)
            # read straight into torch's memory, which starts on a cache line (see ALIGNMENT)
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            raw = memoryview(buffer.numpy())
            with path.open("rb") as f:
                f.seek(start)
                if f.readinto(raw) != nbytes:
                    raise ModelFormatError(f"{path} is truncated inside tensor {name!r}")
            if self.manifest is not None:
                expected = self.manifest.tensors.get(name)
                if expected is None:
                    raise ModelFormatError(f"tensor {name!r} is not in the checkpoint's manifest")
                verify_tensor(expected, raw)
            shape = [int(d) for d in info["shape"]]  # type: ignore[attr-defined]
            out[name] = buffer.view(stored).reshape(shape).to(dtype=dtype, device=device)
        return out
