"""Seams, repair, admission, cancellation and resume in one process, on a fake clock.

Real hop services over real shards of the tiny model, an entry, and an in-memory network that can
kill a peer the way a dead process goes; every generation is compared token for token with the same
generation run undisturbed in one process.
"""

from __future__ import annotations

import json

import pytest
import trio

from meshd.errors import ErrorCode
from meshd.runtime.chain import LocalChain
from meshd.runtime.shard import Shard
from meshd.session import messages as m
from meshd.session.hop_state import RESUME_GRACE_S, AdmissionLimits, Compute
from meshd.session.repair import AllRefused, RepairFailed
from meshd.tracker.routing import NoRouteError
from meshd.wire import session_pb2 as spb
from meshd.wire.bundle import Sampling
from tests.helpers import PROMPT
from tests.inprocess import entry_config, in_process_mesh

N = 40
SEEDED = Sampling(temperature=0.8, top_p=0.95, seed=4242)


@pytest.fixture(scope="module")
def reference(tiny_model):
    chain = LocalChain([Shard(tiny_model, 0, 4)])
    return {"greedy": chain.generate(PROMPT, N).tokens, "seeded": chain.generate(PROMPT, N, SEEDED).tokens}


async def three_hops(mesh, replicas: tuple[int, ...] = ()):
    hops = [await mesh.add_hop(f"hop{i}", r) for i, r in enumerate([(0, 1), (1, 3), (3, 4)])]
    spares = [await mesh.add_hop(f"spare{i}", hops[i].layers) for i in replicas]
    return hops, spares


async def until(predicate, timeout: float = RESUME_GRACE_S + 2) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


@pytest.mark.parametrize("lost", [0, 1, 2], ids=["head", "middle", "tail"])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
async def test_a_hop_that_dies_mid_generation_is_repaired_with_identical_output(
        tiny_model, reference, autojump_clock, lost, kind):
    async with in_process_mesh(tiny_model) as mesh:
        hops, spares = await three_hops(mesh, replicas=(lost,))

        async def disturb(count: int) -> None:
            if count == 10:
                mesh.kill(hops[lost])

        tokens = await mesh.generate(PROMPT, N, SEEDED if kind == "seeded" else None, on_token=disturb)
        assert tokens == reference[kind]
        assert mesh.routes.unreachable == [hops[lost].peer_id]
        assert spares[0].service.stats.sessions_served == 1
        assert mesh.entry.repair_ms[["head", "middle", "tail"][lost]]
        await until(lambda: mesh.kv_everywhere() == 0)


async def test_hops_upstream_of_a_lost_one_resume_their_kv_instead_of_recomputing(
        tiny_model, reference, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        hops, _spares = await three_hops(mesh, replicas=(2,))
        prefills: list[int] = []

        async def disturb(count: int) -> None:
            if count == 20:
                prefills.append(hops[0].host.batcher.stats.prefill_chunks)
                mesh.kill(hops[2])

        assert await mesh.generate(PROMPT, N, on_token=disturb) == reference["greedy"]
        assert hops[0].service.stats.resumed_sessions == 1
        assert hops[1].service.stats.resumed_sessions == 1
        # the head computed one more prefill chunk: the last token again, not the prompt and the 20 after it
        assert hops[0].host.batcher.stats.prefill_chunks == prefills[0] + 1


async def test_a_hop_that_stops_answering_times_out_and_is_routed_around(tiny_model, reference, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        hops, spares = await three_hops(mesh, replicas=(1,))
        started = trio.current_time()

        async def disturb(count: int) -> None:
            if count == 5:
                hops[1].hung = True
                mesh.routes.dead.add(hops[1].peer_id)  # by then gossip would have stopped hearing from it

        assert await mesh.generate(PROMPT, N, on_token=disturb) == reference["greedy"]
        assert spares[0].service.stats.sessions_served == 1
        assert trio.current_time() - started < mesh.entry.config.step_timeout_s + 1


async def test_a_stalled_route_times_out_and_the_next_route_replaces_its_peers(tiny_model, reference,
                                                                              autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        hops, spares = await three_hops(mesh, replicas=(2,))
        hung_at: list[float] = []

        async def disturb(count: int) -> None:
            if count == 5:
                hops[2].hung = True  # nobody knows which hop stalls: gossip still hears from it
                hung_at.append(trio.current_time())

        assert await mesh.generate(PROMPT, N, on_token=disturb) == reference["greedy"]
        timeout = mesh.entry.config.step_timeout_s
        # one stall, then a route that avoids the stalled route's peers where it can: the spare tail
        assert spares[0].service.stats.sessions_served == 1
        assert timeout <= trio.current_time() - hung_at[0] < 2 * timeout
        assert mesh.routes.unreachable == []


async def test_a_cache_miss_repairs_without_blaming_the_hop(tiny_model, reference, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        hops, _ = await three_hops(mesh)

        async def disturb(count: int) -> None:
            if count == 8:
                shard = hops[1].host.require_shard()
                for key in list(shard.kv.keys()):
                    shard.kv.release(key)

        assert await mesh.generate(PROMPT, N, on_token=disturb) == reference["greedy"]
        assert mesh.routes.unreachable == []
        assert hops[1].service.stats.sessions_served == 2  # the same hop, a second epoch


async def test_a_hop_declared_dead_by_gossip_ends_the_attempt(tiny_model, reference, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        hops, spares = await three_hops(mesh, replicas=(0,))

        async def disturb(count: int) -> None:
            if count == 12:
                mesh.routes.dead.add(hops[0].peer_id)

        assert await mesh.generate(PROMPT, N, on_token=disturb) == reference["greedy"]
        assert hops[0].peer_id in mesh.routes.unreachable
        assert spares[0].service.stats.sessions_served == 1
        await until(lambda: hops[0].kv_sessions == 0)  # the abandoned hop released the session


async def test_a_refusing_hop_is_routed_around(tiny_model, reference, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        full = await mesh.add_hop("full", (0, 4), limits=AdmissionLimits(max_sessions=0))
        await mesh.add_hop("half0", (0, 2))
        await mesh.add_hop("half1", (2, 4))
        # the one-hop route is the cheapest, and refuses; the two-hop route answers
        assert await mesh.generate(PROMPT, N) == reference["greedy"]
        assert full.service.stats.seam_errors == 1
        assert mesh.routes.unreachable == []  # a refusal is not unreachability
        # counted where an operator looks: the hop's refusals by code, the entry's repairs by cause
        assert full.service.metrics.value("meshd_session_refusals_total", code="overloaded") == 1
        assert mesh.entry.metrics.value("meshd_repairs_total", cause="overloaded") == 1
        assert [e["kind"] for e in full.service.metrics.events] == ["refusal"]
        assert [e["kind"] for e in mesh.entry.metrics.events] == ["route failed"]


async def test_a_peer_claiming_a_range_it_does_not_serve_is_caught_on_first_use_and_demoted(
        tiny_model, reference, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        liar = await mesh.add_hop("liar", (0, 2), claims=(0, 4))  # the cheapest route, if its card were true
        await mesh.add_hop("half0", (0, 2))
        await mesh.add_hop("half1", (2, 4))
        assert await mesh.generate(PROMPT, N) == reference["greedy"]
        assert list(mesh.routes.demoted) == ["liar"] and "holding [0, 2)" in mesh.routes.demoted["liar"]
        assert mesh.entry.metrics.value("meshd_repairs_total", cause="range_mismatch") == 1
        assert await mesh.generate(PROMPT, N, session_id="s2") == reference["greedy"]
        assert mesh.entry.metrics.value("meshd_repairs_total", cause="range_mismatch") == 1  # not tried again
        assert liar.service.stats.sessions_served == 0


async def test_refusal_everywhere_is_overloaded_not_a_hang(tiny_model, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        await mesh.add_hop("small", (0, 4), kv_budget=2048)
        with pytest.raises(AllRefused, match="kv_budget"):
            await mesh.generate(PROMPT, N)
        assert mesh.kv_everywhere() == 0


async def test_coverage_gone_then_back_waits_for_the_range_and_finishes_identical(
        tiny_model, reference, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        hops, _ = await three_hops(mesh)
        gone_at: list[float] = []

        async def bring_back() -> None:
            await trio.sleep(12.0)  # longer than the old bound of five quick re-plans
            await mesh.add_hop("back", (1, 3))

        async def disturb(count: int) -> None:
            if count == 15:
                mesh.kill(hops[1])
                gone_at.append(trio.current_time())
                mesh.nursery.start_soon(bring_back)

        assert await mesh.generate(PROMPT, N, on_token=disturb) == reference["greedy"]
        assert mesh.hops["back"].service.stats.sessions_served == 1
        assert trio.current_time() - gone_at[0] >= 12.0


async def test_coverage_that_never_comes_back_fails_after_the_repair_budget(tiny_model, autojump_clock):
    async with in_process_mesh(tiny_model, entry_config(budget_s=20.0)) as mesh:
        hops, _ = await three_hops(mesh)
        gone_at: list[float] = []

        async def disturb(count: int) -> None:
            if count == 3:
                mesh.kill(hops[2])
                gone_at.append(trio.current_time())

        with pytest.raises(RepairFailed, match=r"layers not covered: \[3, 4\)"):
            await mesh.generate(PROMPT, N, on_token=disturb)
        assert 20.0 <= trio.current_time() - gone_at[0] <= 20.0 + 2.5
        await until(lambda: mesh.kv_everywhere() == 0, timeout=10)


async def test_a_request_with_no_route_is_answered_at_once(tiny_model, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        await mesh.add_hop("head", (0, 2))
        with pytest.raises(NoRouteError, match=r"\[2, 4\)"):
            await mesh.generate(PROMPT, N)


async def test_cancelling_a_generation_releases_its_session_on_every_hop(tiny_model, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        hops, _ = await three_hops(mesh)

        async def stop(count: int) -> None:
            if count == 6:
                assert all(h.kv_sessions == 1 for h in hops)
                raise _Enough

        with pytest.raises(_Enough):
            await mesh.generate(PROMPT, N, on_token=stop)
        closed = trio.current_time()
        await until(lambda: mesh.kv_everywhere() == 0)
        assert trio.current_time() - closed < 2.0
        assert all(h.service.active_sessions == 0 for h in hops)


async def test_sessions_that_share_hops_stay_apart_when_one_of_them_fails(tiny_model, reference, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        hops, _ = await three_hops(mesh)
        results: dict[str, list[int]] = {}

        async def run(name: str, sampling: Sampling | None) -> None:
            results[name] = await mesh.generate(PROMPT, N, sampling, session_id=name)

        async def breaks_one(count: int) -> None:
            if count == 10:
                shard = hops[2].host.require_shard()
                shard.kv.release(("broken", 0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "greedy", None)
            nursery.start_soon(run, "seeded", SEEDED)
            results["broken"] = await mesh.generate(PROMPT, N, on_token=breaks_one, session_id="broken")
        assert results == {"greedy": reference["greedy"], "seeded": reference["seeded"],
                           "broken": reference["greedy"]}


class _Enough(Exception):
    pass


async def test_a_repair_stays_with_peers_that_compute_as_the_route_did(tiny_model, reference, autojump_clock):
    """A complete, cheaper route of another numerics class is there all along; the repair waits for a
    replacement of the session's own class instead of re-prefilling onto peers that compute otherwise."""
    async with in_process_mesh(tiny_model) as mesh:
        hops, _ = await three_hops(mesh)

        async def other_class_and_later_own() -> None:
            await mesh.add_hop("other", (0, 4), compat_key="another-numerics-class")
            await trio.sleep(3.0)
            await mesh.add_hop("back", (1, 3))

        async def disturb(count: int) -> None:
            if count == 10:
                mesh.kill(hops[1])
                mesh.nursery.start_soon(other_class_and_later_own)

        assert await mesh.generate(PROMPT, N, on_token=disturb) == reference["greedy"]
        assert mesh.hops["other"].service.stats.sessions_served == 0
        assert mesh.hops["back"].service.stats.sessions_served == 1


@pytest.mark.parametrize("bad", [10**6, -1])
async def test_a_tail_sending_a_token_the_model_has_not_is_blamed_and_routed_around(
        tiny_model, reference, autojump_clock, bad):
    """Taken, the token would reach the client and every later prefill of the session, and the head
    would be blamed for refusing it on each route in turn."""
    async with in_process_mesh(tiny_model) as mesh:
        hops, spares = await three_hops(mesh, replicas=(2,))
        shard = hops[2].host.shard
        honest, lied = shard._sampled, []

        def lying(logits, sampling, position):
            result = honest(logits, sampling, position)
            if not lied and position == len(PROMPT) + 3:
                lied.append(position)
                result.token = bad
            return result

        shard._sampled = lying
        vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
        assert await mesh.generate(PROMPT, N, vocab_size=vocab) == reference["greedy"]
        assert lied and mesh.routes.unreachable == [hops[2].peer_id]
        assert spares[0].service.stats.sessions_served == 1


async def test_an_error_blaming_a_peer_off_the_route_is_blamed_on_its_reporter(tiny_model, reference,
                                                                              autojump_clock):
    """Errors are relayed up the route unsigned: which hop of the chain forged one cannot be told, but
    a peer off the route cannot be made to take the blame (here the head, which relayed it, does)."""
    async with in_process_mesh(tiny_model) as mesh:
        hops, _spares = await three_hops(mesh, replicas=(0,))
        bystander = await mesh.add_hop("bystander", (1, 3), compat_key="other-class")  # never on the route
        tail, failed = hops[2], []
        honest = tail.service._perform

        async def failing(session, actions, downstream):
            if not failed and any(isinstance(a, Compute) and a.bundle.start_position > len(PROMPT) + 2
                                  for a in actions):
                failed.append(True)
                raise RuntimeError("boom")
            return await honest(session, actions, downstream)

        tail.service._perform = failing
        tail.service._failed = lambda key, exc: m.error_msg(ErrorCode.RANGE_MISMATCH, "forged", bystander.peer_id)
        assert await mesh.generate(PROMPT, N) == reference["greedy"]
        assert failed and bystander.peer_id not in mesh.routes.demoted
        assert bystander.peer_id not in mesh.routes.unreachable
        assert list(mesh.routes.demoted) == [hops[0].peer_id]


async def test_only_the_entry_may_open_a_sessions_results_stream_and_only_once(tiny_model, reference,
                                                                              autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        hops, _ = await three_hops(mesh)
        answers: dict[str, list[str]] = {}

        async def take_results(who: str, claimed_entry: str) -> None:
            (session_id, epoch), = hops[2].service.live.keys()
            addresses = [spb.HopAddress(peer_id=h.peer_id, address=h.address, range_start=h.layers[0],
                                        range_end=h.layers[1]) for h in hops]
            opened = spb.SessionOpen(session_id=session_id, epoch=epoch, model_id=mesh.info.model_id,
                                     compat_key=mesh.info.compat_key, hops=addresses, hop_index=2,
                                     entry_peer_id=claimed_entry)
            peer = mesh.network.join(who, f"{who}.test:1", lambda s: s.reset(), mesh.nursery)
            stream = await peer.open_stream(hops[2].peer_id, hops[2].address, m.RESULTS_PATH)
            await stream.send_message(m.open_msg(opened))
            got = answers.setdefault(who, [])
            while (raw := await stream.receive_message()) is not None:
                got.append(m.parse(raw).WhichOneof("kind"))

        async def disturb(count: int) -> None:
            if count == 3:  # a peer that learnt the session's id, posing as itself and as the entry
                mesh.nursery.start_soon(take_results, "mallory", "mallory")
                mesh.nursery.start_soon(take_results, "mallet", "entry")

        assert await mesh.generate(PROMPT, N, on_token=disturb) == reference["greedy"]
        assert answers == {"mallory": ["error"], "mallet": ["error"]}
