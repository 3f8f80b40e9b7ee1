"""GGUF models: written as llama.cpp lays them out, read back by transformers and by both engines,
split or whole, with the same checks as safetensors checkpoints."""

from __future__ import annotations

import os
import shutil

import pytest
from transformers import AutoTokenizer

from meshd.errors import ModelFormatError
from meshd.models.gguf_export import create_builtin_gguf, write_gguf
from meshd.models.gguf_model import gguf_model_dir, model_directory
from meshd.runtime.backends import open_shard, resolve_backend
from meshd.runtime.chain import LocalChain
from meshd.runtime.doctor import run_doctor
from meshd.runtime.gguf_checkpoint import open_gguf, quantization_of
from meshd.runtime.llamacpp.library import available
from meshd.runtime.model_info import choose_numerics, describe_model
from meshd.runtime.shard import Shard
from tests.helpers import PROMPT

native = pytest.mark.skipif(not available() and not os.environ.get("MESHD_REQUIRE_NATIVE"),
                            reason="llama-cpp-python is not installed (make native)")
SPLITS = [[(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]]


@pytest.fixture(scope="module")
def files(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf(tiny_model, root / f"tiny-{q}.gguf", q) for q in ("f32", "q8_0")}


@pytest.fixture(scope="module")
def dirs(files, tmp_path_factory):
    cache = tmp_path_factory.mktemp("gguf-cache")
    return {q: gguf_model_dir(path, cache) for q, path in files.items()}


def generate(model_dir, split, backend, n=24, chunk=7):
    numerics = choose_numerics(model_dir, backend=backend).numerics
    info = describe_model(model_dir, numerics=numerics)
    chain = LocalChain([open_shard(model_dir, a, b, numerics=numerics, manifest=info.manifest) for a, b in split])
    return chain.generate(PROMPT, n, chunk_tokens=chunk).tokens


def test_the_builtin_gguf_is_the_same_bytes_every_time(tmp_path):
    first = create_builtin_gguf("tiny", tmp_path / "a.gguf", "q8_0")
    second = create_builtin_gguf("tiny", tmp_path / "b.gguf", "q8_0")
    assert first.read_bytes() == second.read_bytes()
    assert quantization_of(open_gguf(first)) == "q8_0"
    with pytest.raises(FileExistsError):
        create_builtin_gguf("tiny", first, "q8_0")


def test_transformers_reads_the_config_tokenizer_and_template_from_the_metadata(tiny_model, dirs):
    ours = AutoTokenizer.from_pretrained(dirs["q8_0"])
    original = AutoTokenizer.from_pretrained(tiny_model)
    text = "Hello wörld <|user|> the  quick brown fox 123"
    assert ours(text).input_ids == original(text).input_ids
    assert ours.chat_template == original.chat_template
    assert (ours.bos_token, ours.eos_token) == (original.bos_token, original.eos_token)
    assert {p.name for p in dirs["q8_0"].iterdir()} >= {"config.json", "generation_config.json", "tokenizer.json",
                                                        "model.gguf"}


def test_tokenizer_files_beside_the_gguf_are_preferred(tiny_model, files, tmp_path):
    beside = tmp_path / "tiny.gguf"
    shutil.copyfile(files["q8_0"], beside)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_model / name, tmp_path / name)
    model_dir, model_id = model_directory(beside, tmp_path / "cache")
    assert model_id == "tiny"
    assert (model_dir / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()


def test_an_f32_gguf_through_torch_equals_the_safetensors_checkpoint(tiny_model, dirs):
    reference = LocalChain([Shard(tiny_model, 0, 4)]).generate(PROMPT, 24, chunk_tokens=7).tokens
    for split in SPLITS:
        assert generate(dirs["f32"], split, "torch") == reference, split


@pytest.mark.parametrize("backend", ["torch", pytest.param("llama.cpp", marks=native)])
def test_a_q8_0_gguf_split_equals_the_same_engine_in_one_process(dirs, backend):
    whole = generate(dirs["q8_0"], SPLITS[0], backend)
    for split in SPLITS[1:]:
        for chunk in (3, 64):
            assert generate(dirs["q8_0"], split, backend, chunk=chunk) == whole, (split, chunk)


@pytest.mark.parametrize("backend", ["torch", pytest.param("llama.cpp", marks=native)])
def test_guessed_tokens_verified_by_each_engine_give_its_plain_reply(dirs, backend):
    """Steps with guesses (from the reply itself, one in three wrong) verified by a split, as llama.cpp
    computes them position by position: the reply is the engine's plain one, in fewer steps."""
    model_dir = dirs["q8_0"]
    numerics = choose_numerics(model_dir, backend=backend).numerics
    info = describe_model(model_dir, numerics=numerics)
    plain = generate(model_dir, SPLITS[0], backend, n=30)
    asked: list[int] = []

    def guess(context, k):
        asked.append(k)
        at = len(context) - len(PROMPT)
        out = list(plain[at : at + k])
        if len(asked) % 3 == 0 and out:
            out[-1] = (out[-1] + 1) % 300
        return out

    chain = LocalChain([open_shard(model_dir, a, b, numerics=numerics, manifest=info.manifest) for a, b in SPLITS[2]])
    assert chain.generate(PROMPT, 30, chunk_tokens=7, draft=guess, draft_tokens=5).tokens == plain
    assert len(asked) < 15


@native
def test_llama_cpp_and_torch_agree_on_most_greedy_tokens(dirs):
    """Teacher-forced over 256 positions of llama.cpp's own greedy output: how often the torch engine's
    next token after the same prefix is the same (llama.cpp quantizes activations for its dot
    products, torch computes on the dequantized weights in float32, so they differ now and then)."""
    tokens = generate(dirs["q8_0"], SPLITS[0], "llama.cpp", n=256, chunk=64)
    numerics = choose_numerics(dirs["q8_0"], backend="torch").numerics
    chain = LocalChain([open_shard(dirs["q8_0"], 0, 4, numerics=numerics)])
    same = sum(chain.generate([*PROMPT, *tokens[:i]], 1, chunk_tokens=512).tokens[0] == token
               for i, token in enumerate(tokens))
    print(f"top-1 agreement llama.cpp vs torch over {len(tokens)} greedy steps: {same / len(tokens):.3f}")
    assert same >= len(tokens) // 2  # chance would be 1 in 320


def test_a_truncated_gguf_is_refused_clearly(files, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = files["q8_0"].read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelFormatError, match="truncated"):
        gguf_model_dir(cut, tmp_path / "cache")


@pytest.mark.parametrize("backend", ["torch", pytest.param("llama.cpp", marks=native)])
@pytest.mark.parametrize("tensor, layers", [("blk.2.ffn_down.weight", (2, 4)),
                                            ("token_embd.weight", (0, 2))])  # the head reads it itself
def test_bytes_changed_after_hashing_are_refused_at_load(files, tmp_path, backend, tensor, layers):
    copy = tmp_path / "tiny.gguf"
    shutil.copyfile(files["q8_0"], copy)
    model_dir = gguf_model_dir(copy, tmp_path / "cache")
    numerics = choose_numerics(model_dir, backend=backend).numerics
    info = describe_model(model_dir, numerics=numerics)
    reader = open_gguf(copy)
    victim = next(t for t in reader.tensors if t.name == tensor)
    offset = int(victim.data_offset) + 5
    del reader
    with copy.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelFormatError, match="does not match the checkpoint's manifest"):
        open_shard(model_dir, *layers, numerics=numerics, manifest=info.manifest)


@pytest.mark.parametrize("backend", ["torch", pytest.param("llama.cpp", marks=native)])
def test_the_doctor_checks_a_gguf_range(files, backend):
    report = run_doctor(files["q8_0"], (1, 3), "auto", "cpu", backend=backend)
    assert report.ok, report.error
    assert report.model["backend"] == backend
    assert report.model["numerics"].endswith("gguf-q8_0")


def test_auto_is_llama_cpp_for_gguf_when_installed_and_torch_otherwise(tiny_model, dirs):
    assert resolve_backend("auto", tiny_model) == "torch"
    assert resolve_backend("auto", dirs["q8_0"]) == ("llama.cpp" if available() else "torch")
    with pytest.raises(ModelFormatError, match="GGUF"):
        resolve_backend("llama.cpp", tiny_model)


def test_the_numerics_class_differs_by_engine_and_by_quantization(dirs):
    keys = {(q, b): describe_model(dirs[q], numerics=choose_numerics(dirs[q], backend=b).numerics).compat_key
            for q in ("f32", "q8_0") for b in ("torch", *(["llama.cpp"] if available() else []))}
    assert len(set(keys.values())) == len(keys)


@native
def test_requiring_native_means_it_is_there():
    assert available()


@native
def test_q4_k_is_made_by_llama_cpps_quantizer(tmp_path):
    path = create_builtin_gguf("tiny", tmp_path / "tiny-q4_k.gguf", "q4_k")
    assert quantization_of(open_gguf(path)) == "q4_k_m"
    model_dir = gguf_model_dir(path, tmp_path / "cache")
    whole = generate(model_dir, SPLITS[0], "llama.cpp")
    assert generate(model_dir, SPLITS[2], "llama.cpp") == whole


@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_each_family_through_gguf_matches_its_checkpoint_and_splits_exactly(adapter_models, arch, tmp_path):
    source = adapter_models[arch]
    if arch == "llama3":  # rope scaling is not written to GGUF: refused, not silently dropped
        with pytest.raises(ModelFormatError, match="rope scaling"):
            write_gguf(source, tmp_path / "x.gguf", "f32")
        return
    reference = LocalChain([Shard(source, 0, 4)]).generate(PROMPT, 16, chunk_tokens=7).tokens
    f32 = gguf_model_dir(write_gguf(source, tmp_path / f"{arch}-f32.gguf", "f32"), tmp_path / "cache")
    assert generate(f32, SPLITS[2], "torch", n=16) == reference
    q8 = gguf_model_dir(write_gguf(source, tmp_path / f"{arch}-q8_0.gguf", "q8_0"), tmp_path / "cache")
    for backend in ("torch", *(["llama.cpp"] if available() or os.environ.get("MESHD_REQUIRE_NATIVE") else [])):
        assert generate(q8, SPLITS[2], backend, n=16) == generate(q8, SPLITS[0], backend, n=16), backend


def test_every_weight_read_from_a_gguf_starts_on_a_cache_line(dirs):
    from meshd.runtime.loader import ALIGNMENT

    for quant in ("f32", "q8_0"):
        shard = Shard(dirs[quant], 0, 4)
        assert not [name for name, w in shard.weight_tensors() if w.data_ptr() % ALIGNMENT]
