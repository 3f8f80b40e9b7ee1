"""A GGUF file as a model directory: the config, tokenizer and generation config it implies, and a
link to the file.

Everything in meshd that reads a model reads a directory (config, tokenizer, weights), and peers
that hold no layers fetch its small files by compat key. A GGUF file carries all of it in its
metadata, so a peer given ``--model FILE.gguf`` writes those files once, next to a link to the GGUF,
in a directory of its cache keyed by the file's identity (path, size, modification time): a changed
file gets a new directory. The tokenizer comes from Hugging Face files lying beside the GGUF when
there are some (``tokenizer.json`` ...), else from the GGUF metadata, converted by transformers; the
chat template likewise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from meshd.errors import ModelFormatError
from meshd.files import staged_directory
from meshd.runtime.gguf_checkpoint import GGUF_FILE, open_gguf

BESIDE = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
          "tokenizer.model", "generation_config.json")
END_OF_TURN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
COMPLETE = ".complete"


def is_gguf_file(path: Path) -> bool:
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()


def default_cache_root() -> Path:
    """Where tools without a data directory keep derived files: ``$MESHD_HOME/cache``."""
    home = os.environ.get("MESHD_HOME") or str(Path.home() / ".local" / "share" / "meshd")
    return Path(home) / "cache"


def model_directory(path: Path, cache_root: Path) -> tuple[Path, str]:
    """The model directory to read for ``path`` (a directory, or a GGUF file's directory under
    ``cache_root``) and the model's default id (the directory's name, or the file's stem)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return gguf_model_dir(path, cache_root), path.stem
    return path, path.name


def _identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def gguf_model_dir(gguf_path: Path, cache_root: Path) -> Path:
    """The model directory of ``gguf_path`` under ``cache_root``, written first if needed."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise ModelFormatError(f"{gguf_path} does not exist")
    key = hashlib.sha256(_identity(gguf_path).encode()).hexdigest()[:16]
    target = Path(cache_root) / "gguf" / f"{gguf_path.stem}-{key}"
    if (target / COMPLETE).is_file():
        return target
    with staged_directory(target) as staging:
        _write_model_dir(gguf_path, staging)
        (staging / COMPLETE).write_text(_identity(gguf_path) + "\n")
    return target


def _write_model_dir(gguf_path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    reader = open_gguf(gguf_path)  # refuses a truncated file before transformers tries
    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as exc:
        raise ModelFormatError(f"{gguf_path.name}: transformers cannot read a config from its metadata: "
                               f"{exc}") from None
    doc = config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        doc.pop(key, None)
    arch = str(reader.fields["general.architecture"].contents())
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None and "head_dim" in doc:  # transformers reads it for some families only
        doc["head_dim"] = int(key_length.contents())
    (out / "config.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    beside = [n for n in BESIDE if (gguf_path.parent / n).is_file()]
    if "tokenizer.json" in beside or "tokenizer.model" in beside:
        for name in beside:
            shutil.copyfile(gguf_path.parent / name, out / name)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except (ValueError, KeyError, OSError, NotImplementedError) as exc:
            raise ModelFormatError(f"{gguf_path.name}: no tokenizer beside it, and transformers cannot build one "
                                   f"from its metadata: {exc}") from None
        tokenizer.save_pretrained(out)
    if not (out / "generation_config.json").is_file():
        stops = sorted({int(reader.fields[k].parts[-1][0]) for k in END_OF_TURN_KEYS if k in reader.fields})
        generation = {"bos_token_id": config.bos_token_id, "pad_token_id": config.pad_token_id,
                      "eos_token_id": stops if len(stops) > 1 else (stops[0] if stops else config.eos_token_id)}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    (out / GGUF_FILE).symlink_to(gguf_path)
