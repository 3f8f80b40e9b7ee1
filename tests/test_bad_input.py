"""Bad input gets a typed error; every other session on the shard carries on untouched."""

from __future__ import annotations

import pytest
import torch

from meshd.errors import BundleError, CacheMiss, PositionMismatch, RangeMismatch, ShapeMismatch
from meshd.runtime.chain import LocalChain
from meshd.runtime.shard import HIDDEN_STATES, Shard
from meshd.wire import bundle as wire
from meshd.wire.bundle import HiddenStateBundle, Phase
from tests.helpers import PROMPT
from tests.test_sessions import RANGES, Stepper, solo


def middle_bundle(shard: Shard, session_id: str, start: int, hidden: torch.Tensor, **overrides) -> HiddenStateBundle:
    fields = dict(
        session_id=session_id, epoch=0, phase=Phase.DECODE if start else Phase.PREFILL,
        start_position=start, token_count=hidden.shape[0], tensors={HIDDEN_STATES: hidden},
        range_start=shard.spec.start, range_end=shard.spec.end,
    )
    fields.update(overrides)
    return HiddenStateBundle(**fields)


@pytest.fixture
def busy_chain(tiny_model):
    """A chain with a session 'other' half-way through its generation."""
    chain = LocalChain([Shard(tiny_model, s, e) for s, e in RANGES])
    other = Stepper(chain, "other", PROMPT[:12])
    for _ in range(5):
        other.step()
    return chain, other


def finish_and_check(tiny_model, other: Stepper):
    for _ in range(7):
        other.step()
    assert other.tokens == solo(tiny_model, PROMPT[:12])


def test_wrong_start_position(tiny_model, busy_chain):
    chain, other = busy_chain
    middle = chain.shards[1]
    hidden = torch.zeros(1, 64)
    with pytest.raises(PositionMismatch, match="holds 16 tokens"):
        middle.forward(middle_bundle(middle, "other", 3, hidden))
    finish_and_check(tiny_model, other)


def test_unknown_session(tiny_model, busy_chain):
    chain, other = busy_chain
    middle = chain.shards[1]
    with pytest.raises(CacheMiss, match="unknown session"):
        middle.forward(middle_bundle(middle, "nobody", 4, torch.zeros(1, 64)))
    finish_and_check(tiny_model, other)


def test_wrong_hidden_size(tiny_model, busy_chain):
    chain, other = busy_chain
    middle = chain.shards[1]
    with pytest.raises(ShapeMismatch, match=r"expected \[1, 64\]"):
        middle.forward(middle_bundle(middle, "other", 16, torch.zeros(1, 48)))
    finish_and_check(tiny_model, other)


def test_wrong_dtype(tiny_model, busy_chain):
    chain, other = busy_chain
    middle = chain.shards[1]
    encoded = wire.encode(middle_bundle(middle, "other", 16, torch.zeros(1, 64, dtype=torch.float16)))
    with pytest.raises(ShapeMismatch, match=r"must be torch\.float32"):
        middle.forward(wire.decode(encoded))
    finish_and_check(tiny_model, other)


def test_truncated_bytes(tiny_model, busy_chain):
    chain, other = busy_chain
    middle = chain.shards[1]
    encoded = wire.encode(middle_bundle(middle, "other", 16, torch.randn(1, 64)))
    for cut in (1, 7, len(encoded) // 2, len(encoded) - 1):
        with pytest.raises(BundleError):
            middle.forward(wire.decode(encoded[:cut]))
    finish_and_check(tiny_model, other)


def test_range_that_does_not_match(tiny_model, busy_chain):
    chain, other = busy_chain
    middle = chain.shards[1]
    with pytest.raises(RangeMismatch, match=r"this shard holds \[2, 3\)"):
        middle.forward(middle_bundle(middle, "other", 16, torch.zeros(1, 64), range_start=2, range_end=4))
    finish_and_check(tiny_model, other)


def test_token_ids_out_of_vocabulary(tiny_model, busy_chain):
    chain, other = busy_chain
    head = chain.shards[0]
    bad = middle_bundle(head, "fresh", 0, torch.zeros(2, 64))
    bad.tensors = {"input_ids": torch.tensor([3, 9999])}
    with pytest.raises(ShapeMismatch, match="token ids"):
        head.forward(bad)
    assert ("fresh", 0) not in head.kv
    finish_and_check(tiny_model, other)


def test_failed_step_leaves_the_session_resumable(tiny_model, busy_chain):
    chain, other = busy_chain
    tail = chain.shards[-1]
    length = tail.kv.get(("other", 0)).length
    with pytest.raises(ShapeMismatch):
        tail.forward(middle_bundle(tail, "other", length, torch.zeros(1, 32)))
    assert tail.kv.get(("other", 0)).length == length
    finish_and_check(tiny_model, other)
