"""Peers that measured different numerics classes settle on the class of the longest-serving peer."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import trio

from meshd.daemon.numerics_adoption import ClassHolder, NumericsAdoption, holders_of, to_follow
from meshd.errors import ModelFormatError
from meshd.runtime.model_info import _linear_shapes, class_here
from meshd.runtime.numerics import BAND_PROBE_ROWS, Numerics, row_band
from meshd.wire import card_pb2 as cpb

MODEL = "bench"


def holder(peer: str, numerics: str, since_ms: int, key: str = "") -> ClassHolder:
    return ClassHolder(peer, MODEL, numerics, key or f"key-{numerics}", since_ms)


def card(h: ClassHolder, **fields) -> cpb.CapabilityCard:
    served = cpb.ModelServed(model_id=h.model_id, compat_key=h.compat_key, numerics=h.numerics, n_layers=16,
                             class_since_ms=h.since_ms, backend="torch")
    for name, value in fields.items():
        setattr(served, name, value)
    return cpb.CapabilityCard(peer_id=h.peer_id, models=[served])


def test_holders_are_ordered_by_how_long_they_computed_in_their_class():
    a, b, c = holder("a", "x", 300), holder("b", "y", 100), holder("c", "x", 100)
    cards = [card(a), card(b), card(c),
             card(holder("d", "z", 50), shard_error="failed its checks"),   # serves nothing
             card(holder("e", "z", 40), backend="llama.cpp"),               # its file's own numerics
             card(holder("f", "z", 0)),                                     # says no time: an older version
             card(replace(holder("g", "z", 10), model_id="other"))]
    assert holders_of(cards, MODEL) == [b, c, a]


def test_a_peer_follows_the_earliest_holder_and_no_one_behind_it():
    own = holder("me", "mine", 500)
    first, second = holder("a", "x", 100), holder("b", "y", 200)
    assert to_follow(own, [first, second, own]) == [first, second]
    assert to_follow(own, [first, second, own], refused=[("x", "key-x")]) == [second]
    # the earliest computes in this peer's own class: nobody behind it is worth leaving that class for
    assert to_follow(own, [holder("a", "mine", 100), second, own]) == []
    assert to_follow(holder("me", "mine", 50), [holder("me", "mine", 50), first, second]) == []
    # this peer's own card, not yet re-issued after it took another class, is no one to follow
    assert to_follow(holder("me", "x", 900), [holder("me", "old", 10), first]) == []
    # equal times: the lower peer id is the earlier
    assert to_follow(holder("b", "y", 100), [holder("a", "x", 100)]) == [holder("a", "x", 100)]
    assert to_follow(holder("a", "x", 100), [holder("a", "x", 100), holder("b", "y", 100)]) == []


class FakePeer:
    """A peer's class, its card and what adopting another class does to them."""

    def __init__(self, own: ClassHolder, cards: list[cpb.CapabilityCard], clock: list[int],
                 cannot: frozenset[str] = frozenset()) -> None:
        self.held, self.cards, self.clock, self.cannot = own, cards, clock, cannot
        self.busy = False
        self.checked: list[str] = []
        self.adoption = NumericsAdoption(lambda: self.held, lambda: self.cards, self.check, self.adopt,
                                         lambda: not self.busy)

    async def check(self, h: ClassHolder) -> str:
        await trio.lowlevel.checkpoint()
        self.checked.append(h.numerics)
        if h.numerics in self.cannot:
            raise ModelFormatError(f"{h.numerics} decodes in a band this machine lacks")
        return h.numerics

    async def adopt(self, numerics: str, h: ClassHolder) -> None:
        self.clock[0] += 1
        self.held = ClassHolder(self.held.peer_id, MODEL, numerics, h.compat_key, self.clock[0])
        self.cards[:] = [c for c in self.cards if c.peer_id != self.held.peer_id] + [card(self.held)]


async def test_a_busy_peer_waits_and_a_class_it_cannot_compute_is_passed_over():
    clock = [1000]
    cards = [card(holder("a", "x", 100)), card(holder("b", "y", 200))]
    me = FakePeer(holder("me", "z", 900), cards, clock, cannot=frozenset({"x"}))
    cards.append(card(me.held))
    me.busy = True
    await me.adoption.step()
    assert me.held.numerics == "z" and me.checked == []
    me.busy = False
    await me.adoption.step()
    assert me.held.numerics == "y" and me.checked == ["x", "y"]
    assert "band" in me.adoption.refused[("x", "key-x")]
    await me.adoption.step()  # settled: the refused class is not checked again, and "y" is its own now
    assert me.checked == ["x", "y"] and me.adoption.adopted == ["y"]


async def test_a_peer_that_turns_busy_while_checking_does_not_change():
    me = FakePeer(holder("me", "z", 900), [card(holder("a", "x", 100))], [1000])

    async def check(h: ClassHolder) -> str:
        me.busy = True  # a session arrived meanwhile
        return h.numerics

    me.adoption.check = check
    await me.adoption.step()
    assert me.held.numerics == "z" and me.adoption.adopted == []


@pytest.mark.parametrize("seed", range(20))
async def test_peers_starting_together_settle_on_one_class_whatever_order_they_look_in(seed):
    rng = random.Random(seed)
    clock = [10_000]
    cards: list[cpb.CapabilityCard] = []
    classes = ["x", "y", "z"]
    peers = [FakePeer(holder(f"p{i}", rng.choice(classes), rng.randrange(100, 200)), cards, clock)
             for i in range(rng.randrange(2, 8))]
    cards.extend(card(p.held) for p in peers)
    earliest = min(peers, key=lambda p: p.held.order).held.numerics
    for _ in range(3 * len(peers)):
        for p in rng.sample(peers, len(peers)):
            await p.adoption.step()
    assert {p.held.numerics for p in peers} == {earliest}
    assert all(len(p.adoption.adopted) <= 1 for p in peers), "each peer moved at most once"


async def test_the_watch_ends_with_its_window(autojump_clock):
    me = FakePeer(holder("me", "z", 900), [], [1000])
    me.adoption.window_s = 5.0
    with trio.fail_after(60):
        await me.adoption.run()
    me.cards.append(card(holder("a", "x", 100)))  # too late: the peer keeps its class
    assert trio.current_time() == pytest.approx(5.0) and me.held.numerics == "z"
    await me.adoption.first_look(lambda: True)  # a range loading long after the start (placed anew) too
    assert me.held.numerics == "z" and me.checked == []


async def test_a_first_look_waits_for_the_cards_of_other_peers(autojump_clock):
    me = FakePeer(holder("me", "z", 900), [], [1000])
    me.cards.append(card(me.held))

    async def cards_come() -> None:
        await trio.sleep(2.0)
        me.cards.append(card(holder("a", "x", 100)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cards_come)
        await me.adoption.first_look(lambda: len(me.cards) > 1)
    assert trio.current_time() == pytest.approx(2.0, abs=0.2) and me.held.numerics == "x"

    alone = FakePeer(holder("me", "z", 900), [], [1000])
    started = trio.current_time()
    await alone.adoption.first_look(lambda: False, timeout_s=5.0)
    assert trio.current_time() - started == pytest.approx(5.0) and alone.adoption.adopted == []


async def test_looks_taken_at_once_take_a_class_once():
    me = FakePeer(holder("me", "z", 900), [card(holder("a", "x", 100)), card(holder("b", "y", 200))], [1000])
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(me.adoption.step)
    assert me.adoption.adopted == ["x"] and me.checked == ["x"]


def test_a_class_is_taken_only_where_its_band_of_decode_rows_holds(bench_model):
    held = Numerics(torch.float32, "cpu")
    shapes, band_shapes = _linear_shapes(bench_model)
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(s, generator=gen) * 0.02 for s in dict.fromkeys(shapes + band_shapes)]
    low, high = row_band(held, weights)
    band = f"rows{low}" if high == low else f"rows{low}-{high}"
    here = f"cpu/float32/prefill-native/decode-native-{band}"
    assert class_here(bench_model, here, held).name == here
    assert class_here(bench_model, "cpu/float32/prefill-native/decode-native-rows1", held).decode_band == (1, 1)
    too_wide = f"cpu/float32/prefill-native/decode-native-rows{low if high > low else 2}-{2 * BAND_PROBE_ROWS}"
    with pytest.raises(ModelFormatError, match="compute each row alike"):
        class_here(bench_model, too_wide, held)
    with pytest.raises(ModelFormatError, match="other weights"):
        class_here(bench_model, "cpu/bfloat16/prefill-native/decode-native-rows1", held)
    with pytest.raises(ModelFormatError, match="computes on cuda"):
        class_here(bench_model, "cuda/float32/prefill-native/decode-native-rows1", held)
