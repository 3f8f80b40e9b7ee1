"""Decode steps with drafted tokens: every accepted token and its logits equal plain decoding's, bit for bit.

A step verifying drafts computes each position as a row of a decode step of its own; the tail stops
at the first sample that differs from the draft; the next step starts right after it and every shard
drops the KV of the positions the tail did not accept. Checked for every architecture adapter, for
greedy and seeded sampling, for split shards, and with steps of several sessions in one batch.
"""

from __future__ import annotations

import pytest
import torch

from meshd.errors import BundleError, PositionMismatch
from meshd.runtime.chain import input_bundles
from meshd.runtime.numerics import TILE_ROWS, Numerics
from meshd.runtime.shard import HIDDEN_STATES, Shard, StepResult
from meshd.wire import bundle as wire
from meshd.wire.bundle import HiddenStateBundle, Sampling
from meshd.wire.limits import MAX_DRAFT_TOKENS
from tests.archs import ARCHS
from tests.helpers import ONEDNN, needs_onednn

N_LAYERS = 4
PROMPTS = [[(5 * i + 7 * j) % 190 + 9 for j in range(n)] for i, n in enumerate((4, 13, 9))]
NEW_TOKENS = 14
SEEDED = Sampling(temperature=0.9, top_p=0.95, seed=1234)
# how many tokens each step drafts, and where a draft goes wrong (an index into it, or None)
PATTERN = [(3, None), (4, 1), (2, 0), (5, None), (1, None), (6, 3), (3, 2), (4, None)]


def _plain(model_dir, prompt: list[int], sampling: Sampling, numerics: Numerics | None = None,
           ) -> tuple[list[int], list[torch.Tensor]]:
    shard = Shard(model_dir, 0, N_LAYERS, keep_logits=True, numerics=numerics)
    result = shard.forward(next(input_bundles("plain", 0, prompt, 0, 64, (0, N_LAYERS), sampling)))
    tokens, logits = [result.token], [result.logits]
    for step in range(1, NEW_TOKENS):
        bundle = next(input_bundles("plain", 0, [tokens[-1]], len(prompt) + step - 1, 64, (0, N_LAYERS), sampling,
                                    step))
        result = shard.forward(bundle)
        tokens.append(result.token)
        logits.append(result.logits)
    return tokens, logits


def _draft(truth: list[int], at: int, k: int, wrong: int | None) -> list[int]:
    """``k`` tokens of the true continuation from ``at`` (fewer near its end), one of them wrong."""
    draft = list(truth[at : at + k])
    if wrong is not None and wrong < len(draft):
        draft[wrong] = (draft[wrong] + 1) % 300 + 5
    return draft


def _accepted(result: StepResult) -> list[tuple[int, torch.Tensor | None]]:
    return [(r.token, r.logits) for r in (result, *result.following)]  # type: ignore[misc]


class _Speculating:
    """One session decoding by drafted steps on a shard (or the head and tail of a split)."""

    def __init__(self, name: str, prompt: list[int], truth: list[int], sampling: Sampling) -> None:
        self.name, self.prompt, self.truth, self.sampling = name, prompt, truth, sampling
        self.tokens: list[int] = []
        self.logits: list[torch.Tensor] = []
        self.step = 0

    @property
    def done(self) -> bool:
        return len(self.tokens) >= NEW_TOKENS

    def first(self, rng: tuple[int, int]) -> HiddenStateBundle:
        return next(input_bundles(self.name, 0, self.prompt, 0, 64, rng, self.sampling))

    def next_step(self, rng: tuple[int, int]) -> HiddenStateBundle:
        k, wrong = PATTERN[self.step % len(PATTERN)]
        self.step += 1
        k = min(k, NEW_TOKENS - len(self.tokens) - 1)
        draft = _draft(self.truth, len(self.tokens), k, wrong)
        position = len(self.prompt) + len(self.tokens) - 1
        return next(input_bundles(self.name, 0, [self.tokens[-1]], position, 64, rng, self.sampling, self.step,
                                  draft))

    def took(self, result: StepResult) -> None:
        for token, logits in _accepted(result):
            if not self.done:
                self.tokens.append(token)
                assert logits is not None
                self.logits.append(logits)


def _check(mine: _Speculating, truth: tuple[list[int], list[torch.Tensor]]) -> None:
    tokens, logits = truth
    assert mine.tokens == tokens
    for step, (a, b) in enumerate(zip(mine.logits, logits, strict=True)):
        assert torch.equal(a, b), f"{mine.name} token {step}"


CASES = [(arch, "float32") for arch in sorted(ARCHS)]
CASES += [(arch, "float32-tiles") for arch in ("llama", "gemma2", "mistral-window")]
CASES += [("llama", "bfloat16")]
CASES += [pytest.param(arch, "float32-onednn", marks=needs_onednn) for arch in ("llama", "qwen3-moe", "mistral-window")]
NUMERICS = {
    "float32": Numerics(torch.float32),
    "float32-tiles": Numerics(torch.float32, decode_rows=TILE_ROWS),
    "bfloat16": Numerics(torch.bfloat16, prefill_fp32=True),
    "float32-onednn": ONEDNN,
}


@pytest.mark.parametrize(("arch", "numerics"), CASES)
@pytest.mark.parametrize("sampling", [Sampling(), SEEDED], ids=["greedy", "seeded"])
def test_drafted_steps_in_one_batch_give_plain_decoding(adapter_models, arch, numerics, sampling):
    """Sessions verify drafts of different lengths, partly wrong, in shared batches: each gets exactly
    the tokens and logits it gets decoding one token at a time alone."""
    model_dir = adapter_models[arch]
    plain = [_plain(model_dir, p, sampling, NUMERICS[numerics]) for p in PROMPTS]
    shard = Shard(model_dir, 0, N_LAYERS, keep_logits=True, numerics=NUMERICS[numerics])
    rng = (0, N_LAYERS)
    sessions = [_Speculating(f"s{i}", p, plain[i][0], sampling) for i, p in enumerate(PROMPTS)]
    for s in sessions:
        s.took(shard.forward(s.first(rng)))
    steps = 0
    while not all(s.done for s in sessions):
        running = [s for s in sessions if not s.done]
        results = shard.forward_batch([s.next_step(rng) for s in running])
        for s, result in zip(running, results, strict=True):
            assert isinstance(result, StepResult), result
            s.took(result)
        steps += 1
    assert steps < NEW_TOKENS - 1  # the drafts saved steps
    for s, truth in zip(sessions, plain, strict=True):
        _check(s, truth)


def test_split_shards_drop_the_positions_the_tail_rejected(tiny_model):
    """Head and tail each keep the KV of accepted positions only; the wire carries the draft along."""
    head, tail = Shard(tiny_model, 0, 2), Shard(tiny_model, 2, 4, keep_logits=True)
    truth = _plain(tiny_model, PROMPTS[1], SEEDED)
    s = _Speculating("split", PROMPTS[1], truth[0], SEEDED)

    def through(bundle: HiddenStateBundle) -> StepResult:
        bundle = wire.decode(wire.encode(bundle))
        hidden = head.forward(bundle).hidden_states
        passed = bundle.part(bundle.start_position, bundle.end_position, {HIDDEN_STATES: hidden})
        passed.range_start, passed.range_end = 2, 4
        return tail.forward(wire.decode(wire.encode(passed)))

    s.took(through(s.first((0, 2))))
    while not s.done:
        s.took(through(s.next_step((0, 2))))
        accepted = len(PROMPTS[1]) + len(s.tokens) - 1  # the newest token is not yet in the KV
        for shard in (head, tail):
            assert shard.kv.get(("split", 0)).length >= accepted
    _check(s, truth)


def test_a_step_may_not_start_before_the_accepted_tokens(tiny_model):
    shard = Shard(tiny_model, 0, N_LAYERS)
    prompt = PROMPTS[0]
    first = shard.forward(next(input_bundles("s", 0, prompt, 0, 64, (0, N_LAYERS), Sampling()))).token
    step = next(input_bundles("s", 0, [first], len(prompt), 64, (0, N_LAYERS), Sampling(), 1, [7, 8, 9]))
    shard.forward(step)
    assert shard.kv.get(("s", 0)).length == len(prompt) + 4
    # the first token of the step is accepted for certain: a step before it is refused, and nothing changes
    early = next(input_bundles("s", 0, [first], len(prompt), 64, (0, N_LAYERS), Sampling(), 2))
    with pytest.raises(PositionMismatch):
        shard.forward(early)
    assert shard.kv.get(("s", 0)).length == len(prompt) + 4
    later = next(input_bundles("s", 0, [5], len(prompt) + 2, 64, (0, N_LAYERS), Sampling(), 2))
    shard.forward(later)
    assert shard.kv.get(("s", 0)).length == len(prompt) + 3


def test_the_wire_refuses_inconsistent_drafts():
    good = next(input_bundles("s", 0, [3], 5, 64, (0, 4), Sampling(), 1, [4, 5]))
    assert wire.decode(wire.encode(good)).draft == (4, 5)
    for bad in (dict(token_count=2), dict(draft=tuple(range(MAX_DRAFT_TOKENS + 1))), dict(sample=False)):
        bundle = next(input_bundles("s", 0, [3], 5, 64, (0, 4), Sampling(), 1, [4, 5]))
        for name, value in bad.items():
            setattr(bundle, name, value)
        if "draft" in bad:
            bundle.token_count = 1 + len(bundle.draft)
            bundle.tensors = {"input_ids": torch.arange(bundle.token_count)}
        with pytest.raises(BundleError):
            wire.decode(wire.encode(bundle))
