"""Dtypes and numerics: a split computes bit for bit what one process computes, at every dtype, and a
decode row does not depend on the rows that share its step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshd.errors import ShapeMismatch
from meshd.models.builtin import BUILTIN_MODELS, make_config, write_model
from meshd.runtime.chain import LocalChain
from meshd.runtime.numerics import (
    TILE_ROWS,
    Numerics,
    RoutedLinear,
    calibrate,
    default_numerics,
    linears_like,
    onednn_available,
    route_linears,
    routed,
)
from meshd.runtime.shard import Shard
from meshd.wire import bundle as wire
from meshd.wire.bundle import HiddenStateBundle, Phase
from tests.archs import ARCHS
from tests.helpers import ONEDNN, PROMPT, needs_onednn, reference_generate

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device on this machine"))]
HALF = {"bfloat16": Numerics(torch.bfloat16, prefill_fp32=True), "float16": Numerics(torch.float16, prefill_fp32=True)}


def on(numerics: Numerics, device: str) -> Numerics:
    return replace(numerics, device="cuda:0" if device == "cuda" else "cpu",
                   decode_rows=TILE_ROWS if device == "cuda" else numerics.decode_rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_split_equals_one_process_bit_for_bit_at_each_dtype(adapter_models, arch, dtype, device):
    whole = _whole_equals_split(adapter_models[arch], on(HALF[dtype], device))
    assert all(torch.isfinite(x).all() for x in whole.logits)


def _whole_equals_split(model_dir, numerics: Numerics):
    """16 greedy tokens of the whole model in one shard, checked bit for bit against three shards."""
    whole = LocalChain([Shard(model_dir, 0, 4, numerics=numerics, keep_logits=True)]).generate(PROMPT, 16,
                                                                                                chunk_tokens=7)
    split = LocalChain([Shard(model_dir, s, e, numerics=numerics, keep_logits=True)
                        for s, e in [(0, 1), (1, 3), (3, 4)]]).generate(PROMPT, 16, chunk_tokens=7)
    assert split.tokens == whole.tokens
    assert all(torch.equal(a, b) for a, b in zip(split.logits, whole.logits, strict=True))
    return whole


def test_weights_and_the_seam_hold_the_dtype_asked_for(tiny_model):
    fp32 = Shard(tiny_model, 0, 2)
    bf16 = Shard(tiny_model, 0, 2, dtype="bfloat16")
    assert bf16.parameter_bytes() * 2 == fp32.parameter_bytes()
    out32 = fp32.forward(_prefill(fp32)).hidden_states
    out16 = bf16.forward(_prefill(bf16)).hidden_states
    assert out32.dtype == torch.float32 and out16.dtype == torch.bfloat16
    sizes = [len(wire.encode(_hidden(h))) for h in (out32, out16)]
    assert sizes[1] < 0.55 * sizes[0]  # a bf16 seam carries half the bytes
    tail = Shard(tiny_model, 2, 4, dtype="bfloat16")
    with pytest.raises(ShapeMismatch, match=r"must be torch\.bfloat16"):
        tail.forward(_hidden(out32, (2, 4)))


def test_auto_holds_the_checkpoints_own_dtype(tmp_path):
    model = write_model(tmp_path / "bf16", make_config("llama", BUILTIN_MODELS["tiny"]), seed=3, dtype=torch.bfloat16)
    assert Shard(model, 0, 4, dtype="auto").spec.dtype == torch.bfloat16
    assert Shard(model, 0, 4, dtype="float32").spec.dtype == torch.float32


@pytest.mark.parametrize("upcast", [False, True])
@pytest.mark.parametrize("rows", [1, TILE_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_row_is_the_same_alone_and_in_any_batch(dtype, rows, upcast):
    numerics = Numerics(dtype, decode_fp32=upcast, decode_rows=rows)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 256, generator=gen).to(dtype)
    batch = torch.randn(13, 256, generator=gen).to(dtype)
    with numerics.decode():
        alone = [F.linear(batch[i : i + 1], weight) for i in range(13)]
        together = F.linear(batch, weight)
        shuffled = F.linear(batch.flip(0), weight).flip(0)
    tiles = [batch[i : i + rows] for i in range(0, 13 - rows + 1, rows)]
    untouched = []  # steps of exactly one tile skip the mode, and must compute the same
    for tile in tiles:
        with numerics.decode(rows=tile.shape[0]):
            untouched.append(F.linear(tile, weight))
    for i in range(13):
        assert torch.equal(alone[i][0], together[i]) and torch.equal(alone[i][0], shuffled[i])
    for t, out in enumerate(untouched):
        assert torch.equal(out, together[t * rows : (t + 1) * rows])


def test_calibration_keeps_the_defaults_for_layers_too_small_to_matter():
    choice = calibrate(default_numerics(torch.bfloat16, "cpu"), [(64, 64), (192, 64)], 64)
    assert choice.numerics == default_numerics(torch.bfloat16, "cpu") and choice.measured_ms == {}


def test_calibration_measures_each_alternative_and_names_the_class():
    choice = calibrate(default_numerics(torch.bfloat16, "cpu"), [(1024, 1024), (2816, 1024), (1024, 2816)], 128)
    assert len(choice.measured_ms) >= 4 and all(ms > 0 for ms in choice.measured_ms.values())
    assert choice.numerics.name.startswith("cpu/bfloat16/prefill-")


def _prefill(shard: Shard) -> HiddenStateBundle:
    return HiddenStateBundle(session_id="s", epoch=0, phase=Phase.PREFILL, start_position=0, token_count=5,
                             tensors={"input_ids": torch.tensor([5, 6, 7, 8, 9])}, range_start=0, range_end=2,
                             sample=True)


def _hidden(hidden: torch.Tensor, layers: tuple[int, int] = (2, 4)) -> HiddenStateBundle:
    return HiddenStateBundle(session_id="s", epoch=0, phase=Phase.PREFILL, start_position=0,
                             token_count=hidden.shape[0], tensors={"hidden_states": hidden}, range_start=layers[0],
                             range_end=layers[1], sample=True)


def test_a_model_whose_rows_do_not_align_decodes_one_session_at_a_time(tmp_path):
    from tests.test_batching import PROMPTS, _decode, _first

    odd = write_model(tmp_path / "odd", make_config("llama", replace(BUILTIN_MODELS["tiny"], intermediate_size=176)),
                      seed=5)
    shard = Shard(odd, 0, 4, keep_logits=True)
    assert not shard.batch_invariant and Shard(odd, 0, 4).batch_invariant is False

    def first_decode(batch: list[int]) -> list[torch.Tensor]:
        s = Shard(odd, 0, 4, keep_logits=True)
        starts = [s.forward(_first(f"s{i}", PROMPTS[i], (0, 4))).token for i in batch]
        steps = [_decode(f"s{i}", t, len(PROMPTS[i]), 1, (0, 4)) for i, t in zip(batch, starts, strict=True)]
        return [r.logits for r in s.forward_batch(steps)]

    assert torch.equal(first_decode([0])[0], first_decode([0, 1, 2])[0])


def test_decode_in_the_measured_band_gives_every_session_its_solo_logits(tmp_path):
    """A model with widths where this machine's GEMMs have a band of several rows: sessions decoded
    alone (padded to the band's bottom), together (one GEMM) and more than the band holds (tiles)
    get the same logits bit for bit."""
    from meshd.runtime.numerics import band_tiles, row_band
    from tests.test_batching import _decode, _first

    spec = replace(BUILTIN_MODELS["tiny"], hidden_size=256, intermediate_size=768, num_heads=4, num_kv_heads=2)
    model = write_model(tmp_path / "wide", make_config("llama", spec), seed=7)
    probe = Shard(model, 0, 4)
    assert probe.lm_head is not None
    weights = [m.weight for layer in probe.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    weights.append(probe.lm_head.weight)
    low, high = row_band(Numerics(), weights, probe_rows=16)
    if high == 1:
        pytest.skip("this machine's GEMMs compute rows alike at no two row counts for these widths")
    numerics = Numerics(decode_rows=low, decode_max_rows=high)
    assert numerics.name.endswith(f"rows{low}-{high}")
    assert sum(band_tiles(high + 3, numerics.decode_band)) >= high + 3
    prompts = [[(7 * i + 3 * j) % 300 + 5 for j in range(3 + i % 5)] for i in range(high + 3)]

    def decode(members: list[int], steps: int) -> dict[int, list[torch.Tensor]]:
        shard = Shard(model, 0, 4, numerics=numerics, keep_logits=True)
        tokens = {i: [shard.forward(_first(f"s{i}", prompts[i], (0, 4))).token] for i in members}
        logits: dict[int, list[torch.Tensor]] = {i: [] for i in members}
        for step in range(1, steps):
            batch = [_decode(f"s{i}", tokens[i][-1], len(prompts[i]) + step - 1, step, (0, 4)) for i in members]
            for i, result in zip(members, shard.forward_batch(batch), strict=True):
                assert not isinstance(result, Exception), result
                tokens[i].append(result.token)
                logits[i].append(result.logits)
        return logits

    together = decode(list(range(len(prompts))), 3)  # more sessions than the band: tiles
    pair = decode([0, 1], 3)  # inside the band: no tiles
    for i in (0, 1, len(prompts) - 1):
        alone = decode([i], 3)[i]  # one row, padded
        assert all(torch.equal(a, b) for a, b in zip(alone, together[i], strict=True))
        if i in pair:
            assert all(torch.equal(a, b) for a, b in zip(alone, pair[i], strict=True))


def test_a_band_name_round_trips_and_tiles_stay_inside_it():
    from meshd.runtime.numerics import band_tiles, numerics_from_name

    banded = Numerics(torch.float32, decode_rows=2, decode_max_rows=15)
    assert banded.name == "cpu/float32/prefill-native/decode-native-rows2-15"
    assert numerics_from_name(banded.name, "cpu") == banded
    assert numerics_from_name(Numerics().name, "cpu") == Numerics()
    assert band_tiles(1, (2, 15)) == [2] and band_tiles(15, (2, 15)) == [15]
    assert band_tiles(16, (2, 15)) == [8, 8] and band_tiles(31, (2, 15)) == [11, 10, 10]
    assert band_tiles(13, (8, 8)) == [8, 8] and band_tiles(5, (1, 1)) == [1] * 5


# -- oneDNN linears -------------------------------------------------------------------------------------


@needs_onednn
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_split_computing_through_onednn_equals_one_process_bit_for_bit(adapter_models, arch):
    model_dir = adapter_models[arch]
    whole = _whole_equals_split(model_dir, ONEDNN)
    reference, _ = reference_generate(model_dir, PROMPT, 16)
    close = Shard(model_dir, 0, 4, keep_logits=True)  # torch's own kernels: other last bits, the same model
    default = LocalChain([close]).generate(PROMPT, 16, chunk_tokens=7)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(whole.logits, default.logits, strict=True))
    assert default.tokens == reference


@needs_onednn
def test_a_onednn_row_is_the_same_alone_in_any_batch_and_in_a_prefill():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(300, 70, generator=gen), torch.randn(300, generator=gen)
    batch = torch.randn(45, 70, generator=gen)  # more rows than the band's top: tiles
    with ONEDNN.decode():
        alone = [F.linear(batch[i : i + 1], weight, bias) for i in range(45)]
        together = F.linear(batch, weight, bias)
        shuffled = F.linear(batch.flip(0), weight, bias).flip(0)
    with ONEDNN.decode(rows=2):
        pair = F.linear(batch[:2], weight, bias)
    with ONEDNN.prefill():
        chunk = F.linear(batch.unsqueeze(0), weight, bias)[0]
        chunk_of_one = F.linear(batch[3:4].unsqueeze(0), weight, bias)[0]
    with linears_like(ONEDNN):  # how the bench's transformers baseline computes: the same rows
        outside = F.linear(batch.unsqueeze(0), weight, bias)[0]
        outside_alone = F.linear(batch[3:4], weight, bias)
    assert all(torch.equal(alone[i][0], together[i]) and torch.equal(together[i], shuffled[i]) for i in range(45))
    assert torch.equal(pair, together[:2]) and torch.equal(chunk, together)
    assert torch.equal(chunk_of_one[0], together[3])  # a chunk of one row is padded as a lone session is
    assert torch.equal(outside, together) and torch.equal(outside_alone[0], together[3])
    assert torch.allclose(together, F.linear(batch, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_one_process_computes_a_prompt_and_its_steps_as_peers_of_a_class_mixing_kernels_do():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(300, 70, generator=gen), torch.randn(300, generator=gen)
    prompt, steps = torch.randn(1, 9, 70, generator=gen), torch.randn(3, 1, 70, generator=gen)
    with ONEDNN.decode():
        onednn_prompt = F.linear(prompt[0], weight, bias)
        onednn_steps = F.linear(steps[:, 0], weight, bias)
    by_row = torch.cat([F.linear(steps[i, 0:1], weight, bias) for i in range(3)])  # torch's kernels, rows1
    plain_prompt = F.linear(prompt, weight, bias)[0]
    prefill_only = replace(ONEDNN, decode_onednn=False, decode_rows=1, decode_max_rows=0)
    decode_only = replace(ONEDNN, prefill_onednn=False)
    assert prefill_only.name == "cpu/float32/prefill-onednn/decode-native-rows1"
    for numerics, want_prompt, want_steps in ((prefill_only, onednn_prompt, by_row),
                                              (decode_only, plain_prompt, onednn_steps)):
        with linears_like(numerics):
            assert torch.equal(F.linear(prompt, weight, bias)[0], want_prompt), numerics.name
            assert torch.equal(F.linear(steps, weight, bias)[:, 0], want_steps), numerics.name


def test_a_onednn_class_name_round_trips_and_is_refused_where_it_cannot_run():
    from meshd.runtime.numerics import numerics_from_name

    assert ONEDNN.name == "cpu/float32/prefill-onednn/decode-onednn-rows2-32"
    if onednn_available():
        assert numerics_from_name(ONEDNN.name, "cpu") == ONEDNN
    with pytest.raises(ValueError, match="oneDNN linears compute float32 on the CPU"):
        numerics_from_name("cpu/bfloat16/prefill-onednn/decode-native-rows1", "cpu")


def _ways(timings: dict[str, tuple[float, float]], band: tuple[int, int] = (2, 32),
          torch_band: tuple[int, int] = (1, 1)):
    """``choose`` over fake timers: per class name ``(lone step, step of TILE_ROWS)`` seconds."""
    from meshd.runtime.numerics import choose

    def lone(n: Numerics) -> float:
        return timings[n.name][0]

    def batch(n: Numerics) -> float:
        return timings[n.name][1]

    return choose(Numerics(torch.float32), lambda n: 1.0 if n.prefill_onednn else 2.0, lone, batch,
                  lambda n: band if n.decode_onednn else torch_band, onednn=True)


def test_onednn_decode_is_chosen_where_its_batches_are_faster_and_a_lone_session_pays_little():
    rows1 = "cpu/float32/prefill-onednn/decode-native-rows1"
    tiles = f"cpu/float32/prefill-onednn/decode-native-rows{TILE_ROWS}"
    dnn1 = "cpu/float32/prefill-onednn/decode-onednn-rows1"
    band = "cpu/float32/prefill-onednn/decode-onednn-rows2-32"
    fast = _ways({rows1: (1.0, 8.0), tiles: (3.0, 3.0), dnn1: (0.7, 5.6), band: (0.9, 1.2)})
    assert fast.numerics.name == band and fast.numerics.prefill_onednn
    assert f"decode x{TILE_ROWS} {band}" in fast.measured_ms
    # a band that costs a lone session more than BAND_LIMIT of torch's own one-row step is not taken
    slow_alone = _ways({rows1: (1.0, 8.0), tiles: (3.0, 3.0), dnn1: (0.7, 5.6), band: (1.6, 1.2)})
    assert slow_alone.numerics.name == dnn1
    # where batches gain less than MARGIN, torch's own way stays
    even = _ways({rows1: (1.0, 2.0), tiles: (3.0, 3.0), dnn1: (1.0, 1.9), band: (1.1, 1.8)})
    assert even.numerics.name == rows1
    # a band from one row stands for its kernel's one-row way: taken without gaining MARGIN on batches
    from_one = "cpu/float32/prefill-onednn/decode-native-rows1-15"
    kept = _ways({from_one: (1.0, 8.0), dnn1: (1.0, 7.9), band: (1.1, 7.8)}, torch_band=(1, 15))
    assert kept.numerics.name == from_one and f"decode {rows1}" not in kept.measured_ms


def test_a_burst_of_load_while_timing_does_not_change_the_choice():
    """Peers starting together time their ways under each other's load: a burst that slows every
    measurement for a while, wherever it falls, leaves the choice a quiet machine makes."""
    from meshd.runtime.numerics import choose

    timings = {"decode-native-rows1": (1.0, 8.0), f"decode-native-rows{TILE_ROWS}": (3.0, 3.0),
               "decode-onednn-rows1": (0.9, 6.0), "decode-onednn-rows2-32": (1.1, 1.2)}  # by decode way

    def choice_under(burst: range) -> str:
        calls = iter(range(10_000))

        def load() -> float:
            return 4.0 if next(calls) in burst else 1.0

        return choose(Numerics(torch.float32), lambda n: (1.0 if n.prefill_onednn else 2.0) * load(),
                      lambda n: timings[n.name.rsplit('/', 1)[1]][0] * load(),
                      lambda n: timings[n.name.rsplit('/', 1)[1]][1] * load(),
                      lambda n: (2, 32) if n.decode_onednn else (1, 1), onednn=True).numerics.name

    quiet = choice_under(range(0))
    assert quiet == "cpu/float32/prefill-onednn/decode-onednn-rows2-32"
    assert {start: choice_under(range(start, start + 6)) for start in range(30)} == dict.fromkeys(range(30), quiet)


def test_onednn_prefill_is_kept_unless_torch_is_clearly_faster():
    """oneDNN's prefill computes each row alike at any row count (prompts may then share a chunk): it is
    chosen when faster by any amount, or slower by less than MARGIN."""
    from meshd.runtime.numerics import MARGIN, choose

    def prefill_with(dnn_s: float) -> bool:
        return choose(Numerics(torch.float32), lambda n: dnn_s if n.prefill_onednn else 1.0, lambda n: 1.0,
                      lambda n: 1.0, lambda n: (1, 1), onednn=True).numerics.prefill_onednn

    assert prefill_with(0.9) and prefill_with(1.1) and prefill_with(0.99 * MARGIN)
    assert not prefill_with(1.01 * MARGIN)
    assert not choose(Numerics(torch.float32), lambda n: 0.5 if n.prefill_onednn else 1.0, lambda n: 1.0,
                      lambda n: 1.0, lambda n: (1, 1), onednn=False).numerics.prefill_onednn


class _Experts(nn.Module):
    """Weights applied with ``F.linear`` by the module that holds them, as a mixture's experts are."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.stacked = nn.Parameter(torch.randn(2, 40, 70, generator=gen), requires_grad=False)
        self.inner = nn.Linear(40, 70)  # left to the mode its parent runs in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(F.linear(x, self.stacked[0]) + F.linear(x, self.stacked[1]))


class _Block(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(70)
        self.proj = nn.Linear(70, 70)
        self.experts = _Experts(gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(self.proj(self.norm(x)))


@needs_onednn
def test_routed_modules_compute_their_linears_as_the_mode_does_with_no_mode_over_the_rest(monkeypatch):
    from meshd.runtime import numerics as numerics_module

    gen = torch.Generator().manual_seed(0)
    block = _Block(gen).eval()
    batch = torch.randn(45, 70, generator=gen)
    with torch.inference_mode():
        plain = block(batch)
        with ONEDNN.decode():
            in_mode = block(batch)
    assert route_linears(block) is block and route_linears(block) is block  # twice: the same
    assert type(block.proj) is RoutedLinear and type(block.experts.inner) is nn.Linear
    assert isinstance(block.norm, nn.LayerNorm) and "forward" not in vars(block.norm)
    dispatched: list[object] = []
    computed: list[int] = []  # each linear computed the numerics' way, by its output features
    linear = numerics_module._Linears.linear

    def counted(mode_class):
        dispatch = mode_class.__torch_function__

        def counted_dispatch(self, func, types, args=(), kwargs=None):
            dispatched.append(func)
            return dispatch(self, func, types, args, kwargs)

        monkeypatch.setattr(mode_class, "__torch_function__", counted_dispatch)

    def counted_linear(self, x, weight, bias):
        computed.append(weight.shape[0])
        return linear(self, x, weight, bias)

    counted(numerics_module._Linears)
    counted(numerics_module._PhaseLinears)
    monkeypatch.setattr(numerics_module._Linears, "linear", counted_linear)
    with torch.inference_mode():
        assert torch.equal(block(batch), plain)  # outside ``routed``: torch's own way
        assert dispatched == [] and computed == []
        with routed(ONEDNN.decode()):
            assert torch.equal(block(batch), in_mode)
        assert computed == [70, 40, 40, 70]  # the projection, the experts' two, their inner one
        with routed(linears_like(ONEDNN)):
            assert torch.equal(block(batch), in_mode)
    # the mode ran over the experts' forward only: their three linears and the sum between them
    assert [f for f in dispatched if f is F.linear] == [F.linear] * 6
    assert F.layer_norm not in dispatched and len(computed) == 8
