"""Write a Hugging Face Llama, Mistral, Qwen2 or Qwen3 directory as a GGUF file, as llama.cpp's
converter lays one out.

The built-in models are offered as GGUF too (``meshctl model create NAME --format gguf``), written
from the same weights as their safetensors form: the tests and the benchmark then read GGUF files of
known content, in every quantization people run, without downloading one. The layout follows
llama.cpp's conventions, so llama.cpp loads these files like its own: tensors under GGUF's standard
names (``blk.N.attn_q.weight`` ...), Llama's query and key rows reordered for llama.cpp's rotary layout,
norms kept in float32, the tokenizer (vocabulary, merges, token types, special ids) and the chat
template in the metadata.

``f32``, ``f16`` and ``q8_0`` are written directly (the ``gguf`` package quantizes Q8_0); ``q4_k``
(llama.cpp's Q4_K_M mix) is made from the f16 file by llama.cpp's own quantizer, so it needs
``llama-cpp-python`` (``make native``). Every step is deterministic: one model and quantization
always give the same bytes.
"""

from __future__ import annotations

import ctypes
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from meshd.errors import ModelFormatError
from meshd.files import staged_file
from meshd.progress import progress as progress_of
from meshd.runtime.gguf_checkpoint import SUPPORTED
from meshd.runtime.loader import SafetensorsIndex, load_config

QUANTS = ("f32", "f16", "q8_0", "q4_k")
EXPORTABLE = SUPPORTED  # model_type -> GGUF arch: what meshd writes is what it reads

Say = Callable[[str], None]


def _permute_for_llamacpp(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Query/key rows from Hugging Face's rotary layout (halves) to llama.cpp's (interleaved pairs)."""
    dim = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, 2, dim, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _tokenizer_metadata(model_dir: Path) -> dict[str, Any]:
    """Vocabulary, merges, token types, special ids and template from the directory's tokenizer files."""
    doc = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = doc.get("model", {})
    if model.get("type") != "BPE":
        raise ModelFormatError(f"{model_dir}: only byte-level BPE tokenizers are exported to GGUF")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: int(t["id"]) for t in doc.get("added_tokens", []) if t.get("special")}
    vocab.update(special)
    size = max(vocab.values()) + 1
    tokens = [""] * size
    for token, i in vocab.items():
        tokens[i] = token
    if "" in tokens:
        raise ModelFormatError(f"{model_dir}: the vocabulary has gaps; GGUF needs one token per id")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    ids = {name: vocab.get(str(config.get(f"{name}_token"))) for name in ("bos", "eos", "pad")}
    return {"tokens": tokens, "types": [3 if t in special else 1 for t in tokens], "merges": merges,
            "ids": ids, "template": template, "add_bos": bool(config.get("add_bos_token", False))}


def write_gguf(model_dir: Path, out_file: Path, quant: str = "f32", say: Say | None = None) -> Path:
    """Write ``model_dir`` as one GGUF file of ``quant``; written beside ``out_file`` and moved into
    place at the end, so an interrupted run leaves nothing half-written."""
    import gguf

    say = say or (lambda _m: None)
    if quant not in QUANTS:
        raise ValueError(f"quantization {quant!r} is not one of {', '.join(QUANTS)}")
    model_dir, out_file = Path(model_dir), Path(out_file)
    config = load_config(model_dir)
    arch = EXPORTABLE.get(config.model_type)
    if arch is None:
        raise ModelFormatError(f"{config.model_type} models are not exported to GGUF; "
                               f"exported: {', '.join(EXPORTABLE)}")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ModelFormatError("models with sliding-window attention are not exported to GGUF")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ModelFormatError(f"models with {rope['rope_type']} rope scaling are not exported to GGUF")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    if quant == "q4_k":
        with tempfile.TemporaryDirectory(dir=out_file.parent, prefix=".gguf-") as tmp:
            f16 = write_gguf(model_dir, Path(tmp) / "f16.gguf", "f16", say)
            return _quantize_with_llamacpp(f16, out_file, say)

    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[quant]
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quant]

    with staged_file(out_file) as staging:
        writer = gguf.GGUFWriter(staging, arch)
        writer.add_name(model_dir.name)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_kv)
        writer.add_rope_dimension_count(head_dim)
        if head_dim * n_head != config.hidden_size:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
        writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
        writer.add_vocab_size(config.vocab_size)
        writer.add_file_type(file_type)
        if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        tok = _tokenizer_metadata(model_dir)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tok["tokens"])
        writer.add_token_types(tok["types"])
        writer.add_token_merges(tok["merges"])
        # readers that find no merges (a vocabulary of bytes and specials has none) rebuild them from scores
        writer.add_token_scores([0.0] * len(tok["tokens"]))
        for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                          ("pad", writer.add_pad_token_id)):
            if tok["ids"][name] is not None:
                add(tok["ids"][name])
        writer.add_add_bos_token(tok["add_bos"])
        if tok["template"]:
            writer.add_chat_template(tok["template"])

        arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
        names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
        permute = arch == "llama"  # llama.cpp rotates Llama's query/key rows its own way; Qwen's as stored
        index = SafetensorsIndex(model_dir)
        hf_names = sorted(index.files, key=_tensor_order)
        with progress_of(f"converting to {quant}", len(hf_names), "tensors", say=say) as bar:
            for hf_name in hf_names:
                stem, _, suffix = hf_name.rpartition(".")
                gguf_name = names.get_name(stem)
                if gguf_name is None:
                    raise ModelFormatError(f"tensor {hf_name!r} has no GGUF name")
                data = index.load([hf_name], _torch_float32())[hf_name].numpy()
                if permute and stem.endswith("self_attn.q_proj"):
                    data = _permute_for_llamacpp(data, n_head)
                elif permute and stem.endswith("self_attn.k_proj"):
                    data = _permute_for_llamacpp(data, n_kv)
                if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:  # norms stay float32, as in llama.cpp
                    writer.add_tensor(f"{gguf_name}.{suffix}", data.astype(np.float32))
                elif qtype == gguf.GGMLQuantizationType.F16:
                    writer.add_tensor(f"{gguf_name}.{suffix}", data.astype(np.float16))
                else:
                    packed = gguf.quants.quantize(data.astype(np.float32), qtype)
                    writer.add_tensor(f"{gguf_name}.{suffix}", packed, raw_shape=packed.shape, raw_dtype=qtype)
                bar.advance()
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    say(f"wrote {out_file} ({out_file.stat().st_size / 2**20:.1f} MiB, {quant})")
    return out_file


def _torch_float32() -> Any:
    import torch

    return torch.float32


def _tensor_order(name: str) -> tuple[int, int, str]:
    """Embedding first, then the layers in order, then the final norm and head (llama.cpp's order)."""
    if name.startswith("model.layers."):
        return (1, int(name.split(".")[2]), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def _quantize_with_llamacpp(source: Path, out_file: Path, say: Say) -> Path:
    """Q4_K_M by llama.cpp's quantizer (its mix: most matrices Q4_K, some Q6_K)."""
    try:
        import llama_cpp
    except ImportError:
        raise ModelFormatError("q4_k needs llama.cpp's quantizer: install llama-cpp-python (make native)") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 1  # deterministic whatever the machine
    with staged_file(out_file) as staging:
        say("quantizing to q4_k with llama.cpp")
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(staging).encode(), ctypes.byref(params))
        if rc != 0:
            raise ModelFormatError(f"llama.cpp could not quantize {source.name} to q4_k (code {rc})")
    say(f"wrote {out_file} ({out_file.stat().st_size / 2**20:.1f} MiB, q4_k)")
    return out_file


def create_builtin_gguf(name: str, out_file: Path, quant: str, say: Say | None = None, force: bool = False) -> Path:
    """The built-in model ``name`` as one GGUF file of ``quant``, from the same weights as its
    safetensors form (generated again in a temporary directory, so nothing else is needed)."""
    from meshd.models.builtin import create_builtin

    out_file = Path(out_file)
    if out_file.exists() and not force:
        raise FileExistsError(f"{out_file} already exists (use --force to replace it)")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_file.parent, prefix=f".{name}-") as tmp:
        source = create_builtin(name, Path(tmp) / name, progress=say)
        return write_gguf(source, out_file, quant, say)
