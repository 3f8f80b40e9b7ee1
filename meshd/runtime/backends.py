"""Which engine computes a shard: torch (every model), or llama.cpp (GGUF models, ``make native``).

Both run behind the same shard interface (:class:`meshd.runtime.shard.Shard`); the shard's numerics
say which (``Numerics.backend``), and the numerics class is part of the compat key, so a route never
mixes peers that compute a model differently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshd.errors import ModelFormatError
from meshd.runtime.loader import is_gguf_model
from meshd.runtime.numerics import Numerics
from meshd.runtime.shard import Shard

BACKENDS = ("auto", "torch", "llama.cpp")


def resolve_backend(requested: str, model_dir: Path) -> str:
    """``auto``: llama.cpp for a GGUF model when llama-cpp-python is installed, else torch."""
    from meshd.runtime.llamacpp.library import available

    gguf = is_gguf_model(model_dir)
    if requested not in BACKENDS:
        raise ValueError(f"backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "llama.cpp" if gguf and available() else "torch"
    if requested == "llama.cpp" and not gguf:
        raise ModelFormatError("the llama.cpp backend computes GGUF models; this model is a safetensors checkpoint")
    return requested


def open_shard(model_dir: Path, start: int, end: int, *, numerics: Numerics | None = None, **options: Any) -> Shard:
    """Load layers ``[start, end)`` with the engine ``numerics`` names (torch unless it says llama.cpp)."""
    if numerics is not None and numerics.backend == "llama.cpp":
        from meshd.runtime.llamacpp.shard import LlamaCppShard

        return LlamaCppShard(model_dir, start, end, numerics=numerics, **options)
    try:
        return Shard(model_dir, start, end, numerics=numerics, **options)
    except (KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
        # what the config asks of the model's code and it cannot build (an unknown rope type, say)
        raise ModelFormatError(f"{model_dir}: layers [{start}, {end}) cannot be built from config.json: "
                               f"{type(exc).__name__}: {exc}") from None
