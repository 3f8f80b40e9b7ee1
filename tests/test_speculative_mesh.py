"""Speculative decoding through a route: the reply is plain decoding's, token for token, in fewer traversals.

Real hop services over real shards of the tiny model and an entry on an in-memory network (one
process, fake clock). Drafts come from every source — n-gram lookup, a draft model (the tiny model
itself, so that it guesses right), and a scripted drafter that guesses right and wrong on purpose —
with greedy and seeded sampling, several sessions batched on shared hops, and a hop lost mid-reply.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio
from transformers import AutoTokenizer

from meshd.runtime.chain import LocalChain
from meshd.runtime.shard import Shard
from meshd.session.attempt import Speculation
from meshd.session.drafting import DraftLength, DraftModel, DraftStats, NgramDrafter
from meshd.session.entry import EntryConfig, EntrySessions
from meshd.wire.bundle import Sampling
from tests.helpers import PROMPT
from tests.inprocess import entry_config, in_process_mesh

N = 40
SEEDED = Sampling(temperature=0.8, top_p=0.95, seed=4242)
KINDS = {"greedy": Sampling(), "seeded": SEEDED}


@pytest.fixture(scope="module")
def reference(tiny_model):
    chain = LocalChain([Shard(tiny_model, 0, 4)])
    return {kind: chain.generate(PROMPT, N, sampling).tokens for kind, sampling in KINDS.items()}


class Scripted:
    """Guesses the true reply, wrong at every ``wrong``-th guess: steps accept some guesses and not others."""

    source = "scripted"
    inline = True

    def __init__(self, truth: list[int], wrong: int = 4) -> None:
        self.truth, self.wrong, self.asked = truth, wrong, 0

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        at = len(context) - len(PROMPT)
        out = list(self.truth[at : at + k])
        self.asked += 1
        if self.asked % self.wrong == 0 and out:
            out[len(out) // 2] = (out[len(out) // 2] + 7) % 300 + 3
        return out


def _speculation(drafter, max_draft: int = 6) -> Speculation:
    return Speculation(drafter, DraftLength(max_draft), DraftStats())


async def three_hops(mesh, replicas: tuple[int, ...] = ()):
    hops = [await mesh.add_hop(f"hop{i}", r) for i, r in enumerate([(0, 1), (1, 3), (3, 4)])]
    spares = [await mesh.add_hop(f"spare{i}", hops[i].layers) for i in replicas]
    return hops, spares


def _steps(hop) -> int:
    return hop.host.batcher.stats.decode_steps


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_scripted_guesses_give_the_plain_reply_in_fewer_traversals(tiny_model, reference, autojump_clock, kind):
    async with in_process_mesh(tiny_model) as mesh:
        hops, _ = await three_hops(mesh)
        spec = _speculation(Scripted(reference[kind]))
        assert await mesh.generate(PROMPT, N, KINDS[kind], speculation=spec) == reference[kind]
        assert spec.stats.accepted > 0 and spec.stats.accepted < spec.stats.drafted  # right and wrong guesses
        assert _steps(hops[2]) < N // 2  # each traversal brought several tokens


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_ngram_and_draft_model_guesses_give_the_plain_reply(tiny_model, reference, kind):
    """On Trio's real clock: the draft model runs in a worker thread, which a jumping clock would not wait for."""
    draft = DraftModel(tiny_model)  # the model itself: the same tokenizer, and guesses greedy decoding exactly
    assert draft.matches(AutoTokenizer.from_pretrained(tiny_model))
    async with in_process_mesh(tiny_model) as mesh:
        hops, _ = await three_hops(mesh)
        assert await mesh.generate(PROMPT, N, KINDS[kind], speculation=_speculation(NgramDrafter()),
                                   session_id="ngram") == reference[kind]
        by_model = _speculation(draft.session())
        before = _steps(hops[2])
        assert await mesh.generate(PROMPT, N, KINDS[kind], speculation=by_model,
                                   session_id="model") == reference[kind]
        if kind == "greedy":  # the draft is the model: every guess is right
            assert by_model.stats.accepted == by_model.stats.drafted > 0
            assert _steps(hops[2]) - before < N // 3


async def test_batched_sessions_with_guesses_each_give_their_plain_reply(tiny_model, reference, autojump_clock):
    async with in_process_mesh(tiny_model) as mesh:
        hops, _ = await three_hops(mesh)
        results: dict[str, list[int]] = {}

        async def one(name: str, kind: str, drafter) -> None:
            results[name] = await mesh.generate(PROMPT, N, KINDS[kind], session_id=name,
                                                speculation=_speculation(drafter) if drafter else None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "plain", "greedy", None)
            nursery.start_soon(one, "scripted", "greedy", Scripted(reference["greedy"], wrong=3))
            nursery.start_soon(one, "seeded", "seeded", Scripted(reference["seeded"], wrong=2))
            nursery.start_soon(one, "ngram", "seeded", NgramDrafter())
        assert results == {"plain": reference["greedy"], "scripted": reference["greedy"],
                           "seeded": reference["seeded"], "ngram": reference["seeded"]}
        assert hops[1].host.batcher.stats.largest_batch > 1


@pytest.mark.parametrize("lost", [0, 2], ids=["head", "tail"])
@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_a_hop_lost_mid_reply_is_repaired_and_the_reply_stays_the_same(tiny_model, reference, autojump_clock,
                                                                             lost, kind):
    async with in_process_mesh(tiny_model) as mesh:
        hops, spares = await three_hops(mesh, replicas=(lost,))

        async def disturb(count: int) -> None:
            if count == 11:
                mesh.kill(hops[lost])

        spec = _speculation(Scripted(reference[kind], wrong=3))
        tokens = await mesh.generate(PROMPT, N, KINDS[kind], on_token=disturb, speculation=spec)
        assert tokens == reference[kind]
        assert spares[0].service.stats.sessions_served == 1
        assert spec.stats.accepted > 0


async def test_upstream_hops_resume_only_accepted_positions_after_a_repair(tiny_model, reference, autojump_clock):
    """The tail is lost while the other hops hold KV of guesses it never accepted: they resume the
    accepted part only, and the reply is the same."""
    async with in_process_mesh(tiny_model) as mesh:
        hops, _ = await three_hops(mesh, replicas=(2,))

        async def disturb(count: int) -> None:
            if count == 17:
                mesh.kill(hops[2])

        spec = _speculation(Scripted(reference["greedy"], wrong=2))
        assert await mesh.generate(PROMPT, N, on_token=disturb, speculation=spec) == reference["greedy"]
        assert hops[0].service.stats.resumed_sessions == 1


async def test_the_entry_picks_the_draft_model_only_for_a_matching_tokenizer(tiny_model, bench_model):
    draft = DraftModel(tiny_model)
    async with trio.open_nursery() as nursery:
        entry = EntrySessions("e", None, None, EntryConfig(speculative="auto", draft_model=draft),  # type: ignore[arg-type]
                              nursery)
        assert entry.speculation("tiny", AutoTokenizer.from_pretrained(tiny_model)).drafter.source == "ngram+model"
        assert entry.speculation("bench", AutoTokenizer.from_pretrained(bench_model)).drafter.source == "ngram"
        off = EntrySessions("e", None, None, EntryConfig(speculative="off"), nursery)  # type: ignore[arg-type]
        assert off.speculation("tiny", AutoTokenizer.from_pretrained(tiny_model)) is None
        assert entry_config().speculative == "off"


async def test_a_route_of_the_entry_alone_guesses_nothing(tiny_model, reference, autojump_clock):
    """No link is crossed, so guesses would only cost compute; a route with another hop guesses."""
    async with in_process_mesh(tiny_model) as mesh:
        solo = await mesh.add_hop("solo", (0, 4))
        entry_id, entry_opener = mesh.entry.peer_id, mesh.entry.opener
        # the entry holds the whole model itself: it is that peer, and its streams come from it
        mesh.entry.peer_id, mesh.entry.opener = solo.peer_id, solo.service.opener
        spec = _speculation(Scripted(reference["greedy"]))
        assert await mesh.generate(PROMPT, N, speculation=spec) == reference["greedy"]
        assert spec.stats.drafted == 0 and _steps(solo) == N - 1
        mesh.entry.peer_id, mesh.entry.opener = entry_id, entry_opener
        assert await mesh.generate(PROMPT, N, speculation=spec, session_id="s2") == reference["greedy"]
        assert spec.stats.drafted > 0
