"""What a peer can say about a model directory without loading it: identity, sizes, compat key.

The compat key is what hops of one route must agree on exactly: a hash of the architecture
adapter, the wire dtype and bundle schema, the config, the tokenizer files, and the weight files'
safetensors headers (every tensor's name, dtype, shape and offsets) with each file's size. Two
peers with the same key run the same computation on the same boundary format.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from meshd.errors import ModelFormatError
from meshd.runtime.adapters import adapter_for
from meshd.runtime.loader import INDEX_FILE, SINGLE_FILE, load_config
from meshd.wire.bundle import SCHEMA_VERSION

WIRE_DTYPE = "float32"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CONFIG_FILES = ("config.json", "generation_config.json")


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    model_dir: Path
    architecture: str
    n_layers: int
    hidden_size: int
    layer_bytes: int
    edge_bytes: int
    compat_key: str
    tokenizer_digest: str
    weights_digest: str
    context_length: int


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelFormatError(f"{path} is not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 1024 * 1024:
            raise ModelFormatError(f"{path} has an implausible header size {size}")
        return f.read(size)


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise ModelFormatError(f"{model_dir} has no safetensors weights")


def tokenizer_digest_of(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in (*CONFIG_FILES, *TOKENIZER_FILES):
        h.update(name.encode() + b"\0" + files.get(name, b"") + b"\0")
    return h.hexdigest()


def compat_key_of(architecture: str, tokenizer_digest: str, weights_digest: str) -> str:
    h = hashlib.sha256()
    for part in (architecture, WIRE_DTYPE, str(SCHEMA_VERSION), tokenizer_digest, weights_digest):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def read_small_files(model_dir: Path) -> dict[str, bytes]:
    """The config and tokenizer files, as served to peers that hold no layers."""
    return {n: (model_dir / n).read_bytes() for n in (*CONFIG_FILES, *TOKENIZER_FILES) if (model_dir / n).is_file()}


def describe_model(model_dir: Path, model_id: str | None = None) -> ModelInfo:
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    adapter = adapter_for(config)
    weights = hashlib.sha256()
    for path in weight_files(model_dir):
        weights.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0")
        weights.update(_safetensors_header(path))
    tok_digest = tokenizer_digest_of(read_small_files(model_dir))
    h, n_heads = config.hidden_size, config.num_attention_heads
    kv_heads, head_dim = adapter.kv_heads_and_dim(config)
    kv = kv_heads * head_dim
    attn = h * n_heads * head_dim * 2 + h * kv * 2
    mlp = 3 * h * config.intermediate_size
    layer_bytes = 4 * (attn + mlp + 2 * h)
    edge_bytes = 4 * config.vocab_size * h
    return ModelInfo(
        model_id=model_id or model_dir.name,
        model_dir=model_dir,
        architecture=adapter.architecture,
        n_layers=config.num_hidden_layers,
        hidden_size=h,
        layer_bytes=layer_bytes,
        edge_bytes=edge_bytes,
        compat_key=compat_key_of(adapter.architecture, tok_digest, weights.hexdigest()),
        tokenizer_digest=tok_digest,
        weights_digest=weights.hexdigest(),
        context_length=int(getattr(config, "max_position_embeddings", 2048)),
    )
