"""Prefill chunks of several sessions computed as one give, bit for bit, what each computes alone.

Where a GEMM computes each row alike at any row count (oneDNN linears), a hop computes the prompts
queued together in one pass: their rows share the linears, and each session attends over its own
keys. These tests hold that to the solo runs (logits, first tokens, the KV the decode steps after
it read, the hidden states a split hands on), and check what a chunk that fails or cannot join does.
"""

from __future__ import annotations

import threading

import pytest
import torch
import trio

from meshd.errors import BundleError, CacheMiss, RangeMismatch
from meshd.runtime.attention import PrefillSegments
from meshd.runtime.chain import input_bundles
from meshd.runtime.host import ShardHost
from meshd.runtime.shard import HIDDEN_STATES, Shard, StepResult
from meshd.wire.bundle import HiddenStateBundle, Sampling
from tests.archs import ARCHS
from tests.helpers import ONEDNN, fail_at_layer, needs_onednn

N_LAYERS = 4
# lengths differ, and two pass the sliding windows of mistral-window (12) and gemma2/gemma3 (8)
PROMPTS = [[(5 * i + 7 * j) % 190 + 9 for j in range(n)] for i, n in enumerate((3, 11, 17, 25, 6))]
CHUNK = 10  # prompt 3 runs in three chunks of this many tokens: its second one joins the others' prompts
DECODE_STEPS = 3
SHARING = sorted(a for a in ARCHS if a != "qwen3-moe")  # experts pick a GEMM's rows by the tokens routed


def _chunks(session: str, prompt: list[int], rng: tuple[int, int] = (0, N_LAYERS)) -> list[HiddenStateBundle]:
    """The prompt's chunks: prompt 3's of ``CHUNK`` tokens, the others' whole."""
    size = CHUNK if prompt is PROMPTS[3] else len(prompt)
    return list(input_bundles(session, 0, prompt, 0, size, rng, Sampling()))


def _decode(session: str, token: int, position: int, step: int) -> HiddenStateBundle:
    return next(input_bundles(session, 0, [token], position, 1, (0, N_LAYERS), Sampling(), step))


def _solo(model_dir, prompt: list[int]) -> list[torch.Tensor]:
    """Logits of the prompt's last chunk and of the decode steps after it, the session alone."""
    shard = Shard(model_dir, 0, N_LAYERS, keep_logits=True, numerics=ONEDNN)
    for chunk in _chunks("solo", prompt):
        result = shard.forward(chunk)
    logits = [result.logits]
    for step in range(1, DECODE_STEPS + 1):
        token = int(logits[-1].argmax())
        logits.append(shard.forward(_decode("solo", token, len(prompt) + step - 1, step)).logits)
    return logits


@needs_onednn
@pytest.mark.parametrize("arch", SHARING)
def test_chunks_computed_together_in_slices_equal_each_alone(adapter_models, arch):
    """Four sessions' chunks (three first chunks and another session's second one, at position 10)
    run as one, a layer a slice, with a fifth session's decode step between every two layers; each
    session's logits, and every decode step after it, equal its solo run's bit for bit."""
    model_dir = adapter_models[arch]
    solo = [_solo(model_dir, p) for p in PROMPTS]
    shard = Shard(model_dir, 0, N_LAYERS, keep_logits=True, numerics=ONEDNN)
    assert shard.prefills_share_rows
    long_chunks = _chunks("s3", PROMPTS[3])
    assert shard.forward(long_chunks[0]).token is None
    lone = shard.forward(_chunks("s4", PROMPTS[4])[0])
    lone_logits = [lone.logits]
    run = shard.start_prefill([_chunks(f"s{i}", PROMPTS[i])[0] for i in range(3)] + [long_chunks[1]])
    slices = 1
    while not run.advance(lambda: True):  # a slice of one layer
        token = int(lone_logits[-1].argmax())
        step = len(lone_logits)
        lone_logits.append(shard.forward(_decode("s4", token, len(PROMPTS[4]) + step - 1, step)).logits)
        slices += 1
    outcomes = run.finish()
    assert slices == N_LAYERS and all(isinstance(o, StepResult) for o in outcomes)
    assert outcomes[3].token is None  # the middle of a prompt samples nothing
    for i in range(3):  # each session holds its own keys, not a view of everyone's
        held = [*shard.kv.get((f"s{i}", 0)).keys.values(), *shard.kv.get((f"s{i}", 0)).values.values()]
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in held)
    last = shard.forward(long_chunks[2])
    firsts = [o.logits for o in outcomes[:3]] + [last.logits]
    assert all(torch.equal(mine, ref[0]) for mine, ref in zip(firsts, solo, strict=False))
    assert all(torch.equal(mine, ref) for mine, ref in zip(lone_logits, solo[4], strict=True))
    for i in range(4):
        assert shard.kv.get((f"s{i}", 0)).length == len(PROMPTS[i])
        logits = firsts[i]
        for step in range(1, DECODE_STEPS + 1):
            logits = shard.forward(_decode(f"s{i}", int(logits.argmax()), len(PROMPTS[i]) + step - 1, step)).logits
            assert torch.equal(logits, solo[i][step]), f"session {i} step {step}"


@needs_onednn
def test_a_split_hands_on_the_hidden_states_each_chunk_gives_alone(adapter_models):
    model_dir = adapter_models["llama"]
    alone = Shard(model_dir, 0, 2, numerics=ONEDNN)
    expected = [alone.forward(_chunks(f"s{i}", p, (0, 2))[0]).hidden_states for i, p in enumerate(PROMPTS[:3])]
    together = Shard(model_dir, 0, 2, numerics=ONEDNN)
    run = together.start_prefill([_chunks(f"s{i}", p, (0, 2))[0] for i, p in enumerate(PROMPTS[:3])])
    assert run.advance(lambda: False)
    outcomes = run.finish()
    assert all(torch.equal(o.hidden_states, e) for o, e in zip(outcomes, expected, strict=True))
    tail_alone, tail_together = Shard(model_dir, 2, 4, numerics=ONEDNN), Shard(model_dir, 2, 4, numerics=ONEDNN)
    bundles = []
    for i, hidden in enumerate(expected):
        bundle = _chunks(f"s{i}", PROMPTS[i], (2, 4))[0]
        bundle.tensors = {HIDDEN_STATES: hidden}
        bundles.append(bundle)
    tokens = [tail_alone.forward(b).token for b in bundles]
    run = tail_together.start_prefill(bundles)
    assert run.advance(lambda: False)
    assert [o.token for o in run.finish()] == tokens


@needs_onednn
def test_a_bad_chunk_fails_alone_and_the_others_run(adapter_models):
    model_dir = adapter_models["llama"]
    solo = [_solo(model_dir, p) for p in PROMPTS[:2]]
    shard = Shard(model_dir, 0, N_LAYERS, keep_logits=True, numerics=ONEDNN)
    good = [_chunks(f"s{i}", PROMPTS[i])[0] for i in range(2)]
    wrong_range = _chunks("r", PROMPTS[2], (0, 2))[0]
    unknown = _chunks("u", PROMPTS[3])[1]  # continues a session this shard never saw
    run = shard.start_prefill([good[0], wrong_range, unknown, good[0], good[1]])
    assert run.advance(lambda: False)
    outcomes = run.finish()
    assert isinstance(outcomes[1], RangeMismatch) and isinstance(outcomes[2], CacheMiss)
    assert isinstance(outcomes[3], BundleError) and "two chunks" in str(outcomes[3])
    assert torch.equal(outcomes[0].logits, solo[0][0]) and torch.equal(outcomes[4].logits, solo[1][0])
    assert sorted(shard.kv.keys()) == [("s0", 0), ("s1", 0)]


@needs_onednn
def test_a_failing_compute_leaves_every_session_as_it_was(adapter_models, monkeypatch):
    model_dir = adapter_models["llama"]
    shard = Shard(model_dir, 0, N_LAYERS, numerics=ONEDNN)
    long_chunks = _chunks("s3", PROMPTS[3])
    shard.forward(long_chunks[0])
    fail_at_layer(monkeypatch, shard, 2)
    run = shard.start_prefill([_chunks("s0", PROMPTS[0])[0], long_chunks[1]])
    with pytest.raises(RuntimeError, match="kernel failed"):
        run.advance(lambda: False)
    assert ("s0", 0) not in shard.kv  # opened by the run, gone with it
    assert shard.kv.get(("s3", 0)).length == CHUNK
    assert all(t.shape[-2] == CHUNK for t in shard.kv.get(("s3", 0)).keys.values())


def test_shards_whose_rows_depend_on_the_batch_compute_one_chunk_at_a_time(adapter_models, tiny_model):
    moe = Shard(adapter_models["qwen3-moe"], 0, N_LAYERS, numerics=ONEDNN)
    plain = Shard(tiny_model, 0, N_LAYERS)  # torch's own GEMMs: a row's bits depend on the row count
    for shard in (moe, plain):
        assert not shard.prefills_share_rows
        with pytest.raises(BundleError, match="one prefill chunk at a time"):
            shard.start_prefill([_chunks(f"s{i}", PROMPTS[i])[0] for i in range(2)])


@needs_onednn
async def test_a_host_computes_prompts_queued_together_as_one_and_falls_back_when_that_fails(adapter_models,
                                                                                              monkeypatch):
    """Prompts submitted together to a host run as one prefill; where that compute fails, each is
    computed again alone, and every session still gets its solo first token."""
    model_dir = adapter_models["llama"]
    solo = [int(_solo(model_dir, p)[0].argmax()) for p in PROMPTS[:3]]
    for broken in (False, True):
        host = ShardHost(model_dir, numerics=ONEDNN)
        await host.load(0, N_LAYERS)
        if broken:
            run_layer = host.require_shard()._run_layer

            def failing(index, hidden, position_ids, cache, *args, run_layer=run_layer):
                if isinstance(cache, PrefillSegments):
                    raise RuntimeError("joint kernel failed")
                return run_layer(index, hidden, position_ids, cache, *args)

            monkeypatch.setattr(host.require_shard(), "_run_layer", failing)
        tokens: dict[int, int | None] = {}

        async def prompt(host: ShardHost, i: int, tokens: dict[int, int | None]) -> None:
            tokens[i] = (await host.forward(_chunks(f"s{i}", PROMPTS[i])[0])).token

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(prompt, host, i, tokens)
        assert [tokens[i] for i in range(3)] == solo, broken
        runs = host.batcher.stats.summary()["prefill_runs"]
        assert max(int(k) for k in runs) >= 2 and host.batcher.stats.prefill_chunks == 3
        assert sorted(host.require_shard().kv.keys()) == [(f"s{i}", 0) for i in range(3)]
        host.close()


@needs_onednn
async def test_a_host_takes_prompts_queued_behind_a_young_prefill_run_into_it(adapter_models, monkeypatch):
    """A prompt's run, computing alone, starts again with the prompts that queue behind it during its
    first layer: what the first start computed is undone, and every session gets its solo first token
    and holds exactly its own prompt's KV."""
    model_dir = adapter_models["llama"]
    solo = [int(_solo(model_dir, p)[0].argmax()) for p in PROMPTS[:3]]
    host = ShardHost(model_dir, numerics=ONEDNN)
    await host.load(0, N_LAYERS)
    host.batcher.slice_s = 30.0  # the join window outlasts the wait below
    shard = host.require_shard()
    others_queued = threading.Event()
    run_layer = shard._run_layer

    def gated(index, hidden, position_ids, cache, *args):
        others_queued.wait(30)  # the lone prompt's first layer waits until the others have queued
        return run_layer(index, hidden, position_ids, cache, *args)

    monkeypatch.setattr(shard, "_run_layer", gated)
    tokens: dict[int, int | None] = {}

    async def prompt(i: int) -> None:
        tokens[i] = (await host.forward(_chunks(f"s{i}", PROMPTS[i])[0])).token

    with trio.fail_after(60):  # a run that never starts or never takes them in fails, not hangs
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prompt, 0)
            while not host.batcher.stats.prefill_chunks:  # s0's run has started
                await trio.sleep(0.01)
            nursery.start_soon(prompt, 1)
            nursery.start_soon(prompt, 2)
            while host.batcher.waiting < 2:
                await trio.sleep(0.01)
            others_queued.set()
    assert [tokens[i] for i in range(3)] == solo
    stats = host.batcher.stats.summary()
    assert stats["prefill_restarts"] == 1 and stats["prefill_runs"] == {"3": 1}
    assert [(key, shard.kv.get(key).length) for key in sorted(shard.kv.keys())] == [
        ((f"s{i}", 0), len(PROMPTS[i])) for i in range(3)]
    host.close()
