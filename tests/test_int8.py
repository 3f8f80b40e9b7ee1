"""``--dtype int8``: int8 linears over float32 activations, batch-invariant rows, one class apart."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshd.daemon.config import load_config
from meshd.errors import ModelFormatError
from meshd.runtime.chain import LocalChain
from meshd.runtime.int8 import INVARIANT_ROWS, Int8Linear, Int8Part, quantize_linears
from meshd.runtime.model_info import choose_numerics, describe_fetched, describe_model
from meshd.runtime.numerics import INT8, Numerics, numerics_from_name
from meshd.runtime.shard import Shard, StepResult
from tests.archs import ARCHS
from tests.helpers import PROMPT
from tests.test_batching import PROMPTS, _decode, _first, _solo

INT8_NUMERICS = Numerics(torch.float32, weights=INT8, decode_max_rows=INVARIANT_ROWS)


def _linear(out_features: int, in_features: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=gen))
    return linear


def test_an_int8_linear_is_close_to_its_float_one_and_adds_its_bias_exactly():
    linear = _linear(384, 256, bias=True)
    q = Int8Linear(linear)
    x = torch.randn(7, 3, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = linear(x), q(x)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert float((got - ref).norm() / ref.norm()) < 0.04
    assert torch.equal(q(torch.zeros(2, 256)), linear.bias.expand(2, -1))  # a zero row is its bias, exactly
    assert q.int8_bytes == 384 * 256


@pytest.mark.parametrize("in_features", [256, 200])
def test_an_int8_row_is_bit_for_bit_the_same_alone_and_in_any_batch(in_features):
    q = Int8Linear(_linear(512, in_features))
    gen = torch.Generator().manual_seed(2)
    batch = torch.randn(21, in_features, generator=gen) * torch.logspace(-3, 3, 21).unsqueeze(1)
    with torch.inference_mode():
        alone = [q(batch[i : i + 1])[0] for i in range(21)]
        for rows in range(2, 22):
            together = q(batch[:rows])
            assert all(torch.equal(alone[i], together[i]) for i in range(rows)), rows
        poisoned = batch.clone()
        poisoned[3] = float("nan")
        out = q(poisoned)
    assert not torch.isfinite(out[3]).any()  # a bad row spoils itself, not its neighbours
    assert all(torch.equal(alone[i], out[i]) for i in range(21) if i != 3)


def test_fused_projections_compute_as_each_one_alone():
    attention = nn.Module()
    names = ("q_proj", "k_proj", "v_proj")
    for seed, (name, out) in enumerate(zip(names, (128, 64, 64), strict=True)):
        attention.add_module(name, _linear(out, 128, bias=True, seed=seed))
    singles = {name: Int8Linear(getattr(attention, name)) for name in names}
    quantize_linears(attention)
    assert all(isinstance(getattr(attention, name), Int8Part) for name in names)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for _ in range(2):  # the second round reads a fresh input again
            for name in names:
                assert torch.equal(getattr(attention, name)(x), singles[name](x)), name
            x = x * 2


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_an_int8_split_equals_one_process_token_for_token(adapter_models, arch):
    model_dir = adapter_models[arch]
    whole = LocalChain([Shard(model_dir, 0, 4, dtype=INT8, keep_logits=True)]).generate(PROMPT, 16, chunk_tokens=7)
    split = LocalChain([Shard(model_dir, s, e, dtype=INT8, keep_logits=True)
                        for s, e in [(0, 2), (2, 4)]]).generate(PROMPT, 16, chunk_tokens=7)
    assert split.tokens == whole.tokens
    assert all(torch.equal(a, b) for a, b in zip(split.logits, whole.logits, strict=True))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_batched_int8_decode_row_equals_the_same_row_alone(adapter_models, arch):
    model_dir = adapter_models[arch]
    solo = [_solo(model_dir, p, 6, INT8_NUMERICS) for p in PROMPTS]
    shard = Shard(model_dir, 0, 4, keep_logits=True, numerics=INT8_NUMERICS)
    tokens = [[shard.forward(_first(f"s{i}", p, (0, 4))).token] for i, p in enumerate(PROMPTS)]
    for step in range(1, 6):
        batch = [_decode(f"s{i}", tokens[i][-1], len(p) + step - 1, step, (0, 4)) for i, p in enumerate(PROMPTS)]
        for i, result in enumerate(shard.forward_batch(batch)):
            assert isinstance(result, StepResult), result
            assert torch.equal(result.logits, solo[i][1][step]), (i, step)
            tokens[i].append(result.token)
    assert tokens == [t for t, _ in solo]


def test_int8_is_its_own_numerics_class_and_its_name_reads_back(tiny_model):
    numerics = choose_numerics(tiny_model, INT8, "auto").numerics
    assert numerics.int8 and numerics.dtype == torch.float32 and numerics.device == "cpu"
    assert numerics.name.endswith("/int8") and numerics_from_name(numerics.name, "cpu") == numerics
    fp32 = choose_numerics(tiny_model, "float32", "cpu").numerics
    assert describe_model(tiny_model, numerics=numerics).compat_key != describe_model(tiny_model,
                                                                                      numerics=fp32).compat_key
    gguf = Numerics(torch.float32, weights=f"gguf-q8_0+{INT8}")
    assert gguf.int8 and numerics_from_name(gguf.name, "cpu") == gguf
    with pytest.raises(ModelFormatError, match="int8 computes on the CPU"):
        choose_numerics(tiny_model, INT8, "cuda:0")
    with pytest.raises(ModelFormatError, match="holds other weights"):
        choose_numerics(tiny_model, "float32", "cpu", pinned=numerics.name)


def test_int8_weights_are_counted_at_their_size(tiny_model):
    fp32_info = describe_model(tiny_model)
    info = describe_model(tiny_model, numerics=Numerics(weights=INT8))
    fetched = describe_fetched(tiny_model, "tiny", info.manifest, info.numerics)  # as a joining peer counts
    assert (fetched.layer_bytes, fetched.edge_bytes, fetched.compat_key) == (info.layer_bytes, info.edge_bytes,
                                                                             info.compat_key)
    middle = Shard(tiny_model, 1, 3, dtype=INT8)
    assert middle.parameter_bytes() == 2 * info.layer_bytes
    assert info.layer_bytes < 0.3 * fp32_info.layer_bytes and info.edge_bytes == fp32_info.edge_bytes
    whole = Shard(tiny_model, 0, 4, dtype=INT8)
    assert whole.parameter_bytes() < 0.5 * Shard(tiny_model, 0, 4).parameter_bytes()
    assert all(torch.isfinite(t).all() for _, t in whole.weight_tensors())


def test_int8_is_a_dtype_setting_and_llama_cpp_refuses_it(tmp_path):
    from meshd.cli.meshd_main import build_parser
    from meshd.models.gguf_export import create_builtin_gguf
    from meshd.models.gguf_model import gguf_model_dir

    assert load_config(overrides={"model": "bench", "dtype": INT8}).dtype == INT8
    with pytest.raises(ValueError, match="is not one of"):
        load_config(overrides={"model": "bench", "dtype": "int4"})
    assert build_parser().parse_args(["run", "--dtype", INT8]).dtype == INT8
    gguf = gguf_model_dir(create_builtin_gguf("tiny", tmp_path / "tiny-q8_0.gguf", "q8_0"), tmp_path / "cache")
    with pytest.raises(ModelFormatError, match=r"GGUF file's own types; --dtype int8 applies to the torch backend"):
        choose_numerics(gguf, INT8, "cpu", backend="llama.cpp")
    with pytest.raises(ModelFormatError, match=r"--numerics cpu/float32/rows1 names a class of the torch backend"):
        choose_numerics(gguf, "auto", "cpu", backend="llama.cpp", pinned="cpu/float32/rows1")
