"""What a peer can say about a model directory before loading it: identity, sizes, numerics, compat key.

The compat key is what hops of one route must agree on exactly: a hash of the architecture
adapter, the weights manifest (every tensor's name, dtype, shape and the hash of its bytes), the
config and tokenizer files, the numerics class (held dtype, device kind, how linears run) and the
bundle schema. Two peers with the same key run the same computation on the same tensors, with the
same boundary format; two checkpoints that differ in one tensor never share a route.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from meshd.errors import ModelFormatError
from meshd.runtime.adapters import adapter_for
from meshd.runtime.backends import resolve_backend
from meshd.runtime.cpu_turn import CpuTurn
from meshd.runtime.devices import resolve_device
from meshd.runtime.int8 import INVARIANT_ROWS, int8_weight_bytes, is_int8_weight
from meshd.runtime.int8 import available as int8_available
from meshd.runtime.loader import Checkpoint, is_gguf_model, load_config, open_checkpoint, weight_files
from meshd.runtime.manifest import Manifest, weights_manifest
from meshd.runtime.numerics import (
    INT8,
    Choice,
    Numerics,
    calibrate,
    default_numerics,
    numerics_from_name,
    row_band,
)
from meshd.wire.bundle import SCHEMA_VERSION

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model")
CONFIG_FILES = ("config.json", "generation_config.json")


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    model_dir: Path
    architecture: str
    n_layers: int
    hidden_size: int
    layer_bytes: int       # bytes one decoder layer takes at the held dtype
    edge_bytes: int        # bytes of the embedding (and of the LM head) at the held dtype
    compat_key: str
    tokenizer_digest: str
    weights_digest: str
    context_length: int
    numerics: Numerics
    manifest: Manifest

    @property
    def dtype(self) -> torch.dtype:
        return self.numerics.dtype


def tokenizer_digest_of(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in (*CONFIG_FILES, *TOKENIZER_FILES):
        h.update(name.encode() + b"\0" + files.get(name, b"") + b"\0")
    return h.hexdigest()


def compat_key_of(architecture: str, tokenizer_digest: str, weights_digest: str, numerics: str) -> str:
    h = hashlib.sha256()
    for part in (architecture, numerics, str(SCHEMA_VERSION), tokenizer_digest, weights_digest):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def read_small_files(model_dir: Path) -> dict[str, bytes]:
    """The config and tokenizer files, as served to peers that hold no layers."""
    return {n: (model_dir / n).read_bytes() for n in (*CONFIG_FILES, *TOKENIZER_FILES) if (model_dir / n).is_file()}


def _bytes_of(index: Checkpoint, names: list[str], itemsize: int | None, int8: bool = False) -> int:
    """Bytes of the named tensors at ``itemsize`` bytes an element (linears' weights as int8 ones with
    ``int8``), or as stored when None."""
    total = 0
    for name in names:
        entry = index.entry(name)
        if int8 and is_int8_weight(name, entry["shape"]):  # type: ignore[arg-type]
            total += int8_weight_bytes(entry["shape"])  # type: ignore[arg-type]
            continue
        if itemsize is None:
            if "nbytes" in entry:
                total += int(entry["nbytes"])  # type: ignore[call-overload]
            else:
                begin, end = (int(x) for x in entry["data_offsets"])  # type: ignore[attr-defined]
                total += end - begin
            continue
        n = 1
        for d in entry["shape"]:  # type: ignore[attr-defined]
            n *= int(d)
        total += n * itemsize
    return total


@dataclass(frozen=True)
class ModelSizes:
    n_layers: int
    layer_bytes: int
    edge_bytes: int


def model_sizes(model_dir: Path, dtype: torch.dtype | None = None, int8: bool = False) -> ModelSizes:
    """Layer and embedding bytes at ``dtype`` (with ``int8``, the layers' linears at int8), or as stored
    (quantized GGUF tensors at their packed size) when None, from the headers alone. The edge is the
    embedding, a float lookup either way (an int8 LM head is smaller)."""
    config = load_config(model_dir)
    adapter = adapter_for(config)
    index = open_checkpoint(model_dir)
    itemsize = None if dtype is None else torch.empty((), dtype=dtype).element_size()
    layer_bytes = _bytes_of(index, index.names_with_prefix(adapter.layer_tensor_prefix(0)), itemsize, int8)
    edge_bytes = _bytes_of(index, [adapter.embed_tensor], itemsize) if adapter.embed_tensor in index else 0
    return ModelSizes(config.num_hidden_layers, layer_bytes, edge_bytes)


def gguf_weights_name(model_dir: Path) -> str:
    """``gguf-<quantization>`` for a GGUF model, else empty."""
    if not is_gguf_model(model_dir):
        return ""
    from meshd.runtime.gguf_checkpoint import GGUF_FILE, open_gguf, quantization_of

    return f"gguf-{quantization_of(open_gguf(Path(model_dir) / GGUF_FILE))}"


def choose_numerics(model_dir: Path, dtype: str = "auto", device: str = "auto", prefill_rows: int = 128,
                    backend: str = "auto", pinned: str = "", turn: CpuTurn | None = None) -> Choice:
    """The numerics a shard of this model uses here: the requested dtype (``auto``: the checkpoint's
    own) on the requested device, computed the way measured fastest on it (``meshd.runtime.numerics``),
    or the class ``pinned`` names (measurements differ a little from peer to peer, and peers in
    different classes never share a route); on the llama.cpp backend, ggml's own numerics for the
    file's quantization. On a CPU the ways are timed holding ``turn``, the machine's CPU turn: peers
    starting together then time them one after another, on cores no other peer computes on, and
    choose alike."""
    from meshd.runtime.shard import resolve_dtype

    model_dir = Path(model_dir)
    weights = gguf_weights_name(model_dir)
    int8 = dtype == INT8
    if resolve_backend(backend, model_dir) == "llama.cpp":
        if dtype not in ("auto", "float32"):
            raise ModelFormatError(f"the llama.cpp backend computes in the GGUF file's own types; --dtype {dtype} "
                                   "applies to the torch backend")
        if pinned:
            raise ModelFormatError(f"the llama.cpp backend computes as ggml does for the file; --numerics {pinned} "
                                   "names a class of the torch backend")
        return Choice(Numerics(torch.float32, resolve_device(device), backend="llama.cpp", weights=weights), {})
    held = resolve_dtype(dtype, model_dir)
    if int8:
        _check_int8(device)
        device, weights = "cpu", "+".join(w for w in (weights, INT8) if w)
    base = replace(default_numerics(held, resolve_device(device)), weights=weights)
    if pinned:
        return Choice(_named_class(pinned, base), {})
    shapes, band_shapes = _linear_shapes(model_dir)
    if int8 and len(band_shapes) == 1:  # no expert: no float GEMM is left for the measurements to choose for
        return Choice(replace(base, decode_max_rows=INVARIANT_ROWS), {})
    if not shapes:
        return Choice(base, {})
    with turn.held() if turn is not None and base.device_kind == "cpu" else contextlib.nullcontext():
        return calibrate(base, shapes, prefill_rows, band_shapes=band_shapes)


def _named_class(name: str, base: Numerics) -> Numerics:
    """The numerics class ``name`` on ``base``'s device; it must hold the weights as ``base`` does."""
    try:
        chosen = numerics_from_name(name, base.device)
    except ValueError as exc:
        raise ModelFormatError(str(exc)) from None
    if (chosen.dtype, chosen.weights) != (base.dtype, base.weights):
        raise ModelFormatError(f"numerics class {name!r} holds other weights than this peer does: it would "
                               f"hold this model as {base.name} (see --dtype)")
    return chosen


def _linear_shapes(model_dir: Path) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The ``(out, in)`` shapes of one decoder layer's dense linears, and of the other GEMMs a decode step
    runs (the experts', then the LM head): what the numerics are measured and the band probed on."""
    config = load_config(model_dir)
    adapter = adapter_for(config)
    index = open_checkpoint(model_dir)
    shapes: list[tuple[int, int]] = []
    experts: list[tuple[int, int]] = []
    for name in index.names_with_prefix(adapter.layer_tensor_prefix(0)):
        shape = index.entry(name)["shape"]
        if name.endswith(".weight") and len(shape) == 2:  # type: ignore[arg-type]
            (experts if ".experts." in name else shapes).append((int(shape[0]), int(shape[1])))  # type: ignore[index]
    return shapes, [*sorted(set(experts)), (int(config.vocab_size), int(config.hidden_size))]


def class_here(model_dir: Path, name: str, held: Numerics) -> Numerics:
    """The numerics class ``name``, which other peers compute this model in, as this peer would compute
    it, holding the weights as ``held`` does; :class:`ModelFormatError` when it cannot compute it so: the
    class needs kernels or a device kind this peer lacks, holds the weights otherwise, or its band of
    decode rows is wider than the one inside which this machine's kernels compute every row alike (a
    session's tokens would then depend on the batch it shares)."""
    numerics = _named_class(name, held)
    low, high = numerics.decode_band
    shapes, band_shapes = _linear_shapes(model_dir)
    if high > low and not (numerics.int8 and len(band_shapes) == 1):  # int8's own GEMMs keep every row alike
        gen = torch.Generator(device="cpu").manual_seed(0)
        weights = [(torch.randn(shape, generator=gen) * 0.02).to(dtype=numerics.dtype, device=numerics.device)
                   for shape in dict.fromkeys(shapes + band_shapes)]
        here_low, here_high = row_band(numerics, weights)
        if here_low != low or here_high < high:
            raise ModelFormatError(f"numerics class {name!r} decodes in GEMMs of {low} to {high} rows, and here "
                                   f"only {here_low} to {here_high} rows compute each row alike that way")
    return numerics


def _check_int8(device: str) -> None:
    """``--dtype int8`` runs fbgemm's int8 kernels: an x86 CPU."""
    if device not in ("auto", "cpu"):
        raise ModelFormatError(f"--dtype int8 computes on the CPU (fbgemm's int8 kernels), not on {device}")
    if not int8_available():
        raise ModelFormatError("--dtype int8 needs fbgemm's int8 kernels, which this torch build lacks "
                               "(they come with x86 CPU builds)")


def describe_model(model_dir: Path, model_id: str | None = None, *, numerics: Numerics | None = None,
                   cache_dir: Path | None = None, say: Callable[[str], None] | None = None) -> ModelInfo:
    """Everything a card says about the model, without loading a tensor (though reading each once
    to hash it, unless the manifest cache has it). ``numerics`` defaults to the checkpoint's dtype on
    the CPU."""
    from meshd.runtime.loader import checkpoint_dtype

    model_dir = Path(model_dir)
    config = load_config(model_dir)
    adapter = adapter_for(config)
    numerics = numerics or replace(default_numerics(checkpoint_dtype(model_dir), "cpu"),
                                   weights=gguf_weights_name(model_dir))
    manifest = weights_manifest(weight_files(model_dir), cache_dir, say)
    tok_digest = tokenizer_digest_of(read_small_files(model_dir))
    sizes = model_sizes(model_dir, None if numerics.backend == "llama.cpp" else numerics.dtype, numerics.int8)
    return ModelInfo(
        model_id=model_id or model_dir.name,
        model_dir=model_dir,
        architecture=adapter.architecture,
        n_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        layer_bytes=sizes.layer_bytes,
        edge_bytes=sizes.edge_bytes,
        compat_key=compat_key_of(adapter.architecture, tok_digest, manifest.digest, numerics.name),
        tokenizer_digest=tok_digest,
        weights_digest=manifest.digest,
        context_length=int(getattr(config, "max_position_embeddings", 2048)),
        numerics=numerics,
        manifest=manifest,
    )


def describe_fetched(model_dir: Path, model_id: str, manifest: Manifest, numerics: Numerics) -> ModelInfo:
    """What a card says about a model whose files this peer fetched: its config and tokenizer are in
    ``model_dir``, its weights are described by ``manifest`` (the peers' whole checkpoint), whichever
    of its tensors ``model_dir`` holds so far."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    adapter = adapter_for(config)
    itemsize = torch.empty((), dtype=numerics.dtype).element_size()

    def bytes_of(names: list[str]) -> int:
        total = 0
        for name in names:
            shape = manifest.tensors[name].shape
            if numerics.int8 and is_int8_weight(name, shape) and name.startswith(prefix):
                total += int8_weight_bytes(shape)
                continue
            n = 1
            for d in shape:
                n *= int(d)
            total += n * itemsize
        return total

    prefix = adapter.layer_tensor_prefix(0)
    tok_digest = tokenizer_digest_of(read_small_files(model_dir))
    return ModelInfo(
        model_id=model_id, model_dir=model_dir, architecture=adapter.architecture,
        n_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        layer_bytes=bytes_of([n for n in manifest.tensors if n.startswith(prefix)]),
        edge_bytes=bytes_of([adapter.embed_tensor] if adapter.embed_tensor in manifest.tensors else []),
        compat_key=compat_key_of(adapter.architecture, tok_digest, manifest.digest, numerics.name),
        tokenizer_digest=tok_digest, weights_digest=manifest.digest,
        context_length=int(getattr(config, "max_position_embeddings", 2048)), numerics=numerics, manifest=manifest,
    )
