"""Continuous batching: decode steps of several sessions run as one forward and give what each gives alone.

Bit for bit, at every dtype and numerics: a decode step's linears run in GEMMs of a fixed number of
rows and each session attends over exactly its own keys (meshd/runtime/numerics.py), so a session's
logits do not depend on which other sessions share its step.
"""

from __future__ import annotations

import pytest
import torch
import trio

from meshd.errors import BundleError, CacheMiss, PositionMismatch, RangeMismatch, ShapeMismatch
from meshd.runtime.batching import PROMPT_SHARE_MAX, RESTARTS_MAX, StepBatcher, prompt_share
from meshd.runtime.chain import input_bundles
from meshd.runtime.host import ShardHost
from meshd.runtime.kv import room_for
from meshd.runtime.numerics import TILE_ROWS, Numerics, _Linears
from meshd.runtime.shard import HIDDEN_STATES, Shard, StepResult
from meshd.wire.bundle import HiddenStateBundle, Phase, Sampling
from tests.archs import ARCHS
from tests.helpers import ONEDNN, fail_at_layer, needs_onednn

N_LAYERS = 4
# Prompt lengths differ so the sessions' KV lengths differ (some beyond mistral-window's window of 12).
PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(n)] for i, n in enumerate((3, 11, 17, 6, 25))]
NEW_TOKENS = 12


def _first(session: str, prompt: list[int], rng: tuple[int, int]) -> HiddenStateBundle:
    return next(input_bundles(session, 0, prompt, 0, 64, rng, Sampling()))


def _decode(session: str, token: int, position: int, step: int, rng: tuple[int, int]) -> HiddenStateBundle:
    return next(input_bundles(session, 0, [token], position, 64, rng, Sampling(), step))


NUMERICS = {
    "float32": Numerics(torch.float32),
    "float32-tiles": Numerics(torch.float32, decode_rows=TILE_ROWS),
    "bfloat16": Numerics(torch.bfloat16, prefill_fp32=True),
    "float16-tiles": Numerics(torch.float16, prefill_fp32=True, decode_fp32=True, decode_rows=TILE_ROWS),
    "float32-onednn": ONEDNN,
}
CASES = [(arch, n) for arch in sorted(ARCHS) for n in ("float32", "bfloat16")]
CASES += [pytest.param(arch, "float32-onednn", marks=needs_onednn) for arch in sorted(ARCHS)]
CASES += [(arch, n) for arch in ("llama", "gemma2", "qwen3-moe") for n in ("float32-tiles", "float16-tiles")]


def _solo(model_dir, prompt: list[int], n: int,
          numerics: Numerics | None = None) -> tuple[list[int], list[torch.Tensor]]:
    shard = Shard(model_dir, 0, N_LAYERS, keep_logits=True, numerics=numerics)
    result = shard.forward(_first("solo", prompt, (0, N_LAYERS)))
    tokens, logits = [result.token], [result.logits]
    for step in range(1, n):
        result = shard.forward(_decode("solo", tokens[-1], len(prompt) + step - 1, step, (0, N_LAYERS)))
        tokens.append(result.token)
        logits.append(result.logits)
    return tokens, logits


@pytest.mark.parametrize(("arch", "numerics"), CASES)
def test_batched_decode_matches_solo_runs(adapter_models, arch, numerics):
    """Sessions start and finish at different steps (joining and leaving the batch); every session's
    tokens and logits equal its solo run's, bit for bit."""
    model_dir = adapter_models[arch]
    solo = [_solo(model_dir, p, NEW_TOKENS, NUMERICS[numerics]) for p in PROMPTS]
    shard = Shard(model_dir, 0, N_LAYERS, keep_logits=True, numerics=NUMERICS[numerics])
    starts = [0, 0, 2, 3, 5]  # the step at which each session's prefill runs
    tokens: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(PROMPTS))}
    batch_sizes = []
    for tick in range(max(starts) + NEW_TOKENS):
        batch, members = [], []
        for i, prompt in enumerate(PROMPTS):
            step = tick - starts[i]
            if step == 0:
                result = shard.forward(_first(f"s{i}", prompt, (0, N_LAYERS)))
                tokens[i].append(result.token)
                logits[i].append(result.logits)
            elif 0 < step < NEW_TOKENS:
                batch.append(_decode(f"s{i}", tokens[i][-1], len(prompt) + step - 1, step, (0, N_LAYERS)))
                members.append(i)
        if batch:
            batch_sizes.append(len(batch))
            for i, result in zip(members, shard.forward_batch(batch), strict=True):
                assert isinstance(result, StepResult), result
                tokens[i].append(result.token)
                logits[i].append(result.logits)
        for i in range(len(PROMPTS)):
            if tick - starts[i] == NEW_TOKENS - 1:
                shard.release(f"s{i}", 0)  # leaves the batch
    assert max(batch_sizes) == len(PROMPTS) and min(batch_sizes) == 1
    for i, (ref_tokens, ref_logits) in enumerate(solo):
        assert tokens[i] == ref_tokens, f"session {i}"
        for step, (mine, ref) in enumerate(zip(logits[i], ref_logits, strict=True)):
            assert torch.equal(mine, ref), f"session {i} step {step}"
    assert len(shard.kv) == 0 and shard.kv.used_bytes == 0


def test_split_batched_decode_matches_solo(tiny_model):
    """The middle and tail of a split model batch hidden states (not token ids) the same way."""
    head, tail = Shard(tiny_model, 0, 2), Shard(tiny_model, 2, 4)
    solo = [_solo(tiny_model, p, NEW_TOKENS)[0] for p in PROMPTS]
    tokens = {}
    for i, prompt in enumerate(PROMPTS):
        hidden = head.forward(_first(f"s{i}", prompt, (0, 2))).hidden_states
        tokens[i] = [tail.forward(_with_hidden(_first(f"s{i}", prompt, (2, 4)), hidden)).token]
    for step in range(1, NEW_TOKENS):
        firsts = [_decode(f"s{i}", tokens[i][-1], len(p) + step - 1, step, (0, 2)) for i, p in enumerate(PROMPTS)]
        hiddens = [r.hidden_states for r in head.forward_batch(firsts)]
        seconds = [_with_hidden(_decode(f"s{i}", 0, b.start_position, step, (2, 4)), h)
                   for i, (b, h) in enumerate(zip(firsts, hiddens, strict=True))]
        for i, result in enumerate(tail.forward_batch(seconds)):
            tokens[i].append(result.token)
    assert [tokens[i] for i in range(len(PROMPTS))] == solo


@needs_onednn
def test_a_batched_steps_linears_compute_the_numerics_way_without_a_function_mode(tiny_model, monkeypatch):
    """A torch function mode dispatches every torch call in Python; a step's linears are routed to
    the numerics' way at their modules instead, and no call of the step passes through a mode."""
    linears: list[int] = []  # each call's rows
    dispatched: list[object] = []
    linear, dispatch = _Linears.linear, _Linears.__torch_function__

    def counted_linear(self, x, weight, bias):
        linears.append(x.reshape(-1, x.shape[-1]).shape[0])
        return linear(self, x, weight, bias)

    def counted_dispatch(self, func, types, args=(), kwargs=None):
        dispatched.append(func)
        return dispatch(self, func, types, args, kwargs)

    shard = Shard(tiny_model, 0, N_LAYERS, numerics=ONEDNN)
    tokens = _running(shard, 3)
    monkeypatch.setattr(_Linears, "linear", counted_linear)
    monkeypatch.setattr(_Linears, "__torch_function__", counted_dispatch)
    steps = [_decode(f"s{i}", tokens[i], len(PROMPTS[i]), 1, (0, N_LAYERS)) for i in range(3)]
    assert all(isinstance(r, StepResult) for r in shard.forward_batch(steps))
    assert len(linears) == 7 * N_LAYERS + 1  # q, k, v, o, gate, up, down a layer, and the LM head
    assert set(linears) == {3}  # each over the step's three rows
    assert dispatched == []


def _with_hidden(bundle: HiddenStateBundle, hidden: torch.Tensor) -> HiddenStateBundle:
    bundle.tensors = {HIDDEN_STATES: hidden}
    return bundle


def _running(shard: Shard, n: int) -> list[int]:
    """Open sessions s0..s(n-1) with their prompts; return each one's first token."""
    return [shard.forward(_first(f"s{i}", PROMPTS[i], (0, N_LAYERS))).token for i in range(n)]


def test_a_bad_step_in_a_batch_fails_alone(tiny_model):
    shard = Shard(tiny_model, 0, N_LAYERS, keep_logits=True)
    first = _running(shard, 4)
    good = [_decode(f"s{i}", first[i], len(PROMPTS[i]), 1, (0, N_LAYERS)) for i in range(4)]
    bad_position = _decode("s1", first[1], len(PROMPTS[1]) + 3, 1, (0, N_LAYERS))
    bad_range = _decode("s2", first[2], len(PROMPTS[2]), 1, (0, 2))
    bad_shape = _decode("s3", first[3], len(PROMPTS[3]), 1, (0, N_LAYERS))
    bad_shape.tensors = {"input_ids": torch.tensor([[1, 2]])}
    unknown = _decode("nobody", 5, 9, 1, (0, N_LAYERS))
    prefill = _first("fresh", [1, 2, 3], (0, N_LAYERS))
    lengths = {i: shard.kv.get((f"s{i}", 0)).length for i in range(4)}
    out = shard.forward_batch([good[0], bad_position, bad_range, bad_shape, unknown, prefill])
    assert isinstance(out[0], StepResult)
    assert isinstance(out[1], PositionMismatch) and isinstance(out[2], RangeMismatch)
    assert isinstance(out[3], ShapeMismatch) and isinstance(out[4], CacheMiss) and isinstance(out[5], BundleError)
    assert [shard.kv.get((f"s{i}", 0)).length for i in range(1, 4)] == [lengths[i] for i in range(1, 4)]
    assert ("fresh", 0) not in shard.kv
    # the failed sessions are untouched: their steps still run and match a solo run
    rest = shard.forward_batch(good[1:])
    for i, result in enumerate([out[0], *rest]):
        assert result.token == _solo(tiny_model, PROMPTS[i], 2)[0][1]


def test_two_steps_of_one_session_are_not_batched_together(tiny_model):
    shard = Shard(tiny_model, 0, N_LAYERS)
    first = _running(shard, 2)
    step = _decode("s0", first[0], len(PROMPTS[0]), 1, (0, N_LAYERS))
    out = shard.forward_batch([step, step, _decode("s1", first[1], len(PROMPTS[1]), 1, (0, N_LAYERS))])
    assert isinstance(out[0], StepResult) and isinstance(out[1], BundleError) and isinstance(out[2], StepResult)


def test_a_failing_batched_compute_falls_back_to_single_steps(tiny_model, monkeypatch):
    shard = Shard(tiny_model, 0, N_LAYERS)
    first = _running(shard, 3)

    alone = shard._compute_decode

    def broken(xs, sessions, bundles):
        if len(sessions) > 1:
            raise RuntimeError("batched kernel failed")
        return alone(xs, sessions, bundles)

    monkeypatch.setattr(shard, "_compute_decode", broken)
    out = shard.forward_batch([_decode(f"s{i}", first[i], len(PROMPTS[i]), 1, (0, N_LAYERS)) for i in range(3)])
    assert [r.token for r in out] == [_solo(tiny_model, PROMPTS[i], 2)[0][1] for i in range(3)]
    assert [shard.kv.get((f"s{i}", 0)).length for i in range(3)] == [len(PROMPTS[i]) + 1 for i in range(3)]


def test_kv_accounting_and_eviction_with_batches(tiny_model):
    """A session's KV is accounted with its spare room, and a batch commits in order, as steps run one
    by one would."""
    per_token = Shard(tiny_model, 0, N_LAYERS).kv_bytes_per_token()
    lengths = [len(PROMPTS[i]) for i in range(3)]
    rooms = [room_for(n + 1) for n in lengths]  # what each holds from its first decode step
    assert len({room - n for room, n in zip(rooms, lengths, strict=True)}) == 1, "all fill up at one step"
    growth = room_for(rooms[0] + 1) - rooms[0]
    budget = per_token * (sum(rooms) + growth)  # room for s0 to grow its cache, not for s1 as well
    shard = Shard(tiny_model, 0, N_LAYERS, kv_budget_bytes=budget)
    tokens = _running(shard, 3)
    assert shard.kv.used_bytes == per_token * sum(lengths), "a prompt's chunk is held without spare room"
    for step in range(1, rooms[0] - lengths[0] + 1):
        out = shard.forward_batch([_decode(f"s{i}", tokens[i], lengths[i] + step - 1, step, (0, N_LAYERS))
                                   for i in range(3)])
        assert all(isinstance(r, StepResult) for r in out)
        tokens = [r.token for r in out]
        assert shard.kv.used_bytes == sum(shard.kv.get((f"s{i}", 0)).nbytes for i in range(3))
        assert shard.kv.used_bytes == per_token * sum(rooms) <= budget
    step += 1
    out = shard.forward_batch([_decode(f"s{i}", tokens[i], lengths[i] + step - 1, step, (0, N_LAYERS))
                               for i in range(3)])
    # every cache is full: s0's grows within the budget; s1's overflows it and evicts the least
    # recently used session, s2, whose step then finds its KV gone
    assert isinstance(out[0], StepResult) and isinstance(out[1], StepResult)
    assert isinstance(out[2], CacheMiss) and "least recently used" in str(out[2])
    assert ("s2", 0) not in shard.kv and shard.kv.used_bytes <= budget
    assert shard.kv.used_bytes == sum(shard.kv.get((f"s{i}", 0)).nbytes for i in range(2))
    assert shard.kv.used_bytes == per_token * (room_for(rooms[0] + 1) + room_for(rooms[1] + 1))


async def test_concurrent_sessions_through_hosts_batch_and_match_solo(tiny_model):
    """Sessions on two hosts (a split model) step concurrently; the hosts batch them; tokens match."""
    hosts = [ShardHost(tiny_model), ShardHost(tiny_model)]
    await hosts[0].load(0, 2)
    await hosts[1].load(2, 4)
    solo = [_solo(tiny_model, p, NEW_TOKENS)[0] for p in PROMPTS]
    got: dict[int, list[int]] = {}

    async def step(i: int, bundle: HiddenStateBundle) -> int:
        hidden = (await hosts[0].forward(bundle)).hidden_states
        nxt = HiddenStateBundle(session_id=bundle.session_id, epoch=0, step=bundle.step, phase=bundle.phase,
                                start_position=bundle.start_position, token_count=bundle.token_count,
                                tensors={HIDDEN_STATES: hidden}, range_start=2, range_end=4,
                                sample=bundle.sample, sampling=bundle.sampling)
        return (await hosts[1].forward(nxt)).token

    async def session(i: int) -> None:
        prompt = PROMPTS[i]
        tokens = []
        for b in input_bundles(f"s{i}", 0, prompt, 0, 4, (0, 2), Sampling()):
            token = await step(i, b)
        tokens.append(token)
        for n in range(1, NEW_TOKENS):
            tokens.append(await step(i, _decode(f"s{i}", tokens[-1], len(prompt) + n - 1, n, (0, 2))))
        got[i] = tokens
        for host in hosts:
            host.release(f"s{i}", 0)

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(session, i)
    assert [got[i] for i in range(len(PROMPTS))] == solo
    assert max(h.batcher.stats.largest_batch for h in hosts) > 1
    assert all(len(h.shard.kv) == 0 for h in hosts)
    assert [h._forms_waves() for h in hosts] == [True, False]  # waves form where routes enter the model
    for host in hosts:
        host.close()


# -- the scheduler alone -----------------------------------------------------------------------------


def _bundle(session: str, phase: Phase, position: int, tokens: int = 1) -> HiddenStateBundle:
    return HiddenStateBundle(session_id=session, epoch=0, step=0, phase=phase, start_position=position,
                             token_count=tokens, tensors={}, range_start=0, range_end=1)


class _Recorder:
    """Fake compute: records each call's sessions; a call takes ``delay`` seconds of Trio time."""

    def __init__(self, delay: float = 1.0) -> None:
        self.calls: list[list[str]] = []
        self.delay = delay

    async def batch(self, bundles):
        self.calls.append([b.session_id for b in bundles])
        await trio.sleep(self.delay)
        return [ValueError("bad") if b.session_id.startswith("bad") else StepResult(token=b.start_position)
                for b in bundles], self.delay

    async def one(self, bundle):
        self.calls.append([bundle.session_id])
        await trio.sleep(self.delay)
        if bundle.session_id.startswith("bad"):
            raise ValueError("bad")
        return StepResult(token=bundle.start_position), self.delay

    async def prefill(self, bundles, pause, between):
        """Chunks computed together, as one call."""
        return await self.batch(bundles)


async def test_steps_waiting_together_form_one_batch_and_prefill_interleaves(autojump_clock):
    rec = _Recorder()
    batcher = StepBatcher(rec.batch, rec.one, max_batch=3)
    results = {}
    waited = {}

    async def submit(name, bundle, delay=0.0):
        await trio.sleep(delay)
        try:
            result = await batcher.submit(bundle)
        except ValueError as exc:
            results[name] = str(exc)
        else:
            results[name] = result.token
            waited[name] = (round(result.queue_ms), round(result.compute_ms))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, "a", _bundle("a", Phase.DECODE, 5))
        for i, name in enumerate(("b", "c", "d", "e")):  # arrive while a runs
            nursery.start_soon(submit, name, _bundle(name, Phase.DECODE, 10 + i), 0.1 + i / 100)
        nursery.start_soon(submit, "p1", _bundle("p1", Phase.PREFILL, 0, 8), 0.2)
        nursery.start_soon(submit, "p2", _bundle("p2", Phase.PREFILL, 0, 8), 0.25)
        nursery.start_soon(submit, "bad", _bundle("bad", Phase.DECODE, 3), 0.3)
    # a alone; then up to 3 waiting decodes; e, which waited for the turn before p1, and bad with it;
    # then the prefill chunks, each computed by its own submitter, so no decode step's result waits for one
    assert rec.calls == [["a"], ["b", "c", "d"], ["e", "bad"], ["p1"], ["p2"]]
    assert results == {"a": 5, "b": 10, "c": 11, "d": 12, "e": 13, "p1": 0, "p2": 0, "bad": "bad"}
    # each step's time is split into waiting for the compute and computing (1 s per call here)
    assert waited["a"] == (0, 1000) and waited["b"] == (900, 1000) and waited["d"] == (880, 1000)
    assert waited["p1"] == (2800, 1000) and waited["e"] == (1870, 1000)
    assert batcher.stats.decode_batches == 3 and batcher.stats.largest_batch == 3
    assert batcher.stats.prefill_chunks == 2 and batcher.waiting == 0


async def test_the_batcher_counts_its_compute_time_decode_apart_from_prefill(autojump_clock):
    rec = _Recorder(delay=0.5)
    batcher = StepBatcher(rec.batch, rec.one)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.submit, _bundle("a", Phase.DECODE, 5))
        await trio.sleep(0.05)  # the first call, a alone, has begun
        for name in ("b", "c"):
            nursery.start_soon(batcher.submit, _bundle(name, Phase.DECODE, 9))
        await trio.sleep(0.05)
        nursery.start_soon(batcher.submit, _bundle("p", Phase.PREFILL, 0, 8))
    assert [sorted(call) for call in rec.calls] == [["a"], ["b", "c"], ["p"]]
    summary = batcher.stats.summary()
    assert (summary["decode_compute_s"], summary["prefill_compute_s"]) == (1.0, 0.5)
    batcher.stats.reset()
    assert (batcher.stats.decode_compute_s, batcher.stats.prefill_compute_s) == (0.0, 0.0)


async def test_a_cancelled_waiting_step_leaves_the_queue(autojump_clock):
    rec = _Recorder()
    batcher = StepBatcher(rec.batch, rec.one)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.submit, _bundle("a", Phase.DECODE, 5))
        await trio.sleep(0.1)
        with trio.move_on_after(0.2):
            await batcher.submit(_bundle("gone", Phase.DECODE, 7))
        assert batcher.waiting == 0
    assert rec.calls == [["a"]]


async def _submit_at(batcher, name, times, results):
    for position, at in enumerate(times, start=1):
        await trio.sleep_until(at)
        result = await batcher.submit(_bundle(name, Phase.DECODE, position))
        results.append((name, position, round(trio.current_time(), 3), round(result.queue_ms)))


async def _sessions(schedules: dict[str, list[float]], shared: bool = True):
    """Decode steps of each session submitted at the given times (compute: 1 s a call, whatever its
    size); the recorder, the batcher and each step's (session, position, time done, queue ms)."""
    rec = _Recorder(delay=1.0)
    batcher = StepBatcher(rec.batch, rec.one, shared_machine=lambda: shared)
    results = []
    async with trio.open_nursery() as nursery:
        for name, times in schedules.items():
            nursery.start_soon(_submit_at, batcher, name, times, results)
    return rec, batcher, results


async def test_a_batch_is_held_for_a_session_due_within_one_step(autojump_clock):
    # both come back every 10 s; at the third round b is due 0.5 s after a, within one step (1 s)
    rec, batcher, results = await _sessions({"a": [0.0, 10.0, 20.0], "b": [0.5, 10.5, 20.5]}, shared=False)
    assert rec.calls[-1] == ["a", "b"]  # one forward for both, not a alone and then b
    assert batcher.stats.held_batches == 1 and batcher.stats.held_s == pytest.approx(0.5)
    assert ("a", 3, 21.5, 500) in results and ("b", 3, 21.5, 0) in results


async def test_on_machines_of_their_own_no_holding_for_sessions_due_later_or_for_a_lone_session(autojump_clock):
    rec, batcher, _ = await _sessions({"a": [0.0, 10.0, 20.0], "c": [5.0, 15.0, 25.0]}, shared=False)  # c: 5 s on
    assert all(len(call) == 1 for call in rec.calls) and batcher.stats.held_batches == 0
    _, lone, results = await _sessions({"z": [30.0, 40.0, 50.0]})
    assert lone.stats.held_batches == 0 and [r[3] for r in results] == [0, 0, 0]


async def test_a_finished_session_is_not_waited_for(autojump_clock):
    _, batcher, results = await _sessions({"a": [0.0, 10.0], "b": [0.5, 10.5]}, shared=False)
    batcher.forget("b", 0)  # b would be due at 20.5, within a step of a's next one
    await _submit_at(batcher, "a", [20.0], results)
    assert batcher.stats.held_batches == 0 and results[-1] == ("a", 1, 21.0, 0)


async def test_a_failed_batch_fails_its_steps_and_the_prefill_after_it_still_runs(autojump_clock):
    rec = _Recorder(delay=1.0)

    async def broken_batch(bundles):
        rec.calls.append([b.session_id for b in bundles])
        await trio.sleep(1.0)
        raise RuntimeError("compute thread gone")

    batcher = StepBatcher(broken_batch, rec.one)
    outcomes = {}

    async def submit(name, bundle, delay):
        await trio.sleep(delay)
        try:
            outcomes[name] = (await batcher.submit(bundle)).token
        except RuntimeError as exc:
            outcomes[name] = str(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, "a", _bundle("a", Phase.DECODE, 5), 0.0)
        nursery.start_soon(submit, "b", _bundle("b", Phase.DECODE, 6), 0.1)
        nursery.start_soon(submit, "c", _bundle("c", Phase.DECODE, 7), 0.2)
        nursery.start_soon(submit, "p", _bundle("p", Phase.PREFILL, 0, 8), 0.3)
    assert [sorted(call) for call in rec.calls] == [["a"], ["b", "c"], ["p"]]
    assert outcomes == {"a": 5, "b": "compute thread gone", "c": "compute thread gone", "p": 0}


class _CostedRecorder(_Recorder):
    """Fake compute whose step takes ``costs[rows]`` seconds (the last figure for larger steps)."""

    def __init__(self, costs: dict[int, float]) -> None:
        super().__init__()
        self.costs = costs

    def _cost(self, rows: int) -> float:
        return self.costs.get(rows, self.costs[max(self.costs)])

    async def batch(self, bundles):
        self.calls.append([b.session_id for b in bundles])
        cost = self._cost(len(bundles))
        await trio.sleep(cost)
        return [StepResult(token=b.start_position) for b in bundles], cost

    async def one(self, bundle):
        self.calls.append([bundle.session_id])
        await trio.sleep(self._cost(1))
        return StepResult(token=bundle.start_position), self._cost(1)


async def _looping(batcher, name: str, start: float, steps: int, away: float, calls: list,
                   late: dict[int, float] | None = None) -> None:
    """A session of a route: each decode step submitted ``away`` seconds after the last one's result
    (the time it spends at the other hops), as a real route's sessions come back; the step at position
    ``p`` another ``late[p]`` seconds later."""
    await trio.sleep_until(start)
    for position in range(1, steps + 1):
        await trio.sleep((late or {}).get(position, 0.0))
        await batcher.submit(_bundle(name, Phase.DECODE, position))
        await trio.sleep(away)
    calls.append(name)


async def _route(costs: dict[int, float], shared: bool, starts: dict[str, float], steps: int = 12,
                 away: float = 5.0, **options):
    rec = _CostedRecorder(costs)
    batcher = StepBatcher(rec.batch, rec.one, shared_machine=lambda: shared, **options)
    done: list = []
    async with trio.open_nursery() as nursery:
        for name, start in starts.items():
            nursery.start_soon(_looping, batcher, name, start, steps, away, done)
    return rec, batcher


async def test_the_batcher_learns_its_step_costs_by_size(autojump_clock):
    _, batcher = await _route({1: 1.0, 2: 1.2}, True, {"a": 0.0, "b": 2.5})
    table = batcher.stats.summary()["step_costs"]
    assert table["decode_ms"]["1"] == 1000.0 and table["decode_ms"]["2"] == 1200.0
    assert table["decode_rows_per_s"]["2"] == pytest.approx(2 / 1.2, abs=0.01)
    assert batcher.costs.decode_s(2) == pytest.approx(1.2)


async def test_on_a_shared_machine_sessions_apart_are_drawn_into_one_wave(autojump_clock):
    # b starts 2.5 s after a; both spend 5 s elsewhere between steps. Two rows cost 1.2 s against 2 s
    # apart, so a waits for b once, and from then on they come back together
    rec, batcher = await _route({1: 1.0, 2: 1.2}, True, {"a": 0.0, "b": 2.5})
    together = [i for i, call in enumerate(rec.calls) if sorted(call) == ["a", "b"]]
    assert len(together) >= 10 and together == list(range(together[0], together[0] + len(together)))
    assert batcher.stats.held_batches >= 1 and batcher.stats.shared_machine is True


async def test_no_wave_is_formed_where_rows_cost_what_they_add(autojump_clock):
    # two rows cost twice one: waiting would only delay. Tried once (a size never seen is taken as
    # free), then known: nobody is waited for again.
    _, batcher = await _route({1: 1.0, 2: 2.0}, True, {"a": 0.0, "b": 2.5})
    assert batcher.stats.held_batches <= 2 and batcher.costs.decode_s(2) == pytest.approx(2.0)
    held = batcher.stats.held_batches
    async with trio.open_nursery() as nursery:  # two more sessions apart, on the hop that now knows
        for name, start in (("c", trio.current_time()), ("d", trio.current_time() + 2.5)):
            nursery.start_soon(_looping, batcher, name, start, 6, 5.0, [])
    assert batcher.stats.held_batches == held


async def test_hops_on_a_machine_of_their_own_keep_their_waves(autojump_clock):
    # the same cheap second row; but with the machine otherwise idle, b (due 2.5 s from a, past a
    # one-row step of 1 s) is never waited for: each hop of a pipeline keeps a wave busy
    rec, batcher = await _route({1: 1.0, 2: 1.0}, False, {"a": 0.0, "b": 2.5})
    assert batcher.stats.held_batches == 0 and all(len(call) == 1 for call in rec.calls)
    assert batcher.stats.shared_machine is False


async def test_the_latency_bound_caps_a_batch_by_its_expected_cost(autojump_clock):
    rec = _CostedRecorder({1: 1.0, 2: 1.0, 3: 3.0})
    batcher = StepBatcher(rec.batch, rec.one, latency_bound_s=2.0, shared_machine=lambda: True)
    for rows, seconds in ((1, 1.0), (2, 1.0), (3, 3.0)):
        batcher.costs.observe_decode(rows, seconds)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.submit, _bundle("a", Phase.DECODE, 5))
        for i, name in enumerate(("b", "c", "d")):
            nursery.start_soon(_later, 0.1 + i / 100, batcher.submit, _bundle(name, Phase.DECODE, 9))
    assert rec.calls == [["a"], ["b", "c"], ["d"]]  # three rows would take 3 s, over the 2 s bound


async def _later(delay, fn, *args):
    await trio.sleep(delay)
    await fn(*args)


def _machine(monkeypatch, cpus: int, allowed: tuple[int, ...]):
    """A fake machine of ``cpus`` CPUs whose busy times the test sets, this process allowed on
    ``allowed`` (empty: the platform does not say)."""
    from types import SimpleNamespace

    from meshd.runtime import machine_share

    busy = [0.0] * cpus
    own = {"user": 0.0}
    monkeypatch.setattr(machine_share.psutil, "cpu_times", lambda percpu: [SimpleNamespace(
        user=b, nice=0.0, system=0.0, irq=0.0, softirq=0.0, steal=0.0, idle=0.0) for b in busy])
    monkeypatch.setattr(machine_share, "_allowed_cpus", lambda: allowed)

    class _Process:
        def cpu_times(self):
            return SimpleNamespace(user=own["user"], system=0.0)

    monkeypatch.setattr(machine_share.psutil, "Process", _Process)
    return busy, own


def test_the_machine_counts_as_shared_while_other_processes_fill_its_cores(monkeypatch):
    from meshd.runtime import machine_share

    now = [0.0]
    busy, own = _machine(monkeypatch, 2, ())
    share = machine_share.MachineShare(sample_s=1.0, clock=lambda: now[0])
    assert share() is True and share.others is None  # nothing known yet: one wave is never wrong
    now[0], busy[0], own["user"] = 1.0, 0.5, 0.45  # only this process computed
    assert share() is False and share.others == pytest.approx(0.025)
    for t in range(2, 6):  # others keep 1.5 of the 2 CPUs busy
        now[0], busy[0], busy[1], own["user"] = float(t), busy[0] + 0.9, busy[1] + 0.9, own["user"] + 0.3
    share._read(now[0])
    assert share() is True and share.others > 0.25


def test_a_process_pinned_to_some_cpus_counts_only_the_work_on_them(monkeypatch):
    """Three hops pinned to their own pairs of a large machine's cores do not share; a process on the
    pinned pair does."""
    from meshd.runtime import machine_share

    now = [0.0]
    busy, own = _machine(monkeypatch, 6, (2, 3))
    share = machine_share.MachineShare(sample_s=1.0, clock=lambda: now[0])
    share()
    for t in range(1, 5):  # this process fills CPUs 2 and 3, the other hops fill 0, 1, 4 and 5
        now[0], own["user"] = float(t), own["user"] + 1.8
        for cpu in range(6):
            busy[cpu] += 0.9
        share._read(now[0])
    assert share() is False and share.others == pytest.approx(0.0)
    for t in range(5, 9):  # another process on the pair takes 0.8 of its CPU time from this one
        now[0], own["user"] = float(t), own["user"] + 1.0
        for cpu in range(6):
            busy[cpu] += 0.9
        share._read(now[0])
    assert share() is True and share.others > 0.25


# -- prefill in slices -------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "numerics"),
                         [(arch, n) for arch in sorted(ARCHS) for n in ("float32", "bfloat16")]
                         + [pytest.param(arch, "float32-onednn", marks=needs_onednn) for arch in sorted(ARCHS)])
def test_a_prefill_in_slices_with_decode_steps_between_computes_what_one_call_does(adapter_models, arch, numerics):
    """A chunk computed a layer at a time, with another session's decode step run between every two
    layers, gives the logits one call gives, and so does the decoding session, bit for bit."""
    model_dir = adapter_models[arch]
    long_prompt, short_prompt = PROMPTS[4], PROMPTS[1]
    solo_long, solo_long_logits = _solo(model_dir, long_prompt, 2, NUMERICS[numerics])
    _, solo_short_logits = _solo(model_dir, short_prompt, N_LAYERS, NUMERICS[numerics])
    shard = Shard(model_dir, 0, N_LAYERS, keep_logits=True, numerics=NUMERICS[numerics])
    short = shard.forward(_first("short", short_prompt, (0, N_LAYERS)))
    tokens, logits = [short.token], [short.logits]
    run = shard.start_prefill([_first("long", long_prompt, (0, N_LAYERS))])
    slices = 1
    while not run.advance(lambda: True):  # a slice of one layer
        step = _decode("short", tokens[-1], len(short_prompt) + len(tokens) - 1, len(tokens), (0, N_LAYERS))
        result = shard.forward(step)
        tokens.append(result.token)
        logits.append(result.logits)
        slices += 1
    (first,) = run.finish()
    assert isinstance(first, StepResult)
    assert slices == N_LAYERS
    assert first.token == solo_long[0] and torch.equal(first.logits, solo_long_logits[0])
    assert all(torch.equal(a, b) for a, b in zip(logits, solo_short_logits, strict=True))
    assert shard.kv.get(("long", 0)).length == len(long_prompt)
    step = shard.forward(_decode("long", first.token, len(long_prompt), 1, (0, N_LAYERS)))
    assert torch.equal(step.logits, solo_long_logits[1])


def test_a_slice_that_fails_leaves_the_session_as_it_was(tiny_model, monkeypatch):
    prompt = PROMPTS[4]
    solo, _ = _solo(tiny_model, prompt, 2)
    shard = Shard(tiny_model, 0, N_LAYERS)
    chunks = list(input_bundles("s", 0, prompt, 0, 10, (0, N_LAYERS), Sampling()))
    assert shard.forward(chunks[0]).token is None
    fail_at_layer(monkeypatch, shard, 2)
    run = shard.start_prefill([chunks[1]])
    assert not run.advance(lambda: True)  # layer 0 done
    with pytest.raises(RuntimeError, match="kernel failed"):
        run.advance(lambda: False)
    assert shard.kv.get(("s", 0)).length == 10
    fresh = shard.start_prefill([_first("fresh", prompt, (0, N_LAYERS))])
    with pytest.raises(RuntimeError, match="kernel failed"):
        fresh.advance(lambda: False)
    assert ("fresh", 0) not in shard.kv  # a session the chunk opened is gone with it
    monkeypatch.undo()
    assert shard.forward(chunks[1]).token is None
    first = shard.forward(chunks[2])
    assert first.token == solo[0]
    assert shard.forward(_decode("s", first.token, len(prompt), 1, (0, N_LAYERS))).token == solo[1]


class _SlicedRecorder(_Recorder):
    """Fake compute whose decode steps take 1 s, and prefill chunks ``slices`` pieces of ``piece_s``
    seconds each, with a chance to pause after each."""

    def __init__(self, slices: int, piece_s: float = 1.0) -> None:
        super().__init__(delay=1.0)
        self.slices = slices
        self.piece_s = piece_s

    async def prefill(self, bundles, pause, between):
        for i in range(self.slices):
            self.calls.append([f"{bundle.session_id}/{i}" for bundle in bundles])
            await trio.sleep(self.piece_s)
            if i < self.slices - 1 and pause():
                await between()
        return [StepResult(token=bundle.start_position) for bundle in bundles], self.slices * self.piece_s


async def test_decode_steps_queued_during_a_prefill_run_between_its_slices(autojump_clock):
    rec = _SlicedRecorder(slices=4)
    batcher = StepBatcher(rec.batch, rec.one, run_prefill=rec.prefill, slice_s=1e-9)  # every slice ends at once
    done = {}

    async def submit(name, bundle, delay):
        await trio.sleep(delay)
        result = await batcher.submit(bundle)
        done[name] = (trio.current_time(), result.token)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, "p", _bundle("p", Phase.PREFILL, 0, 64), 0.0)
        nursery.start_soon(submit, "a", _bundle("a", Phase.DECODE, 7), 0.5)
        nursery.start_soon(submit, "b", _bundle("b", Phase.DECODE, 8), 0.7)
        nursery.start_soon(submit, "c", _bundle("c", Phase.DECODE, 9), 2.5)
    # a and b waited for the slice in progress, not for the whole chunk; c for the next one
    assert rec.calls == [["p/0"], ["a", "b"], ["p/1"], ["c"], ["p/2"], ["p/3"]]
    assert done["a"] == (2.0, 7) and done["b"] == (2.0, 8) and done["c"] == (4.0, 9) and done["p"] == (6.0, 0)
    stats = batcher.stats.summary()
    assert stats["decode_stall_bound_ms"] == pytest.approx(1000.0)  # one slice, not the chunk's 4 s
    assert stats["decodes_between_slices"] == 2 and stats["prefill_chunks"] == 1
    assert stats["decode_batches"] == 2 and batcher.waiting == 0
    assert batcher.costs.summary()["prefill_ms_by_chunk"] == {"64": 4000.0}  # the whole chunk's compute


async def test_a_decode_step_that_takes_the_turn_is_not_held_up_by_a_prefill_chunk(autojump_clock):
    """The submitter whose turn runs a decode batch returns with its result; a prompt queued meanwhile
    is computed by its own submitter's turn."""
    rec = _SlicedRecorder(slices=4)
    batcher = StepBatcher(rec.batch, rec.one, run_prefill=rec.prefill, slice_s=1e-9, hold_factor=0.0)
    done = {}

    async def submit(name, bundle, delay):
        await trio.sleep(delay)
        await batcher.submit(bundle)
        done[name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, "x", _bundle("x", Phase.DECODE, 3), 0.0)
        nursery.start_soon(submit, "a", _bundle("a", Phase.DECODE, 7), 0.1)
        nursery.start_soon(submit, "p", _bundle("p", Phase.PREFILL, 0, 64), 0.2)
    assert rec.calls == [["x"], ["a"], ["p/0"], ["p/1"], ["p/2"], ["p/3"]]
    assert done == {"x": 1.0, "a": 2.0, "p": 6.0}


async def _decoding_while_a_prompt_is_computed(away: dict[str, float], prompts: int = 1) -> list[list[str]]:
    """Sessions that decode in a loop, each away for its time between a result and its next step,
    while a 40-piece prompt arrives (with ``prompts - 1`` others right behind it, which join it);
    returns the calls computed."""
    rec = _SlicedRecorder(slices=40, piece_s=0.2)
    batcher = StepBatcher(rec.batch, rec.one, run_prefill=rec.prefill, slice_s=3.0, hold_factor=0.0,
                          clock=trio.current_time, prefill_tokens=lambda: 64 * prompts)

    async def decode(name: str) -> None:
        for position in range(1, 20):
            await batcher.submit(_bundle(name, Phase.DECODE, position))
            await trio.sleep(away[name])

    async def prompt(name: str, at: float) -> None:
        await trio.sleep(at)
        await batcher.submit(_bundle(name, Phase.PREFILL, 0, 64))

    async with trio.open_nursery() as nursery:
        for name in away:
            nursery.start_soon(decode, name)
        for i in range(prompts):
            nursery.start_soon(prompt, "p" if i == 0 else f"q{i}", 5.0 + i / 1000)
    return rec.calls


def _between_slices(calls: list[list[str]]) -> tuple[list[list[str]], list[int]]:
    """The decode batches run between the prompt's slices, and the pieces of each slice but the last."""
    pieces = [i for i, call in enumerate(calls) if call[0].startswith("p/")]
    batches: list[list[str]] = []
    slices = [0]
    for call in calls[pieces[0]:pieces[-1]]:
        if call[0].startswith("p/"):
            slices[-1] += 1
        else:
            batches.append(sorted(call))
            slices.append(0)
    return batches, slices[:-1]


async def test_a_slice_goes_on_until_every_session_due_back_within_it_has_come(autojump_clock):
    """Sessions handed a result here come back within a slice (a hop holding the whole route): the
    slice waits for all of them, so they decode together between slices rather than one by one, and
    it computes as long as their batch takes (1 s, five pieces) before it pauses for them."""
    between, slices = _between_slices(await _decoding_while_a_prompt_is_computed({"a": 0.1, "b": 0.5}))
    assert between and all(batch == ["a", "b"] for batch in between)
    assert slices and all(5 <= pieces <= 6 for pieces in slices)  # a piece past 1 s at most


@pytest.mark.parametrize(("prompts", "pieces"), [(2, 10), (3, 15), (6, 20)])
async def test_prompts_computed_together_get_the_hop_per_session(autojump_clock, prompts, pieces):
    """Several prompts computed as one against one decoding session slice as many times longer as
    they are sessions, up to four times: seven prompts are not held to the pace one session's lone
    steps set, and the decode stall stays bounded."""
    calls = await _decoding_while_a_prompt_is_computed({"a": 0.1}, prompts)
    assert all(len(call) == prompts for call in calls if call[0].startswith("p/"))  # the prompts as one
    between, slices = _between_slices(calls)
    assert between and all(batch == ["a"] for batch in between)
    assert slices and all(pieces <= n <= pieces + 1 for n in slices)  # a lone prompt's are 5 (1 s)


def test_the_share_of_prompts_together_is_per_session_and_bounded():
    assert prompt_share(1, 1) == prompt_share(1, 8) == prompt_share(3, 8) == 1.0  # a lone prompt: even
    assert prompt_share(2, 1) == 2.0 and prompt_share(6, 2) == 3.0
    assert prompt_share(7, 1) == prompt_share(50, 1) == PROMPT_SHARE_MAX


async def test_a_slice_does_not_wait_for_a_session_due_back_after_it(autojump_clock):
    """A session due back after the slice would end (its other hops take longer) is not waited for:
    the slice pauses for the one due within it."""
    between, _ = _between_slices(await _decoding_while_a_prompt_is_computed({"a": 0.1, "b": 6.0}))
    assert ["a"] in between


@pytest.mark.parametrize(("tokens", "expected"), [
    (0, [["a"], ["d"], ["p1"], ["p2"], ["p3"], ["p4"]]),
    (16, [["a"], ["d"], ["p1", "p2"], ["p3", "p4"]]),
    (24, [["a"], ["d"], ["p1", "p2", "p3"], ["p4"]]),
])
async def test_queued_chunks_join_the_oldest_up_to_the_token_budget(autojump_clock, tokens, expected):
    """Chunks queued behind the oldest one join it while their tokens fit what the shard may compute
    as one; the decode step queued among them runs first, and every chunk gets its own result."""
    compute = _Recorder()
    batcher = StepBatcher(compute.batch, compute.one, run_prefill=compute.prefill, hold_factor=0.0,
                          prefill_tokens=lambda: tokens)
    answered = {}

    async def submit(name: str, bundle: HiddenStateBundle, delay: float) -> None:
        await trio.sleep(delay)
        answered[name] = ((await batcher.submit(bundle)).token, trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, "a", _bundle("a", Phase.DECODE, 4), 0.0)
        for i, name in enumerate(("p1", "d", "p2", "p3", "p4")):  # all arrive while a computes
            bundle = _bundle(name, Phase.DECODE, 6) if name == "d" else _bundle(name, Phase.PREFILL, 10 * i, 8)
            nursery.start_soon(submit, name, bundle, 0.1 + i / 10)
    assert compute.calls == expected
    assert {name: token for name, (token, _) in answered.items()} == {
        "a": 4, "d": 6, "p1": 0, "p2": 20, "p3": 30, "p4": 40}
    ends = [float(n) for n in range(3, len(expected) + 1) for _ in range(len(expected[n - 1]))]
    assert [answered[name][1] for name in ("p1", "p2", "p3", "p4")] == ends
    stats = batcher.stats.summary()
    assert stats["prefill_chunks"] == 4
    assert stats["prefill_runs"] == {0: {"1": 4}, 16: {"2": 2}, 24: {"1": 1, "3": 1}}[tokens]


class _RestartingRecorder(_SlicedRecorder):
    """Sliced fake compute that starts again from its first piece, with them, when ``between()`` hands
    it chunks to take in, as a host's prefill run does."""

    async def prefill(self, bundles, pause, between):
        bundles, i = list(bundles), 0
        while i < self.slices:
            self.calls.append([f"{bundle.session_id}/{i}" for bundle in bundles])
            await trio.sleep(self.piece_s)
            i += 1
            if i < self.slices and pause():
                joining = await between()
                if joining:
                    bundles, i = bundles + list(joining), 0
        return [StepResult(token=bundle.start_position) for bundle in bundles], self.slices * self.piece_s


async def _prompts_arriving(at: dict[str, float], tokens: int = 64, slice_s: float = 1.0,
                            budget: int = 256) -> tuple[list[list[str]], dict[str, float], StepBatcher]:
    """Prompts of ``tokens`` tokens arriving at the given times at a batcher computing each prefill run in
    5 pieces of 0.2 s; the calls, when each prompt got its result, and the batcher."""
    rec = _RestartingRecorder(slices=5, piece_s=0.2)
    batcher = StepBatcher(rec.batch, rec.one, run_prefill=rec.prefill, slice_s=slice_s, hold_factor=0.0,
                          clock=trio.current_time, prefill_tokens=lambda: budget)
    done: dict[str, float] = {}

    async def prompt(name: str, delay: float) -> None:
        await trio.sleep(delay)
        assert (await batcher.submit(_bundle(name, Phase.PREFILL, 0, tokens))).token == 0
        done[name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        for name, delay in at.items():
            nursery.start_soon(prompt, name, delay)
    return rec.calls, done, batcher


async def test_prompts_queued_within_a_runs_first_slice_are_taken_in_and_computed_with_it(autojump_clock):
    """A prompt computing alone starts again with the prompts that queue behind it within its first
    slice (counted from each start), so that all are computed in one pass and answered together; one
    queued later waits for the run to end, and is computed on its own."""
    calls, done, batcher = await _prompts_arriving({"a": 0.0, "b": 0.1, "c": 0.5, "late": 2.0})
    # b is taken in after a's first piece, c two pieces into the second start; then the run goes through
    assert calls[:4] == [["a/0"], ["a/0", "b/0"], ["a/1", "b/1"], ["a/0", "b/0", "c/0"]]
    assert calls[7] == ["a/4", "b/4", "c/4"] and calls[8:] == [[f"late/{i}"] for i in range(5)]
    assert done == {"a": pytest.approx(1.6), "b": pytest.approx(1.6), "c": pytest.approx(1.6),
                    "late": pytest.approx(3.0)}
    stats = batcher.stats.summary()
    assert stats["prefill_restarts"] == 2 and stats["prefill_runs"] == {"1": 1, "3": 1}
    assert stats["prefill_chunks"] == 4 and batcher.waiting == 0


async def test_a_prefill_run_takes_in_only_what_fits_and_starts_again_a_bounded_number_of_times(autojump_clock):
    """Chunks beyond the tokens the shard computes as one are not taken in, and a run starts again at
    most ``RESTARTS_MAX`` times, however many prompts trickle in within its slices."""
    calls, _done, batcher = await _prompts_arriving({"a": 0.0, "b": 0.1, "third": 0.15}, budget=128)
    assert calls[1] == ["a/0", "b/0"] and ["third/0"] in calls  # 64 + 64 fit; 64 more do not
    assert batcher.stats.prefill_runs == {2: 1, 1: 1} and batcher.stats.prefill_restarts == 1

    trickle = {f"p{i}": 0.1 + 0.2 * i for i in range(6)}
    _calls, _done, batcher = await _prompts_arriving({"a": 0.0, **trickle}, tokens=8, slice_s=10.0)
    assert batcher.stats.prefill_restarts == RESTARTS_MAX
    assert batcher.stats.prefill_chunks == 7 and batcher.waiting == 0


async def _wave_of_two(step_s: float, gap_s: float, steps: int = 12) -> _CostedRecorder:
    """A later hop on a shared machine (a row costs ``step_s``, two 1.2 times that) getting a wave of two
    from the hop before: b sent ``gap_s`` after a, both back ``5 * step_s`` after their result."""
    rec = _CostedRecorder({1: step_s, 2: 1.2 * step_s})
    batcher = StepBatcher(rec.batch, rec.one, shared_machine=lambda: True, forms_waves=lambda: False)
    for position in range(1, steps + 1):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.submit, _bundle("a", Phase.DECODE, position))
            await trio.sleep(gap_s)
            nursery.start_soon(batcher.submit, _bundle("b", Phase.DECODE, position))
        await trio.sleep(5 * step_s)
    assert batcher.stats.shared_machine is True
    return rec


async def test_on_a_shared_machine_a_hop_past_the_first_layer_waits_only_for_a_wave_in_flight(autojump_clock):
    """Only the hop where routes enter draws sessions into waves: a later hop, on the same shared machine
    and with the same cheap second row, waits for a session due within the period only while steps keep
    arriving less than ``QUIET_STEPS`` of a one-row step (or ``QUIET_MIN_S``) apart, a wave in flight, and
    at most ``IN_FLIGHT_STEPS`` one-row steps. The two sessions of a wave sent 0.05 s apart (1 s steps),
    or 1.5 ms apart (10 ms steps: the floor), compute together; sessions 0.5 s and 2.5 s apart do not,
    and their holds end with the lull after the last arrival rather than at the cap."""
    for step_s, gap_s in ((1.0, 0.05), (0.01, 0.0015)):
        rec = await _wave_of_two(step_s, gap_s)
        # from the third step on, when both have a period to be expected by, they compute together
        assert [sorted(call) for call in rec.calls[4:]] == [["a", "b"]] * 10, (step_s, gap_s)
    for apart in (0.5, 2.5):  # b due within the 2 s cap of a at 0.5 s apart
        now = trio.current_time()
        rec, batcher = await _route({1: 1.0, 2: 1.2}, True, {"a": now, "b": now + apart}, forms_waves=lambda: False)
        assert all(len(call) == 1 for call in rec.calls)
        # the holds end 0.1 s (QUIET_STEPS of the 1 s step) after the last arrival, not at the 2 s cap
        assert batcher.stats.held_batches >= 10
        assert batcher.stats.held_s <= (0.1 + 1e-6) * batcher.stats.held_batches


async def _ring(waves_at: set[int], sessions: int = 6, steps: int = 30) -> tuple[float, list[list[list[str]]]]:
    """Sessions looping through a route of three hops on one shared machine (steps of 1 s for a row, 1.2 s
    for more), started 0.7 s apart; the hops in ``waves_at`` form waves. Session i's steps cross between
    hops in (i + 1) ms, so that no two events fall on one instant and Trio's random choice among tasks
    ready together cannot change the outcome. When the last step ended, and each hop's calls."""
    recs = [_CostedRecorder({1: 1.0, 2: 1.2}) for _ in range(3)]
    hops = [StepBatcher(r.batch, r.one, forms_waves=lambda i=i: i in waves_at) for i, r in enumerate(recs)]

    async def session(name: str, start: float) -> None:
        await trio.sleep(start)
        for position in range(1, steps + 1):
            for hop in hops:
                await hop.submit(_bundle(name, Phase.DECODE, position))
                await trio.sleep(0.001 * (int(name[1:]) + 1))
        for hop in hops:  # the route's hops release the session
            hop.forget(name, 0)

    async with trio.open_nursery() as nursery:
        for i in range(sessions):
            nursery.start_soon(session, f"s{i}", 0.7 * i)
    return trio.current_time(), [r.calls for r in recs]


async def test_waves_formed_where_routes_enter_move_through_the_route_whole(autojump_clock):
    """Sessions that start apart are drawn into one wave by the first hop alone, and the hops after it,
    which wait only for a wave in flight, compute it whole: the steps before the last of each hop are
    waves of all six sessions (the first sessions, ahead before the wave formed, end a step sooner), and
    the route ends sooner than when no hop forms waves."""
    start = trio.current_time()
    end, calls = await _ring({0})
    for hop in calls:
        assert [len(call) for call in hop][-8:-1] == [6] * 7
    waves_s, start = end - start, end
    end, apart = await _ring(set())
    assert all(max(len(call) for call in hop) < 6 for hop in apart)  # no hop forming waves: none form
    assert waves_s < end - start



async def _pair_with_b_late(late: dict[int, float], steps: int = 12) -> tuple[_CostedRecorder, StepBatcher]:
    """Sessions a and b drawn into one wave by the hop where routes enter, on a shared machine (a row
    costs 1 s, two 1.2 s), each back 5 s after its result; b's steps at the positions in ``late`` come
    that many seconds later."""
    rec = _CostedRecorder({1: 1.0, 2: 1.2})
    batcher = StepBatcher(rec.batch, rec.one, shared_machine=lambda: True, forms_waves=lambda: True)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_looping, batcher, "a", start, steps, 5.0, [])
        nursery.start_soon(_looping, batcher, "b", start + 0.001, steps, 5.0, [], late)
    return rec, batcher


async def test_where_waves_form_a_late_wave_mate_is_waited_for_until_taken_to_be_gone(autojump_clock):
    """b, in a wave with a, comes 2 s late once (its period is about 6.2 s): the hop waits for it rather
    than computing a alone and b after it, and the wave stays whole (it came apart for four steps when
    a late session was waited for only a tenth of a step past its due time). At 6 s late, past half a
    period, b is taken to be gone: a computes alone, and b, once back, waits for a and the wave forms
    again."""
    rec, _ = await _pair_with_b_late({6: 2.0})
    sizes = [len(call) for call in rec.calls]
    assert sizes[:3] == [1, 1, 1] and sizes[3:-1] == [2] * 10  # b is a step behind a: its last alone
    rec, _ = await _pair_with_b_late({6: 6.0})
    sizes = [len(call) for call in rec.calls]
    assert sizes[3:].count(1) == 3 and sizes[-5:-1] == [2] * 4


async def _wave_arriving(late: dict[int, float], steps: int = 12) -> tuple[_CostedRecorder, StepBatcher]:
    """A later hop on a shared machine (a row costs 1 s, two 1.2 s) getting a wave of a and b from the
    hop before, b 1 ms after a, or ``late[p]`` seconds after it at position ``p``; both back 5 s after
    their results."""
    rec = _CostedRecorder({1: 1.0, 2: 1.2})
    batcher = StepBatcher(rec.batch, rec.one, shared_machine=lambda: True, forms_waves=lambda: False)
    for position in range(1, steps + 1):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.submit, _bundle("a", Phase.DECODE, position))
            await trio.sleep(late.get(position, 0.001))
            nursery.start_soon(batcher.submit, _bundle("b", Phase.DECODE, position))
        await trio.sleep(5.0)
    return rec, batcher


async def test_past_the_first_hop_a_wave_mate_is_waited_for_past_the_lull_up_to_the_cap(autojump_clock):
    """A later hop ends a hold 0.1 s after the last step arrived (the lull), but not while a session that
    ran here with one now queued is missing: b, 0.5 s behind a once, is computed with it (it was not
    when the lull ended every hold). One 3 s behind is waited for up to the cap (two one-row steps,
    2 s), and the wave, back together, computes whole again."""
    rec, _ = await _wave_arriving({6: 0.5})  # from the third step on, both have periods to be expected by
    assert [sorted(call) for call in rec.calls[4:]] == [["a", "b"]] * 10
    rec, batcher = await _wave_arriving({6: 3.0})
    calls = [sorted(call) for call in rec.calls[4:]]
    assert calls == [["a", "b"]] * 3 + [["a"], ["b"]] + [["a", "b"]] * 6
    assert 2.0 <= batcher.stats.held_s <= 2.0 + 0.1 * batcher.stats.held_batches + 1e-6


async def test_a_hold_ends_when_the_session_waited_for_ends(autojump_clock):
    """a is held for b, a wave mate due back with it; b's session ends here (the hop releases it) 0.5 s
    into the hold: a's step computes then, not when b would have been taken to be gone (3.1 s late)."""
    rec = _CostedRecorder({1: 1.0, 2: 1.2})
    batcher = StepBatcher(rec.batch, rec.one, shared_machine=lambda: True, forms_waves=lambda: True)
    results: list = []
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        nursery.start_soon(_submit_at, batcher, "a", [start, start + 6.2, start + 12.4], results)
        nursery.start_soon(_submit_at, batcher, "b", [start, start + 6.2], results)
        await trio.sleep(12.4 + 0.5)
        batcher.forget("b", 0)
    assert [sorted(call) for call in rec.calls[:2]] == [["a", "b"]] * 2
    assert rec.calls[2:] == [["a"]] and results[-1][3] == 500


async def test_a_refused_step_teaches_the_cost_tables_nothing(autojump_clock):
    """A bundle the shard refused computed nothing, though the call that refused it took time: a huge
    one would otherwise record an absurd rate, which the card then claims and routing believes."""
    rec = _Recorder(delay=0.001)
    batcher = StepBatcher(rec.batch, rec.one, run_prefill=rec.prefill)

    async def refused(bundle: HiddenStateBundle) -> None:
        with pytest.raises(ValueError, match="bad"):
            await batcher.submit(bundle)

    await refused(_bundle("bad-p", Phase.PREFILL, 0, 4_000_000_000))
    async with trio.open_nursery() as nursery:  # two at once: one batch, each refused
        nursery.start_soon(refused, _bundle("bad-1", Phase.DECODE, 5, 1))
        nursery.start_soon(refused, _bundle("bad-2", Phase.DECODE, 5, 1))
    assert ["bad-1", "bad-2"] in [sorted(c) for c in rec.calls]
    assert batcher.costs.prefill_tok_s() is None and batcher.costs.decode_s(2) is None
    await batcher.submit(_bundle("good", Phase.PREFILL, 0, 64))
    assert batcher.costs.prefill_tok_s() == pytest.approx(64 / 0.001)
