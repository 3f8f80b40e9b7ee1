"""Several sessions on one set of shards: no cross-talk, release, eviction, budgets."""

from __future__ import annotations

import pytest
import torch

from meshd.errors import CacheMiss, KVBudgetExceeded
from meshd.runtime.chain import LocalChain, input_bundles
from meshd.runtime.kv import room_for
from meshd.runtime.shard import Shard
from meshd.wire.bundle import Sampling
from tests.helpers import PROMPT

RANGES = [(0, 2), (2, 3), (3, 4)]
PROMPTS = [PROMPT, PROMPT[:9], [0, 3, 50, 60, 70], PROMPT[5:]]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Stepper:
    """Drive one session a token at a time through a chain, so several can interleave."""

    def __init__(self, chain: LocalChain, session_id: str, prompt: list[int], sampling: Sampling | None = None):
        self.chain, self.session_id = chain, session_id
        self.pending, self.position, self.tokens = list(prompt), 0, []
        self.sampling = sampling or Sampling()
        self.head = (chain.shards[0].spec.start, chain.shards[0].spec.end)

    def step(self) -> int:
        result = None
        for b in input_bundles(self.session_id, 0, self.pending, self.position, 4, self.head, self.sampling,
                               step=len(self.tokens)):
            result = self.chain.step(b)
        self.position += len(self.pending)
        self.tokens.append(result.token)
        self.pending = [result.token]
        return result.token


def solo(model_dir, prompt, n=12):
    return LocalChain([Shard(model_dir, s, e) for s, e in RANGES]).generate(prompt, n, chunk_tokens=4).tokens


def test_four_interleaved_sessions_equal_their_solo_runs(tiny_model):
    chain = LocalChain([Shard(tiny_model, s, e) for s, e in RANGES])
    steppers = [Stepper(chain, f"s{i}", p) for i, p in enumerate(PROMPTS)]
    for _ in range(12):
        for st in steppers:
            st.step()
    for st, prompt in zip(steppers, PROMPTS, strict=True):
        assert st.tokens == solo(tiny_model, prompt)
    assert all(len(s.kv) == 4 for s in chain.shards)


def test_release_one_session_leaves_the_others_intact(tiny_model):
    chain = LocalChain([Shard(tiny_model, s, e) for s, e in RANGES])
    steppers = [Stepper(chain, f"s{i}", p) for i, p in enumerate(PROMPTS)]
    for _ in range(6):
        for st in steppers:
            st.step()
    for shard in chain.shards:
        assert shard.release("s1", 0)
        assert not shard.release("s1", 0)
    with pytest.raises(CacheMiss, match="released"):
        steppers[1].step()
    for _ in range(6):
        for i in (0, 2, 3):
            steppers[i].step()
    for i in (0, 2, 3):
        assert steppers[i].tokens == solo(tiny_model, PROMPTS[i])


def test_ttl_eviction_gives_a_cache_miss_not_wrong_output(tiny_model):
    clock = FakeClock()
    chain = LocalChain([Shard(tiny_model, s, e, session_ttl_s=30, clock=clock) for s, e in RANGES])
    a, b = Stepper(chain, "a", PROMPTS[0]), Stepper(chain, "b", PROMPTS[1])
    a.step()
    b.step()
    clock.now = 20
    b.step()
    clock.now = 45  # a idle for 45 s, b for 25 s
    with pytest.raises(CacheMiss, match="idle longer than 30s") as info:
        a.step()
    assert info.value.code == "cache_miss"
    for _ in range(10):
        b.step()
    assert b.tokens == solo(tiny_model, PROMPTS[1])


def test_byte_budget_evicts_least_recently_used(tiny_model):
    probe = Shard(tiny_model, 0, 4)
    per_token = 2 * 4 * 2 * 16 * 4  # k+v, 4 layers, 2 kv heads, head dim 16, fp32
    held = room_for(8)  # positions a session holds from its second chunk of 4 until that room is full
    budget = per_token * (2 * held + 2)
    shard = Shard(tiny_model, 0, 4, kv_budget_bytes=budget)
    chain = LocalChain([shard])
    a, b = Stepper(chain, "a", PROMPT[:20]), Stepper(chain, "b", PROMPT[:15])
    a.step()
    b.step()  # 20 + 15 tokens in two caches with room to spare: under budget
    assert shard.kv.used_bytes == 2 * held * per_token <= budget
    b.step()
    b.step()
    c = Stepper(chain, "c", PROMPT[:10])
    c.step()  # its first chunk is over budget: a (least recently used) goes
    assert shard.kv.used_bytes <= budget
    with pytest.raises(CacheMiss, match="least recently used"):
        a.step()
    b.step()
    assert b.tokens == LocalChain([probe]).generate(PROMPT[:15], 4, chunk_tokens=4).tokens


def test_session_larger_than_the_whole_budget_is_refused(tiny_model):
    shard = Shard(tiny_model, 0, 4, kv_budget_bytes=1024)
    with pytest.raises(KVBudgetExceeded):
        Stepper(LocalChain([shard]), "big", PROMPT).step()
    assert len(shard.kv) == 0


def test_a_hops_output_cache_keeps_a_batched_row_not_the_whole_batch():
    from meshd.session.hop_state import OutputCache

    batch = torch.randn(16, 1, 64)  # a batched step's output: each session's row is a view of it
    cache = OutputCache()
    cache.append(0, batch[3])
    assert cache.nbytes == 64 * 4
    assert cache.parts[0].untyped_storage().nbytes() == 64 * 4
    assert torch.equal(cache.slice(0, 1), batch[3])
    whole = torch.randn(8, 64)  # a prefill chunk owns its storage: kept as it is, no copy
    cache.append(1, whole)
    assert cache.parts[1] is whole
