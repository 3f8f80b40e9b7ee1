"""Every parser of network and client bytes, fuzzed: it answers with its own typed error or a value,
never another exception, never a hang, and never a structure the next plane trips on.

Inputs are schema-aware (``tests.fuzzing``): messages with edge values in every field, validly signed
when a signature would otherwise stop them at the door, then mutated. A short run is part of
``make test``; docs/development.md gives the command for a long one.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import random
import tempfile
import time
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from meshd.admission import InviteRefused, Membership, MeshGate, invite_token, parse_token
from meshd.admission.records import check_membership, sign_membership, sign_revocation
from meshd.api.errors import ApiError
from meshd.api.validation import decode_json_object, parse_chat, parse_completion
from meshd.cards import CardRejected, sign_card, verify_card
from meshd.election.lease import sign_lease
from meshd.errors import BundleError, MeshError
from meshd.gossip import GossipConfig, GossipNode
from meshd.identity import Identity
from meshd.rpc import RpcRouter
from meshd.session import messages as seam
from meshd.tracker.duties import TrackerDuties, route_from_reply
from meshd.tracker.placement import place
from meshd.tracker.routing import NoRouteError, plan_route
from meshd.tracker.view import offers_of
from meshd.transport.errors import FramingError
from meshd.transport.framing import MessageDecoder, encode_message
from meshd.transport.relay import RelayRejected, parse_message, read_registration
from meshd.weights.source import BadManifest, manifest_from_message
from meshd.wire import admission_pb2 as apb
from meshd.wire import bundle as wire
from meshd.wire import card_pb2 as cpb
from meshd.wire import hidden_state_pb2 as hpb
from meshd.wire import rpc_pb2 as rpb
from meshd.wire import session_pb2 as spb
from tests.fuzzing import FUZZ, messages, mutated, wire_bytes

IDENTITIES = [Identity.from_seed(bytes([i + 40]) * 32) for i in range(3)]
NOW_MS = 1_800_000_000_000


def signed_cards(identity: Identity) -> st.SearchStrategy[cpb.SignedCard]:
    """Cards with anything in them, signed by ``identity`` with its own id and key and a live lifetime:
    what any peer can legitimately put on the wire about itself."""

    def sign(card: cpb.CapabilityCard) -> cpb.SignedCard:
        card.peer_id, card.public_key = identity.peer_id, identity.public_key
        card.issued_at_ms, card.expires_at_ms = NOW_MS - 1000, NOW_MS + 60_000
        return sign_card(card, identity)

    return messages(cpb.CapabilityCard).map(sign)


@FUZZ
@given(wire_bytes(cpb.SignedCard))
def test_cards_verify_or_are_rejected(raw):
    with contextlib.suppress(CardRejected):
        verify_card(raw, NOW_MS)


@FUZZ
@given(st.lists(signed_cards(IDENTITIES[0]), min_size=1, max_size=1), st.lists(signed_cards(IDENTITIES[1]),
                                                                                min_size=1, max_size=1))
def test_tracker_plans_over_any_signed_cards(cards_a, cards_b):
    """A peer may claim anything in its own card: placement and routing never fail on it, even where it
    claims the model and compat key of another peer's offer with other layers."""
    offers = [o for signed in cards_a + cards_b for o in offers_of(verify_card(signed, NOW_MS).card)]
    if offers:
        offers += [dataclasses.replace(o, model_id=offers[0].model_id, compat_key=offers[0].compat_key)
                   for o in offers[1:]]
    for model_id in {o.model_id for o in offers}:
        group = [o for o in offers if o.model_id == model_id]
        for offer in group:
            assert offer.range is None or 0 <= offer.range[0] < offer.range[1] <= offer.n_layers
        try:
            route = plan_route(model_id, group, lambda _p: 1.0)
        except NoRouteError:
            pass
        else:
            assert (route.hops[0].start == 0 and route.hops[-1].end == group[0].n_layers) or route.hops
        for key in {o.compat_key for o in group}:
            for peer_id, (start, end) in place([o for o in group if o.compat_key == key]).items():
                assert 0 <= start < end, peer_id
    TrackerDuties().placement_orders(offers, now=0.0)


@FUZZ
@given(messages(rpb.RouteReply))
def test_routes_from_a_tracker_tile_or_are_refused(reply):
    try:
        route = route_from_reply(reply)
    except ValueError:
        return
    assert route.hops[0].start == 0


def gossip_messages() -> st.SearchStrategy[cpb.GossipMessage]:
    def with_real_cards(msg: cpb.GossipMessage, cards: list[cpb.SignedCard], lease_term: int) -> cpb.GossipMessage:
        msg.cards.extend(cards)
        msg.leases.append(sign_lease(IDENTITIES[1], lease_term, NOW_MS - 10, NOW_MS + 3000))
        return msg

    return st.builds(with_real_cards, messages(cpb.GossipMessage),
                     st.lists(signed_cards(IDENTITIES[1]), max_size=2), st.integers(0, 2**64 - 1))


def _parse_or_empty(raw: bytes) -> cpb.GossipMessage:
    msg = cpb.GossipMessage()
    try:
        msg.ParseFromString(raw)
    except DecodeError:  # refused by the RPC layer before gossip sees it
        return cpb.GossipMessage()
    return msg


@FUZZ
@given(st.lists(st.one_of(gossip_messages(), wire_bytes(cpb.GossipMessage).map(_parse_or_empty)), min_size=1,
                max_size=4))
def test_gossip_takes_any_message_without_failing(batch):
    node = GossipNode.with_identity(IDENTITIES[0], cpb.CapabilityCard(addresses=["127.0.0.1:1"]),
                                    GossipConfig(), random.Random(1))
    now = NOW_MS / 1000
    for msg in batch:
        node.on_message(IDENTITIES[1].peer_id, msg, now)
        node.tick(now)
        now += 0.3
    for card in node.live_cards().values():
        offers_of(card.card)


MESH_KEY = Identity.from_seed(bytes([90]) * 32)


def member_cards(identity: Identity) -> st.SearchStrategy[cpb.SignedCard]:
    """Cards of anything, signed by a member of MESH_KEY's private mesh, credential included."""

    def sign(card: cpb.CapabilityCard) -> cpb.SignedCard:
        card.peer_id, card.public_key = identity.peer_id, identity.public_key
        card.issued_at_ms, card.expires_at_ms = NOW_MS - 1000, NOW_MS + 60_000
        card.membership.CopyFrom(sign_membership(MESH_KEY, identity.peer_id, NOW_MS))
        return sign_card(card, identity)

    return messages(cpb.CapabilityCard).map(sign)


def private_gossip() -> st.SearchStrategy[cpb.GossipMessage]:
    def build(msg: cpb.GossipMessage, cards: list[cpb.SignedCard], revoke: list[int]) -> cpb.GossipMessage:
        msg.cards.extend(cards)
        msg.push_pull.revocations.extend(sign_revocation(MESH_KEY, IDENTITIES[i].peer_id, NOW_MS) for i in revoke)
        return msg

    return st.builds(build, messages(cpb.GossipMessage), st.lists(st.one_of(member_cards(IDENTITIES[1]),
                                                                          member_cards(IDENTITIES[2])), max_size=2),
                     st.lists(st.sampled_from([1, 2]), max_size=1))


@FUZZ
@given(st.lists(st.one_of(private_gossip(), wire_bytes(cpb.GossipMessage).map(_parse_or_empty)), min_size=1,
                max_size=4))
def test_a_private_meshs_gossip_takes_any_message_and_never_holds_a_revoked_peer(batch):
    node = GossipNode.with_identity(IDENTITIES[0], cpb.CapabilityCard(addresses=["127.0.0.1:1"]),
                                    GossipConfig(), random.Random(1))
    gate = MeshGate(MESH_KEY.public_key, IDENTITIES[0].peer_id)
    node.admit_with(gate)
    now = NOW_MS / 1000
    for msg in batch:
        node.on_message(IDENTITIES[1].peer_id, msg, now)
        node.tick(now)
        now += 0.3
        for peer_id in node.live_cards():
            assert peer_id == IDENTITIES[0].peer_id or (gate.admits(peer_id) and not gate.is_revoked(peer_id))


FOUNDER = Membership.load(Path(tempfile.mkdtemp(prefix="meshd-fuzz-")), IDENTITIES[0], open_mesh=False, founding=True)
INVITE = parse_token(FOUNDER.issue_invite(3600, 1000, ["127.0.0.1:7700"])[0])[0]


@FUZZ
@given(st.one_of(st.text(max_size=300), st.just(invite_token(INVITE)).map(lambda t: t[:-3] + "AAA"),
                 mutated(st.just(invite_token(INVITE).encode())).map(lambda b: b.decode("ascii", "replace"))))
def test_invite_tokens_parse_or_are_refused(text):
    with contextlib.suppress(InviteRefused):
        parse_token(text)


@FUZZ
@given(st.one_of(wire_bytes(apb.JoinRequest, depth=2),
                 mutated(st.just(apb.JoinRequest(invite=INVITE).SerializeToString()))))
def test_join_requests_get_a_membership_or_a_refusal(raw):
    request = apb.JoinRequest()
    try:
        request.ParseFromString(raw)
    except DecodeError:
        return
    try:
        reply = FOUNDER.redeem(IDENTITIES[1].peer_id, request)
    except MeshError:
        return
    assert request.invite == INVITE  # only the real invite, unchanged, admits
    check_membership(reply.membership, FOUNDER.gate.mesh_key, IDENTITIES[1].peer_id)  # type: ignore[union-attr]


@FUZZ
@given(st.one_of(st.none(), st.text(max_size=200), st.binary(max_size=200).map(
    lambda b: base64.b64encode(b).decode())))
def test_membership_headers_admit_or_refuse(header):
    assert MeshGate(MESH_KEY.public_key, "me").admit_stream(IDENTITIES[2].peer_id, header) is False


@FUZZ
@given(st.one_of(wire_bytes(hpb.HiddenStateBundle, depth=3), messages(hpb.HiddenStateBundle, depth=3).map(
    lambda m: _plausible_bundle(m).SerializeToString())))
def test_bundles_decode_or_are_refused(raw):
    try:
        bundle = wire.decode(raw)
    except BundleError:
        return
    for tensor in bundle.tensors.values():
        assert tensor.numel() * tensor.element_size() <= wire.MAX_TENSOR_BYTES


def _plausible_bundle(msg: hpb.HiddenStateBundle) -> hpb.HiddenStateBundle:
    """Past the header checks, so that tensor decoding is what gets fuzzed."""
    msg.version, msg.session_id = wire.SCHEMA_VERSION, msg.session_id or "s"
    msg.phase = msg.phase if msg.phase in (hpb.PREFILL, hpb.DECODE) else hpb.PREFILL
    msg.token_count = 1 if msg.phase == hpb.DECODE else max(1, min(msg.token_count, 8))
    msg.range_end = max(msg.range_end, msg.range_start + 1) if msg.range_start < 2**31 else msg.range_start
    return msg


@FUZZ
@given(wire_bytes(spb.SeamMessage, depth=3))
def test_seam_messages_parse_or_are_refused(raw):
    with contextlib.suppress(BundleError):
        seam.seam_bundle(seam.parse(raw))


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=8), st.integers(1, 64))
def test_framing_yields_whole_messages_or_one_error(chunks, limit):
    decoder = MessageDecoder(max_message_bytes=limit)
    try:
        for chunk in chunks:
            for message in decoder.feed(chunk):
                assert len(message) <= limit
        decoder.end()
    except FramingError:
        with pytest.raises(FramingError):
            decoder.feed(b"")  # poisoned for good


@FUZZ
@given(st.lists(st.binary(max_size=40), max_size=5), st.integers(1, 16))
def test_framing_round_trips_whatever_the_cut(payloads, cut):
    stream = b"".join(encode_message(p) for p in payloads)
    decoder = MessageDecoder()
    out = []
    for i in range(0, len(stream), cut):
        out += decoder.feed(stream[i:i + cut])
    decoder.end()
    assert out == payloads


def relay_docs() -> st.SearchStrategy[str]:
    keys = st.sampled_from(["type", "public_key", "nonce", "signature", "peer_id", "circuit", "membership"])
    values = st.one_of(st.text(max_size=70), st.integers(), st.none(), st.sampled_from(["register", "00" * 32,
                                                                                          "zz" * 32, "00" * 64]))
    docs = st.dictionaries(keys, values, max_size=5).map(json.dumps)
    return st.one_of(docs, st.text(max_size=100), mutated(docs.map(str.encode)).map(
        lambda b: b.decode("utf-8", "replace")))


@FUZZ
@given(relay_docs())
def test_relay_control_messages_parse_or_are_rejected(text):
    try:
        doc = parse_message(text)
        read_registration(doc)
    except RelayRejected:
        pass


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                        max_size=4), max_leaves=20)
API_KEYS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "stream", "stop", "seed", "n",
            "logprobs", "top_logprobs", "tools", "tool_choice", "stream_options", "ignore_eos", "role", "content"]


def api_bodies() -> st.SearchStrategy[bytes]:
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                     "content": json_values})
    body = st.fixed_dictionaries({"model": st.sampled_from(["m", ""])}, optional={
        "messages": st.lists(message, max_size=3) | json_values, "prompt": json_values,
        **{k: json_values for k in API_KEYS[3:]}})
    encoded = body.map(lambda b: json.dumps(b).encode())
    return st.one_of(encoded, mutated(encoded), st.binary(max_size=100))


@FUZZ
@given(api_bodies())
def test_api_bodies_parse_or_get_an_openai_error(raw):
    for parse in (parse_chat, parse_completion):
        with contextlib.suppress(ApiError):
            parse(decode_json_object(raw), "req")


@FUZZ
@given(messages(rpb.WeightsManifest, depth=2), st.booleans())
def test_manifests_from_peers_are_taken_only_when_they_match(message, claim_own_digest):
    from meshd.runtime.manifest import Manifest, TensorEntry, digest_of_chunks

    digest = "0" * 64
    if claim_own_digest:  # a self-consistent manifest of whatever tensors it lists
        entries = {r.name: TensorEntry(r.name, r.dtype, tuple(r.shape), digest_of_chunks(c.hex() for c in r.chunks),
                                       r.nbytes, tuple(c.hex() for c in r.chunks)) for r in message.tensors}
        digest = Manifest(entries).digest
    try:
        manifest = manifest_from_message(message, digest)
    except BadManifest:
        return
    assert manifest.digest == digest
    for entry in manifest.tensors.values():
        assert len(entry.chunks) == -(-entry.nbytes // (1024 * 1024))


@FUZZ
@given(wire_bytes(rpb.PeerRequest, depth=3))
async def test_rpc_requests_get_a_reply_whatever_they_hold(raw):
    router = RpcRouter()
    router.register("gossip", lambda s, m: _accepted())
    request = rpb.PeerRequest()
    try:
        request.ParseFromString(raw)
    except DecodeError:
        return
    started = time.monotonic()
    reply = await router.dispatch("sender", request)
    assert reply.WhichOneof("body") in ("accepted", "error")
    assert time.monotonic() - started < 5


async def _accepted() -> rpb.Accepted:
    return rpb.Accepted()
