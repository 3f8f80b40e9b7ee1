"""A GGUF file holding only one layer range of a model, for llama.cpp to load as a model of its own.

llama.cpp computes whole models; a peer of a split GGUF model gives it a model that *is* its range:
the blocks ``[start, end)`` renumbered from 0, with the source's metadata and a block count of
``end - start``. The range is fed hidden states as input embeddings and its last block's output is
read by the evaluation callback (:mod:`meshd.runtime.llamacpp.engine`). Only the tail needs the
real vocabulary, final norm and output matrix; a range before it gets a vocabulary of eight tokens
and an output matrix to match, so that the logits llama.cpp computes for every row (it must: a
range's last block only computes the rows marked as outputs) cost nothing. Tensors are copied as
stored, quantized bytes and all, each checked against the source's manifest on the way. The whole
model ``[0, n)`` needs no copy: the source file is used as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from meshd.errors import ModelFormatError
from meshd.files import staged_file
from meshd.runtime.gguf_checkpoint import checked_tensor
from meshd.runtime.manifest import Manifest

SMALL_VOCAB = 8


def _arch(reader: Any) -> str:
    return str(reader.fields["general.architecture"].contents())


def block_count(reader: Any) -> int:
    return int(reader.fields[f"{_arch(reader)}.block_count"].contents())


def range_file(source: Path, start: int, end: int, cache_dir: Path, manifest: Manifest | None) -> Path:
    """The GGUF of layers ``[start, end)`` of ``source``: the source itself for the whole model, else
    a file under ``cache_dir``, written once (atomically) and named by the source's content."""
    from meshd.runtime.gguf_checkpoint import open_gguf

    reader = open_gguf(source)
    n_layers = block_count(reader)
    if not 0 <= start < end <= n_layers:
        raise ModelFormatError(f"layer range [{start}, {end}) is not inside [0, {n_layers})")
    if (start, end) == (0, n_layers):
        if manifest is not None:
            _verify_all(reader, manifest)
        return Path(source)
    tag = manifest.digest[:16] if manifest is not None else "unverified"
    out = Path(cache_dir) / f"{Path(source).stem}-{tag}-{start}-{end}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_range(reader, start, end, end == n_layers, out, manifest)
    return out


def _verify_all(reader: Any, manifest: Manifest) -> None:
    for t in reader.tensors:
        checked_tensor(t, manifest)


def _write_range(reader: Any, start: int, end: int, tail: bool, out: Path, manifest: Manifest | None) -> None:
    import gguf

    arch = _arch(reader)
    with staged_file(out) as staging:
        writer = gguf.GGUFWriter(staging, arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if not tail and (key.startswith("tokenizer.") or key == f"{arch}.vocab_size"):
                continue
            value = end - start if key == f"{arch}.block_count" else field.contents()
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, kind, sub_type=sub)
        n_embd = int(reader.fields[f"{arch}.embedding_length"].contents())
        if not tail:
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre("default")
            writer.add_token_list([chr(ord("a") + i) for i in range(SMALL_VOCAB - 1)] + ["ab"])
            writer.add_token_types([1] * SMALL_VOCAB)
            writer.add_token_merges(["a b"])
            writer.add_bos_token_id(0)
            writer.add_eos_token_id(1)
        for t in reader.tensors:
            name = str(t.name)
            if name.startswith("blk."):
                index = int(name.split(".")[1])
                if not start <= index < end:
                    continue
                name = f"blk.{index - start}." + name.split(".", 2)[2]
            elif not tail and name in ("token_embd.weight", "output.weight"):
                writer.add_tensor(name, np.zeros((SMALL_VOCAB, n_embd), np.float32))
                continue
            checked_tensor(t, manifest)
            writer.add_tensor(name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
