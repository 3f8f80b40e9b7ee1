"""Prefix KV: a session started from a kept prefix computes exactly what a full prefill computes, the
store stays inside its budgets, names never cross entries, and bad prefix fields are refused."""

from __future__ import annotations

import pytest
import torch

from meshd.errors import BundleError, CacheMiss
from meshd.models.text import TextCodec
from meshd.runtime.chain import LocalChain, input_bundles, prefill_bundles
from meshd.runtime.kv import KVManager
from meshd.runtime.prefix_kv import PrefixSnapshot, PrefixStore, prefix_scope, scoped_name
from meshd.runtime.shard import Shard
from meshd.session.hop_state import HopBook, HopSession
from meshd.session.prefixes import MIN_PREFIX_TOKENS, PrefixMap, chunk_spans, entry_key, load_secret, plan_prefixes
from meshd.wire import bundle as wire
from meshd.wire import session_pb2 as pb
from meshd.wire.bundle import HiddenStateBundle, Phase, Sampling
from tests.archs import ARCHS

KEY = b"k" * 32
HEAD = (0, 2)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(chain: LocalChain, session: str, prompt: list[int], prefixes, start: int = 0,
              new_tokens: int = 6) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt`` from ``start`` (after its kept prefix there) at its cuts, then decode greedily."""
    head = (chain.shards[0].spec.start, chain.shards[0].spec.end)
    keep = {p: prefixes.names[p] for p in prefixes.keep}
    result = None
    for bundle in prefill_bundles(session, 0, prompt, prefixes.spans(start, len(prompt)), head, Sampling(),
                                  prefix=prefixes.names[start] if start else b"", keep=keep):
        result = chain.step(bundle)
    assert result is not None and result.token is not None and result.logits is not None
    tokens, logits = [result.token], [result.logits]
    for step in range(1, new_tokens):
        (bundle,) = input_bundles(session, 0, [tokens[-1]], len(prompt) + step - 1, 64, head, Sampling(), step=step)
        result = chain.step(bundle)
        assert result.token is not None and result.logits is not None
        tokens.append(result.token)
        logits.append(result.logits)
    return tokens, logits


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_session_started_from_a_kept_prefix_computes_bit_for_bit_what_a_whole_prefill_does(adapter_models, arch):
    model_dir = adapter_models[arch]
    chain = LocalChain([Shard(model_dir, 0, 2, keep_logits=True), Shard(model_dir, 2, 4, keep_logits=True)])
    first_turn = _prompt(150)
    second_turn = [*first_turn, *_prompt(40, seed=1)]
    boundaries = [20, 150]  # a system message, then the first turn's last message
    first = plan_prefixes([*first_turn, 5, 6], boundaries, 64, KEY, messages=True)
    assert first.keep == {150}
    _generate(chain, "turn-1", [*first_turn, 5, 6], first, new_tokens=1)
    assert all(len(s.kv.prefixes) == 1 for s in chain.shards)

    second = plan_prefixes(second_turn, [*boundaries, 175], 64, KEY, messages=True)
    assert second.names[150] == first.names[150]
    reused = _generate(chain, "turn-2", second_turn, second, start=150)
    fresh_chain = LocalChain([Shard(model_dir, 0, 2, keep_logits=True), Shard(model_dir, 2, 4, keep_logits=True)])
    whole = _generate(fresh_chain, "whole", second_turn, second)
    assert reused[0] == whole[0]
    for mine, theirs in zip(reused[1], whole[1], strict=True):
        assert torch.equal(mine, theirs), "reusing a prefix changed the logits"
    assert all(s.kv.prefixes.hits == 1 and s.kv.prefixes.reused_tokens == 150 for s in chain.shards)


def test_cuts_fall_at_message_ends_and_chunk_multiples_and_names_follow_tokens_cuts_and_key():
    tokens = _prompt(300)
    plan = plan_prefixes(tokens, [40, 130, 250, 300], 64, KEY, messages=True)
    assert plan.cuts == [40, 64, 128, 130, 192, 250, 256]
    assert plan.keep == {250}  # the first message end (40) is too short to keep
    assert plan.spans(0, 300) == [(0, 40), (40, 64), (64, 128), (128, 130), (130, 192), (192, 250), (250, 256),
                                  (256, 300)]
    assert plan.spans(250, 400) == [(250, 256), (256, 320), (320, 384), (384, 400)]  # past the prompt: the grid
    assert chunk_spans(0, 130, (), 64) == [(0, 64), (64, 128), (128, 130)]
    longer = plan_prefixes([*tokens, 9, 9], [40, 130, 250, 300], 64, KEY, messages=True)
    assert all(longer.names[c] == plan.names[c] for c in plan.cuts)
    changed = list(tokens)
    changed[100] += 1
    other = plan_prefixes(changed, [40, 130, 250, 300], 64, KEY, messages=True)
    assert other.names[64] == plan.names[64] and other.names[128] != plan.names[128]
    resplit = plan_prefixes(tokens, [41, 130, 250, 300], 64, KEY, messages=True)
    assert resplit.names[250] != plan.names[250], "the same tokens cut elsewhere are another prefix"
    assert plan_prefixes(tokens, [40, 130, 250], 64, b"x" * 32, messages=True).names[250] != plan.names[250]
    assert plan_prefixes(tokens, [], 64, KEY, messages=False).keep == {256}
    assert plan_prefixes(tokens[:MIN_PREFIX_TOKENS - 1], [], 16, KEY, messages=False).keep == set()
    assert entry_key(KEY, "a") != entry_key(KEY, "b")


def test_the_entry_secret_survives_a_restart_and_only_its_owner_reads_it(tmp_path):
    secret = load_secret(tmp_path)
    assert load_secret(tmp_path) == secret and len(secret) == 32
    assert (tmp_path / "prefix.key").stat().st_mode & 0o077 == 0


def test_the_prefix_map_knows_the_longest_prefix_first_and_forgets_the_oldest():
    plan = plan_prefixes(_prompt(300), [100, 200, 300], 64, KEY, messages=True)
    known = PrefixMap(max_entries=2)
    route = (("a", 0, 2), ("b", 2, 4))
    known.kept([plan.names[100], plan.names[200]], route)
    assert [k.position for k in known.known(plan)] == [200, 100]
    known.kept([plan.names[256]], route)
    assert [k.position for k in known.known(plan)] == [256, 200]


def test_the_store_keeps_its_byte_budget_and_evicts_the_least_recently_used():
    def snap(length: int) -> PrefixSnapshot:
        return PrefixSnapshot.of(length, {0: torch.zeros(1, 1, length, 4)}, {0: torch.zeros(1, 1, length, 4)})

    store = PrefixStore(max_bytes=3 * snap(10).nbytes)
    for name in (b"a", b"b", b"c"):
        assert store.keep(name, snap(10))
    assert store.get(b"a", 10) is not None  # now the most recent
    assert store.keep(b"d", snap(10))
    assert not store.holds(b"b") and store.holds(b"a") and store.holds(b"c", 10) and not store.holds(b"c", 9)
    assert store.get(b"a", 11) is None, "a prefix of another length is not the one asked for"
    assert not store.keep(b"huge", snap(40))
    assert store.used_bytes <= store.max_bytes and store.evicted == 1


def test_a_snapshot_of_a_view_does_not_keep_the_whole_buffer_alive():
    fused = torch.zeros(3, 1, 10, 4)
    snapshot = PrefixSnapshot.of(10, {0: fused[0]}, {0: fused[1]})
    assert snapshot.keys[0].untyped_storage().nbytes() == 10 * 4 * 4
    with pytest.raises(ValueError, match="not a prefix"):
        PrefixSnapshot.of(9, {0: fused[0]}, {0: fused[1]})


def _session(kv: KVManager, name: str, positions: int) -> tuple[str, int]:
    """A session holding ``positions`` positions of one layer: 80 bytes of keys and values each."""
    session = kv.open((name, 0), Sampling())
    session.update(torch.zeros(1, 1, positions, 10), torch.zeros(1, 1, positions, 10), 0)
    session.length = positions
    kv.commit((name, 0))
    return (name, 0)


def test_kept_prefixes_give_way_to_running_sessions_in_the_kv_budget():
    kv = KVManager(budget_bytes=1000, prefix_bytes=1000)
    small = _session(kv, "small", 5)  # 400 bytes
    assert kv.keep_prefix(b"s", small) and kv.prefixes.used_bytes == 400
    kv.release(small)
    assert kv.keep_prefix(b"gone", small) is False
    assert kv.prefixes.holds(b"s"), "a kept prefix outlives its session"
    big = _session(kv, "big", 11)  # 880 bytes: with the kept 400 it passes the budget, so the prefix goes
    assert not kv.prefixes.holds(b"s") and big in kv and kv.prefixes.evicted == 1
    assert kv.keep_prefix(b"b", big) is False, "no prefix is kept that would crowd out running sessions"
    assert kv.used_bytes + kv.prefixes.used_bytes <= 1000
    off = KVManager(prefix_bytes=0)
    assert off.keep_prefix(b"x", _session(off, "x", 5)) is False


def test_continuing_a_prefix_this_hop_does_not_keep_is_a_cache_miss_that_touches_nothing_else(tiny_model):
    shard = Shard(tiny_model, 0, 4)
    prompt = _prompt(100)
    plan = plan_prefixes(prompt, [80], 64, KEY, messages=True)
    (bundle_a, bundle_b) = prefill_bundles("a", 0, prompt, plan.spans(0, 80), (0, 4), Sampling(),
                                           keep={80: plan.names[80]})
    for b in (bundle_a, bundle_b):
        b.prefix_scope = prefix_scope("entry", "entry")
        shard.forward(b)
    assert shard.kv.prefixes.holds(scoped_name(b"" + prefix_scope("entry", "entry"), plan.names[80]), 80)
    other = prefill_bundles("b", 0, prompt, [(80, 100)], (0, 4), Sampling(), prefix=plan.names[80])[0]
    other.prefix_scope = prefix_scope("another entry", "another entry")
    with pytest.raises(CacheMiss, match="not kept here"):
        shard.forward(other)
    assert ("b", 0) not in shard.kv and ("a", 0) in shard.kv
    forged = prefill_bundles("c", 0, prompt, [(79, 100)], (0, 4), Sampling(), prefix=plan.names[80])[0]
    forged.prefix_scope = prefix_scope("entry", "entry")
    with pytest.raises(CacheMiss):  # the right name with another length
        shard.forward(forged)
    ok = prefill_bundles("d", 0, prompt, [(80, 100)], (0, 4), Sampling(), prefix=plan.names[80])[0]
    ok.prefix_scope = prefix_scope("entry", "entry")
    assert shard.forward(ok).token is not None and shard.kv.get(("d", 0)).length == 100


@pytest.mark.parametrize(("changes", "message"), [
    (dict(phase=Phase.DECODE, prefix=b"p"), "only prefill chunks"),
    (dict(keep_prefix=b"x" * 65), "at most 64 bytes"),
    (dict(start_position=0, prefix=b"p"), "starts after it"),
])
def test_bad_prefix_fields_are_refused_on_the_wire(changes, message):
    bundle = HiddenStateBundle(session_id="s", epoch=0, phase=Phase.PREFILL, start_position=5, token_count=1,
                               tensors={"input_ids": torch.tensor([1])}, range_start=0, range_end=4, sample=True)
    for name, value in changes.items():
        setattr(bundle, name, value)
    with pytest.raises(BundleError, match=message):
        wire.decode(wire.encode(bundle))


def test_a_hop_scopes_prefix_names_by_the_entry_and_its_upstream_peer():
    open_ = pb.SessionOpen(session_id="s", epoch=0, hops=[pb.HopAddress(peer_id="hop", range_start=0, range_end=4)],
                           hop_index=0, entry_peer_id="entry")
    session = HopSession(HopBook("hop"), open_, 0, upstream_peer_id="upstream")
    bundle = HiddenStateBundle(session_id="s", epoch=0, phase=Phase.PREFILL, start_position=5, token_count=1,
                               tensors={"input_ids": torch.tensor([1])}, range_start=0, range_end=4, prefix=b"p")
    (compute,) = session.on_bundle(bundle)
    assert compute.bundle.prefix_scope == prefix_scope("entry", "upstream") != prefix_scope("entry", "other")
    assert scoped_name(prefix_scope("a", "b"), b"p") != scoped_name(prefix_scope("a", "c"), b"p")


def test_message_ends_are_found_where_the_template_renders_them(tiny_model):
    codec = TextCodec.load(tiny_model)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there."},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And now?"}]
    tokens = codec.encode_chat(messages)
    ends = codec.chat_boundaries(messages, tokens)
    assert ends and ends == sorted(ends) and ends[-1] < len(tokens)
    for end in ends:
        assert any(codec.encode_chat(messages[:i])[:end] == tokens[:end] for i in range(1, 5))
    first_turn = codec.encode_chat(messages[:2])
    assert codec.chat_boundaries(messages[:2], first_turn)[-1] in ends, "the next turn finds the last message end"


def test_every_turn_of_a_long_conversation_finds_the_prefix_its_last_turn_kept(tiny_model):
    codec = TextCodec.load(tiny_model)
    messages: list[dict] = [{"role": "system", "content": "You answer about rivers and bridges, briefly. " * 4}]
    kept: tuple[int, bytes] | None = None
    for turn in range(6):
        messages.append({"role": "user", "content": f"Question {turn}: which bridge is older, and why? " * 3})
        tokens = codec.encode_chat(messages)
        ends = codec.chat_boundaries(messages, tokens)
        assert len(ends) == len(messages), "every message's end is found"
        plan = plan_prefixes(tokens, ends, 64, KEY, messages=True)
        if kept is not None:
            position, name = kept
            assert plan.names.get(position) == name, f"turn {turn} does not find turn {turn - 1}'s prefix"
        last = max(plan.keep)
        kept = (last, plan.names[last])
        messages.append({"role": "assistant", "content": f"Answer {turn}: the stone one."})
