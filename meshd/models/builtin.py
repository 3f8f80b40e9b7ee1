"""The built-in models: small Llama-family models generated deterministically on the machine.

``tiny`` is for tests, ``bench`` for performance work (shapes in docs/models.md); ``trained`` and its
speculative draft ``draft`` learn English on the machine instead of drawing random weights
(meshd/models/trained.py), for the measurements that need real statistics. All are written as
ordinary Hugging Face directories — ``config.json``, safetensors weights (``bench`` split into
several files with an index, so that partial loading is real), a tokenizer with a chat template —
so every code path that loads a real model is exercised, and no byte is downloaded.

Determinism: every random tensor is drawn from its own generator, seeded from the model seed and the
tensor's name, and every file is written with sorted keys; the same name gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from meshd.files import staged_directory
from meshd.models import BUILTIN_NAMES
from meshd.models.tokenizer import BOS, BUILTIN_LAYOUT, EOS, PAD, SPECIAL_TOKENS, TokenizerLayout, write_tokenizer
from meshd.progress import progress as progress_of
from meshd.runtime.adapters import registry


@dataclass(frozen=True)
class BuiltinSpec:
    name: str
    seed: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    tie_embeddings: bool
    weight_files: int
    trained: bool = False  # weights learned by meshd.models.trained rather than drawn at random


BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    "tiny": BuiltinSpec(
        name="tiny", seed=1, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=192, vocab_size=320, max_positions=2048, tie_embeddings=False, weight_files=1,
    ),
    "bench": BuiltinSpec(
        name="bench", seed=2, hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4,
        intermediate_size=2816, vocab_size=32000, max_positions=4096, tie_embeddings=False, weight_files=4,
    ),
    # about a tenth of ``trained``'s parameters, the same tokenizer: its speculative draft
    "draft": BuiltinSpec(
        name="draft", seed=4, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
        intermediate_size=384, vocab_size=2048, max_positions=2048, tie_embeddings=True, weight_files=1,
        trained=True,
    ),
    "trained": BuiltinSpec(
        name="trained", seed=3, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=768, vocab_size=2048, max_positions=2048, tie_embeddings=True, weight_files=1,
        trained=True,
    ),
}
assert tuple(sorted(BUILTIN_MODELS)) == BUILTIN_NAMES, "meshd.models.BUILTIN_NAMES lists the built-in models"

ProgressFn = Callable[[str], None]


def make_config(model_type: str, spec: BuiltinSpec, **overrides: object) -> PretrainedConfig:
    """A config of the given architecture with the spec's shape and the tokenizer's special ids."""
    special = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    kwargs: dict[str, object] = {
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": spec.tie_embeddings,
        "rms_norm_eps": 1e-5,
        "bos_token_id": special[BOS],
        "eos_token_id": special[EOS],
        "pad_token_id": special[PAD],
        "torch_dtype": "float32",
    }
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    config.architectures = [registry()[model_type].architecture]
    return config


def _tensor_seed(model_seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{model_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _init_tensor(name: str, shape: tuple[int, ...], model_seed: int, hidden_size: int, tied: bool) -> torch.Tensor:
    """Draw one tensor. Scales keep activations stable and make logits well separated (a logit
    spread of a few units: wide enough that float rounding never flips a greedy choice)."""
    gen = torch.Generator().manual_seed(_tensor_seed(model_seed, name))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith(".bias"):
        return 0.1 * noise
    if "embed_tokens" in name and not tied:
        return noise
    if name == "lm_head.weight" or "embed_tokens" in name:
        return noise * (4.0 / hidden_size**0.5)
    fan_in = shape[-1]
    return noise * (1.0 / fan_in**0.5)


def _parameter_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint holds, by name, as the family's checkpoints name them."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    adapter = registry()[config.model_type]
    if adapter.module_layer is None:
        return shapes
    out: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_hidden_layers):
        prefix = adapter.layer_tensor_prefix(i)
        layer = {n[len(prefix):]: torch.empty(shape, device="meta") for n, shape in shapes.items()
                 if n.startswith(prefix)}
        out.update({prefix + n: tuple(t.shape) for n, t in adapter.module_layer(layer, config).items()})
    out.update({n: shape for n, shape in shapes.items() if not n.startswith(adapter.layer_prefix)})
    return out


def _file_for(name: str, n_layers: int, n_files: int) -> int:
    """Which weight file holds a tensor: layers spread evenly, embedding first, head last."""
    if n_files == 1:
        return 0
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        return layer * n_files // n_layers
    return 0 if "embed_tokens" in name else n_files - 1


def write_metadata(out_dir: Path, config: PretrainedConfig, dtype: torch.dtype = torch.float32,
                   layout: TokenizerLayout = BUILTIN_LAYOUT, tokenizer: Tokenizer | None = None) -> None:
    """Write everything of a model directory but its weights: ``config.json`` (weights stored as
    ``dtype``), ``generation_config.json`` and the tokenizer files (``tokenizer``, else the generated one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config_dict = config.to_dict()
    config_dict.pop("transformers_version", None)
    config_dict["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    ids = dict(layout.specials)
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": [ids[t] for t in layout.stop_tokens] if layout.stop_tokens else config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    write_tokenizer(out_dir, config.vocab_size, config.max_position_embeddings, layout, tokenizer)


def write_model(
    out_dir: Path,
    config: PretrainedConfig,
    seed: int,
    weight_files: int = 1,
    progress: ProgressFn | None = None,
    dtype: torch.dtype = torch.float32,
    layout: TokenizerLayout = BUILTIN_LAYOUT,
) -> Path:
    """Write a complete Hugging Face model directory with deterministic random weights, stored as
    ``dtype`` and laid out as the family's own checkpoints are."""
    out_dir = Path(out_dir)
    say = progress or (lambda _msg: None)
    write_metadata(out_dir, config, dtype, layout)

    shapes = _parameter_shapes(config)
    n_layers = config.num_hidden_layers
    groups: list[list[str]] = [[] for _ in range(weight_files)]
    for name in sorted(shapes):
        groups[_file_for(name, n_layers, weight_files)].append(name)

    weight_map: dict[str, str] = {}
    total = 0
    with progress_of("generating weights", len(shapes), "tensors", say=say) as bar:
        for index, names in enumerate(groups):
            file_name = (
                "model.safetensors" if weight_files == 1
                else f"model-{index + 1:05d}-of-{weight_files:05d}.safetensors"
            )
            tensors = {}
            for name in sorted(names):
                tensors[name] = _init_tensor(name, shapes[name], seed, config.hidden_size,
                                             bool(config.tie_word_embeddings)).to(dtype)
                bar.advance(note=file_name)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
            weight_map.update({name: file_name for name in tensors})
            del tensors
    if weight_files > 1:
        index_doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2, sort_keys=True) + "\n")
    return out_dir


def create_builtin(name: str, out_dir: Path, progress: ProgressFn | None = None, force: bool = False) -> Path:
    """Create the built-in model ``name`` (one of ``BUILTIN_NAMES``) in ``out_dir``.

    The files are written to a temporary sibling directory and moved into place at the end, so an
    interrupted run never leaves a half-written model behind.
    """
    try:
        spec = BUILTIN_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {', '.join(BUILTIN_MODELS)}") from None
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} already exists and is not empty (use --force to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with staged_directory(out_dir) as staging:
        if spec.trained:
            from meshd.models.trained import train_builtin

            train_builtin(name, staging, progress)
        else:
            write_model(staging, make_config("llama", spec), spec.seed, spec.weight_files, progress)
    return out_dir


def ensure_builtin(name: str, out_dir: Path, progress: ProgressFn | None = None) -> Path:
    """The built-in model at ``out_dir``, created first if it is not there."""
    if (Path(out_dir) / "config.json").is_file():
        return Path(out_dir)
    return create_builtin(name, out_dir, progress, force=True)


def default_model_dir(name: str) -> Path:
    """Where built-in models live unless told otherwise: ``$MESHD_HOME/models/NAME``."""
    home = os.environ.get("MESHD_HOME") or str(Path.home() / ".local" / "share" / "meshd")
    return Path(home) / "models" / name


def directory_digest(model_dir: Path) -> str:
    """SHA-256 over every file's name and bytes, in name order: equal digests mean identical models."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0")
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()
