"""Speed checks in one process: a fake peer whose decode steps take a known time on Trio's fake clock,
timed against what its card claims."""

from __future__ import annotations

import random

import pytest
import trio

from meshd.audit.speed import (
    MAX_STEPS,
    MIN_TIMED_S,
    RECHECK_S,
    STEPS,
    SpeedChecks,
    check_steps_allowed,
    short_of_claim,
)
from meshd.errors import ErrorCode
from meshd.gossip import GossipNode
from meshd.identity import Identity
from meshd.rpc.router import error_reply, reply_of
from meshd.runtime.host import InlineCompute, ShardHost
from meshd.runtime.model_info import describe_model
from meshd.runtime.served_model import CheckRefused, ServedModel
from meshd.tracker.view import Hop, MeshView, Route
from meshd.wire import card_pb2 as cpb
from meshd.wire import rpc_pb2 as pb

STEP_S = 0.01  # the fake peer's real decode step
RTT_S = 0.05


class FakePeer:
    """Answers speed checks after the round trip plus its steps; or refuses them."""

    def __init__(self, refuse: ErrorCode | None = None, step_s: float = STEP_S) -> None:
        self.refuse = refuse
        self.step_s = step_s
        self.asked: list[int] = []

    async def request(self, peer_id, address, path, body, timeout):
        check = pb.PeerRequest.FromString(body).speed_check
        self.asked.append(check.steps)
        await trio.sleep(RTT_S + 0.2 + check.steps * self.step_s)  # prefill and warm-up cost the same either way
        if self.refuse is not None:
            return error_reply(self.refuse, "no").SerializeToString()
        return reply_of(pb.SpeedChecked(steps=check.steps)).SerializeToString()


def _mesh(claimed: float) -> tuple[MeshView, GossipNode, str]:
    me = GossipNode.with_identity(Identity.from_seed(b"\1" * 32), cpb.CapabilityCard(addresses=["me:1"]),
                                  rng=random.Random(1))
    other = GossipNode.with_identity(Identity.from_seed(b"\2" * 32), rng=random.Random(2), template=cpb.CapabilityCard(
        addresses=["other:1"], models=[cpb.ModelServed(model_id="m", compat_key="k", n_layers=4, range_start=2,
                                                        range_end=4, decode_tok_s=claimed)]))
    other.tick(0.0)
    me.on_card(other.store.get(other.self_id).signed, 0.0)
    return MeshView(me, clock=trio.current_time), other, other.self_id


def _route(peer_id: str) -> Route:
    return Route("m", "k", (Hop(peer_id, 2, 4),), epoch=1, cost_ms=1.0)


def test_a_claim_falls_short_only_beyond_tolerance_and_load():
    assert not short_of_claim(100.0, 30.0) and short_of_claim(100.0, 20.0)
    assert not short_of_claim(100.0, 20.0, load=2.0)  # a busy peer is allowed to be slower, as routing assumes
    assert not short_of_claim(0.0, 1.0)  # no claim, nothing to fall short of


async def test_a_boast_too_small_to_tell_from_noise_is_not_demoted(autojump_clock):
    view, _other, peer_id = _mesh(claimed=1e6)
    fake = FakePeer(step_s=1e-5)
    record = await SpeedChecks(view, fake).check(peer_id, "m", "k")
    assert record is not None and not record.demoted
    assert fake.asked == [0, STEPS] * 3 + [0, MAX_STEPS] * 3  # 32 steps: 0.3 ms; the most asked: 10 ms


async def test_quick_steps_are_timed_in_a_number_that_takes_long_enough_to_tell(autojump_clock):
    view, _other, peer_id = _mesh(claimed=1e7)
    fake = FakePeer(step_s=2e-4)  # 32 steps: 6.4 ms, within noise of any claim
    record = await SpeedChecks(view, fake).check(peer_id, "m", "k")
    assert record is not None and record.demoted and abs(record.measured - 1 / 2e-4) < 1
    grown = fake.asked[7]
    assert 2 * MIN_TIMED_S <= grown * 2e-4 < 2 * MIN_TIMED_S * 1.01
    assert fake.asked == [0, STEPS] * 3 + [0, grown] * 6  # confirmed at the number it grew to


async def test_a_check_asks_no_more_steps_than_the_claimed_speed_allows(autojump_clock):
    view, _other, peer_id = _mesh(claimed=200.0)  # 0.5 s at the claim: 100 steps
    fake = FakePeer(step_s=1e-4)  # faster than it claims: 32 steps take 3.2 ms
    record = await SpeedChecks(view, fake).check(peer_id, "m", "k")
    assert record is not None and not record.demoted
    assert fake.asked == [0, STEPS] * 3 + [0, check_steps_allowed(200.0)] * 3 and check_steps_allowed(200.0) == 100


async def test_an_honest_claim_is_met_and_not_checked_again_until_it_grows(autojump_clock):
    view, other, peer_id = _mesh(claimed=1 / STEP_S)
    fake = FakePeer()
    checks = SpeedChecks(view, fake)
    record = await checks.check(peer_id, "m", "k")
    assert record is not None and not record.demoted
    assert abs(record.measured - 1 / STEP_S) < 1  # the round trip and the prefill cancel out
    assert fake.asked == [0, STEPS] * 3
    other.republish(1.0)  # a new card claiming the same: no new check
    view.gossip.on_card(other.store.get(other.self_id).signed, 1.0)
    checks.on_route(_route(peer_id))
    assert checks._waiting == {} and checks.avoided() == frozenset()


async def test_a_boast_is_demoted_and_stays_so_while_the_cards_boast(autojump_clock):
    view, other, peer_id = _mesh(claimed=1000 / STEP_S)
    fake = FakePeer()
    checks = SpeedChecks(view, fake)
    async with trio.open_nursery() as nursery:
        await nursery.start(checks.run)
        checks.on_route(_route(peer_id))
        await trio.sleep(10)
        record = checks.records[peer_id]
        assert record.demoted and "claims 100000.0" in record.why
        assert len(fake.asked) == 12  # short, and short again a moment later
        assert checks.avoided() == {peer_id} and view.demoted() == {}  # avoided, not excluded
        other.republish(5.0)
        view.gossip.on_card(other.store.get(other.self_id).signed, 5.0)
        assert checks.avoided() == {peer_id}  # the new card boasts as much
        await trio.sleep(RECHECK_S)
        assert checks.avoided() == {peer_id}  # still avoided while it is timed again
        await trio.sleep(10)
        assert len(fake.asked) == 24 and checks.records[peer_id].demoted
        other.issuer.template.models[0].decode_tok_s = 1 / STEP_S
        other.republish(9.0)
        view.gossip.on_card(other.store.get(other.self_id).signed, 9.0)
        assert checks.avoided() == frozenset()  # a new claim, timed at its next use
        nursery.cancel_scope.cancel()


async def test_a_peer_only_busy_for_a_moment_is_not_demoted(autojump_clock):
    view, _other, peer_id = _mesh(claimed=1 / STEP_S)
    busy = FakePeer(step_s=50 * STEP_S)
    checks = SpeedChecks(view, busy)

    async def recover() -> None:
        await trio.sleep(1.0)
        busy.step_s = STEP_S

    async with trio.open_nursery() as nursery:
        nursery.start_soon(recover)
        record = await checks.check(peer_id, "m", "k")
    assert record is not None and not record.demoted and checks.avoided() == frozenset()


async def test_refusing_to_be_timed_demotes_but_being_unreachable_does_not(autojump_clock):
    view, _other, peer_id = _mesh(claimed=50.0)
    refused = await SpeedChecks(view, FakePeer(refuse=ErrorCode.BAD_REQUEST)).check(peer_id, "m", "k")
    assert refused is not None and refused.demoted and "refused to be timed" in refused.why
    for code in (ErrorCode.UNREACHABLE, ErrorCode.KV_BUDGET):  # no room for the steps now is no verdict either
        view, _other, peer_id = _mesh(claimed=50.0)
        unreachable = SpeedChecks(view, FakePeer(refuse=code))
        assert await unreachable.check(peer_id, "m", "k") is None and unreachable.avoided() == frozenset()


async def test_steps_that_seem_to_take_no_time_are_timed_again(autojump_clock):
    view, _gossip, peer_id = _mesh(1e7)
    checks = SpeedChecks(view, FakePeer(step_s=0.01))
    calls: list[int] = []

    async def timed(_peer: str, _address: str, _model: str, _key: str, steps: int) -> float:
        calls.append(steps)
        if len(calls) <= 6:  # the first pairs: every call without steps delayed past those with them
            return 0.5 if steps == 0 else 0.3
        return 0.1 + steps * 0.01

    checks._time = timed  # type: ignore[method-assign]
    steps, took = await checks._measure(peer_id, "addr", "m", "k", MAX_STEPS)
    assert steps == STEPS and took == pytest.approx(0.3 - 0.1)
    assert len(calls) == 8  # one more pair, and a difference again


async def test_a_peer_runs_as_many_check_steps_as_its_own_speed_allows_and_refuses_more(tiny_model):
    info = describe_model(tiny_model, "tiny")
    host = ShardHost(tiny_model, numerics=info.numerics, manifest=info.manifest, compute=InlineCompute())
    await host.load(0, 2)
    served = ServedModel(info, host)
    served.decode_tok_s = 400.0  # 0.5 s of its steps: 200
    check = lambda steps: pb.SpeedCheck(model_id="tiny", compat_key=info.compat_key, steps=steps)  # noqa: E731
    assert check_steps_allowed(served.decode_tok_s) == 200
    assert (await served.serve_speed_check("asker", check(200))).steps == 200
    with pytest.raises(CheckRefused, match="at most 200 steps"):
        await served.serve_speed_check("asker", check(201))
    served.decode_tok_s = 1.0  # however slow it is, the first steps a check asks for are run
    assert (await served.serve_speed_check("asker", check(STEPS))).steps == STEPS
    served.decode_tok_s = 1e9
    with pytest.raises(CheckRefused, match=f"at most {MAX_STEPS} steps"):
        await served.serve_speed_check("asker", check(MAX_STEPS + 1))
    assert host.require_shard().kv.keys() == []
