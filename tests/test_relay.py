"""meshd-relay in one process: registration, circuits, limits and their metrics, the peers' end-to-end
TLS through it (what the relay sees is TLS records only), direct upgrade, and re-registration after a
relay restart."""

from __future__ import annotations

import contextlib
import functools
import json
import struct

import pytest
import torch
import trio
from meshd_relay import RelayConfig, RelayServer, load_config
from trio_websocket import ConnectionClosed, open_websocket, serve_websocket

from meshd.address import Address, relay_address
from meshd.admission.records import sign_membership
from meshd.identity import Identity
from meshd.limits import TokenBucket
from meshd.transport import Transport
from meshd.transport.errors import TransportError
from meshd.transport.relay import (
    CLOSE_CODES,
    DIAL_PREFIX,
    NONCE_BYTES,
    REGISTER_PATH,
    Reason,
    RelayRegistration,
    parse_message,
    registration_message,
)
from meshd.wire.bundle import HiddenStateBundle, Phase, encode

ECHO = "/test/echo"


def relay_config(**overrides) -> RelayConfig:
    base = dict(listen="127.0.0.1:0", metrics="", max_circuits_per_peer=4, bandwidth_bytes_per_s=0,
                max_message_bytes=256 * 1024, log_format="text")
    return RelayConfig(**{**base, **overrides})


async def start_relay(nursery: trio.Nursery, tap=None, **overrides) -> RelayServer:
    return await nursery.start(RelayServer(relay_config(**overrides), tap=tap).serve)


def rejections(server: RelayServer, reason: Reason) -> float:
    return server.metrics.value("meshd_relay_rejections_total", reason=reason.value)


async def echo(stream) -> None:
    async for message in stream:
        await stream.send_message(message)
    await stream.end()


class RelayedPeer:
    """A transport that is reachable only through a relay, serving ``echo``."""

    def __init__(self, transport: Transport, registration: RelayRegistration) -> None:
        self.transport = transport
        self.registration = registration

    @property
    def peer_id(self) -> str:
        return self.transport.identity.peer_id


async def relayed_peer(nursery: trio.Nursery, relay: RelayServer, identity: Identity | None = None,
                       **kwargs) -> RelayedPeer:
    transport = Transport(identity or Identity.generate())
    await nursery.start(_hold, transport)

    async def on_circuit(stream, remote: str) -> None:
        await transport.accept_stream(stream, echo, remote)

    registration = RelayRegistration(transport.identity, f"127.0.0.1:{relay.port}", on_circuit,
                                     backoff_initial=0.05, backoff_max=0.2, **kwargs)
    nursery.start_soon(registration.run)
    await wait_for(lambda: registration.registered, "registration")
    return RelayedPeer(transport, registration)


async def _hold(resource, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with resource:
        task_status.started()
        await trio.sleep_forever()


async def dialer(nursery: trio.Nursery) -> Transport:
    transport = Transport(Identity.generate())
    await nursery.start(_hold, transport)
    return transport


async def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.02)


async def round_trip(transport: Transport, target: RelayedPeer, relay: RelayServer, body: bytes = b"ping") -> bytes:
    return await transport.request(target.peer_id, relay_address(f"127.0.0.1:{relay.port}"), ECHO, body, timeout=10)


async def closed_with(ws) -> tuple[int | None, str | None]:
    with trio.fail_after(5):
        try:
            while True:
                await ws.get_message()
        except ConnectionClosed as exc:
            return (exc.reason.code, exc.reason.reason) if exc.reason else (None, None)


# -- pure pieces -----------------------------------------------------------------------------------


def test_token_bucket_shapes_then_refuses():
    bucket = TokenBucket(rate=1000, burst=2000, max_delay=1.0, now=0.0)
    assert bucket.take(1500, 0.0) == 0.0
    assert bucket.take(1000, 0.0) == pytest.approx(0.5)  # over the burst: delayed, not refused
    assert bucket.take(5000, 0.5) is None  # would need 5 s: refused, allowance untouched
    assert bucket.take(900, 1.5) == 0.0


def test_relay_addresses_round_trip():
    assert str(relay_address("198.51.100.7:7800")) == "relay:198.51.100.7:7800"
    assert Address.parse("relay:198.51.100.7:7800").endpoint == Address("198.51.100.7", 7800)
    assert Address.parse("relay:[::1]:7800").endpoint == Address("::1", 7800)
    assert str(relay_address("[::1]:7800")) == "relay:[::1]:7800"


def test_config_from_toml_and_flags(tmp_path):
    path = tmp_path / "relay.toml"
    path.write_text('listen = "0.0.0.0:9000"\nbandwidth_bytes_per_s = "1MiB"\nallow_peers = ["abc"]\n')
    config = load_config(path, {"max_peers": "7", "idle_timeout_s": None})
    assert (config.listen, config.bandwidth_bytes_per_s, config.allow_peers, config.max_peers) == (
        "0.0.0.0:9000", 1024**2, ["abc"], 7)
    with pytest.raises(ValueError, match="unknown settings"):
        load_config(None, {"max_peer": 3})


def test_a_burst_or_delay_without_a_bandwidth_cap_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "relay.toml"
    path.write_text('bandwidth_bytes_per_s = 0\nbandwidth_max_delay_s = 5\n')
    with pytest.raises(ValueError, match=r"^bandwidth_max_delay_s shapes a bandwidth cap"):
        load_config(path)
    monkeypatch.setenv("MESHD_RELAY_BANDWIDTH_BURST_BYTES", "1MiB")
    with pytest.raises(ValueError, match=r"^bandwidth_burst_bytes and bandwidth_max_delay_s shape"):
        load_config(path)
    # with a cap they shape it; without a cap and without them, nothing to refuse
    capped = load_config(path, {"bandwidth_bytes_per_s": "2MiB"})
    assert (capped.bandwidth_burst_bytes, capped.bandwidth_max_delay_s) == (1024**2, 5.0)
    monkeypatch.delenv("MESHD_RELAY_BANDWIDTH_BURST_BYTES")
    assert load_config(None, {"bandwidth_bytes_per_s": "0"}).bandwidth_bytes_per_s == 0


# -- registration ----------------------------------------------------------------------------------


async def test_bad_signature_and_replayed_challenge_are_refused_and_counted(nursery):
    relay = await start_relay(nursery)
    alice, mallory = Identity.generate(), Identity.generate()

    async with open_websocket("127.0.0.1", relay.port, REGISTER_PATH, use_ssl=False) as ws:
        nonce = bytes.fromhex(parse_message(await ws.get_message(), "challenge")["nonce"])
        forged = json.loads(registration_message(mallory, nonce))
        forged["public_key"] = alice.public_key.hex()  # claims alice's id, signed with mallory's key
        await ws.send_message(json.dumps(forged))
        assert await closed_with(ws) == (CLOSE_CODES[Reason.BAD_SIGNATURE], "bad_signature")
    assert rejections(relay, Reason.BAD_SIGNATURE) == 1
    assert relay.registered == []

    async with open_websocket("127.0.0.1", relay.port, REGISTER_PATH, use_ssl=False) as ws:
        nonce = bytes.fromhex(parse_message(await ws.get_message(), "challenge")["nonce"])
        captured = registration_message(alice, nonce)
        await ws.send_message(captured)
        assert parse_message(await ws.get_message(), "registered")["peer_id"] == alice.peer_id
    async with open_websocket("127.0.0.1", relay.port, REGISTER_PATH, use_ssl=False) as ws:
        await ws.get_message()
        await ws.send_message(captured)  # someone who saw alice register replays her answer
        assert await closed_with(ws) == (CLOSE_CODES[Reason.REPLAYED_CHALLENGE], "replayed_challenge")
    assert rejections(relay, Reason.REPLAYED_CHALLENGE) == 1

    async with open_websocket("127.0.0.1", relay.port, REGISTER_PATH, use_ssl=False) as ws:
        await ws.get_message()
        await ws.send_message(registration_message(alice, bytes(NONCE_BYTES)))  # a nonce never issued
        assert (await closed_with(ws))[1] == "bad_challenge"

    # The relay still serves everybody else.
    target = await relayed_peer(nursery, relay)
    assert await round_trip(await dialer(nursery), target, relay) == b"ping"
    assert relay.metrics.value("meshd_relay_registered_peers") == 1


NESTED = "[" * 2040 + "]" * 2040  # valid JSON, under the control messages' size limit, past Python's recursion limit


async def test_deeply_nested_json_in_a_registration_is_refused_as_malformed(nursery):
    relay = await start_relay(nursery)
    async with open_websocket("127.0.0.1", relay.port, REGISTER_PATH, use_ssl=False) as ws:
        await ws.get_message()
        await ws.send_message(NESTED)
        assert (await closed_with(ws))[1] == "malformed"
    assert rejections(relay, Reason.MALFORMED) == 1
    target = await relayed_peer(nursery, relay)  # the relay still serves everybody else
    assert await round_trip(await dialer(nursery), target, relay) == b"ping"


@pytest.mark.parametrize("when", ["challenge", "registered", "registered-later"])
async def test_a_relay_sending_garbage_costs_a_peer_its_registration_only(nursery, when):
    """Whatever a relay (or anyone on the path of its plain WebSocket) sends, the registration fails
    and is tried again; it never ends the peer's task."""
    sessions = 0

    async def bad_relay(request) -> None:
        nonlocal sessions
        sessions += 1
        ws = await request.accept()
        with contextlib.suppress(ConnectionClosed):  # the peer may close at any point (the test ends it)
            if when == "challenge":
                await ws.send_message(NESTED)
            else:
                await ws.send_message(json.dumps({"type": "challenge", "nonce": "00" * NONCE_BYTES}))
                await ws.get_message()
                await ws.send_message(json.dumps({"type": "registered", "peer_id": identity.peer_id}))
                if when == "registered-later":  # once the peer waits for circuits
                    await trio.sleep(0.1)
                await ws.send_message(NESTED)
            while True:  # until the peer closes its side
                await ws.get_message()

    identity = Identity.generate()
    server = await nursery.start(serve_websocket, bad_relay, "127.0.0.1", 0, None)
    registration = RelayRegistration(identity, f"127.0.0.1:{server.port}", None, backoff_initial=0.01,
                                     backoff_max=0.02)
    async with trio.open_nursery() as inner:
        inner.start_soon(registration.run)
        await wait_for(lambda: sessions >= 3 and not registration.registered, "three sessions with the relay",
                       timeout=30)
        inner.cancel_scope.cancel()
    assert sessions >= 3
    assert "malformed" in registration.last_error and "nested too deeply" in registration.last_error


async def test_allow_list_and_relay_full(nursery):
    allowed = Identity.generate()
    relay = await start_relay(nursery, allow_peers=[allowed.peer_id], max_peers=1)
    refused = RelayRegistration(Identity.generate(), f"127.0.0.1:{relay.port}", None, backoff_initial=5)
    nursery.start_soon(refused.run)
    await wait_for(lambda: rejections(relay, Reason.NOT_ALLOWED) >= 1, "not_allowed")
    assert "not_allowed" in refused.last_error and not refused.registered

    relay2 = await start_relay(nursery, max_peers=1)
    await relayed_peer(nursery, relay2)
    second = RelayRegistration(Identity.generate(), f"127.0.0.1:{relay2.port}", None, backoff_initial=5)
    nursery.start_soon(second.run)
    await wait_for(lambda: rejections(relay2, Reason.RELAY_FULL) >= 1, "relay_full")


async def test_a_private_meshs_relay_registers_only_its_members(nursery):
    mesh_key, outsider, member = Identity.generate(), Identity.generate(), Identity.generate()
    relay = await start_relay(nursery, mesh_key=mesh_key.public_key.hex())
    shows = {
        "nothing": None,
        "another mesh's credential": sign_membership(Identity.generate(), outsider.peer_id, 1).SerializeToString(),
        "someone else's credential": sign_membership(mesh_key, member.peer_id, 1).SerializeToString(),
    }
    for count, (what, credential) in enumerate(shows.items(), start=1):
        refused = RelayRegistration(outsider, f"127.0.0.1:{relay.port}", None, backoff_initial=5,
                                    membership=(lambda c=credential: c or b""))
        nursery.start_soon(refused.run)
        await wait_for(lambda n=count: rejections(relay, Reason.NOT_MEMBER) >= n, what)
        assert "not_member" in refused.last_error and not refused.registered
    credential = sign_membership(mesh_key, member.peer_id, 1).SerializeToString()
    target = await relayed_peer(nursery, relay, identity=member, membership=lambda: credential)
    assert await round_trip(await dialer(nursery), target, relay) == b"ping"


# -- circuits --------------------------------------------------------------------------------------


async def test_dialing_an_unknown_peer_is_refused(nursery):
    relay = await start_relay(nursery)
    async with open_websocket("127.0.0.1", relay.port, DIAL_PREFIX + "nosuchpeer", use_ssl=False) as ws:
        assert await closed_with(ws) == (CLOSE_CODES[Reason.UNKNOWN_PEER], "unknown_peer")
    client = await dialer(nursery)
    with pytest.raises(Exception, match="unknown_peer"):
        await client.request(Identity.generate().peer_id, relay_address(f"127.0.0.1:{relay.port}"), ECHO, b"x",
                             timeout=5)
    assert rejections(relay, Reason.UNKNOWN_PEER) == 2
    target = await relayed_peer(nursery, relay)
    assert await round_trip(client, target, relay) == b"ping"


async def test_circuit_limit_per_peer(nursery):
    relay = await start_relay(nursery, max_circuits_per_peer=2)
    target = await relayed_peer(nursery, relay)
    clients = [await dialer(nursery) for _ in range(3)]
    for client in clients[:2]:
        assert await round_trip(client, target, relay) == b"ping"  # each holds its circuit open
    assert relay.metrics.value("meshd_relay_open_circuits") == 2
    with pytest.raises(Exception, match="circuit_limit"):
        await round_trip(clients[2], target, relay)
    assert rejections(relay, Reason.CIRCUIT_LIMIT) == 1
    other = await relayed_peer(nursery, relay)
    assert await round_trip(clients[2], other, relay) == b"ping"  # other peers are unaffected


async def test_registering_again_keeps_a_peers_circuit_count_and_allowance(nursery):
    """Circuits outlive the registration they came through: a peer registering again (over its live
    registration, or after dropping it) must not get a fresh circuit count or bandwidth bucket."""
    relay = await start_relay(nursery, max_circuits_per_peer=2)
    identity = Identity.generate()
    first = await relayed_peer(nursery, relay, identity)
    clients = [await dialer(nursery) for _ in range(3)]
    for client in clients[:2]:
        assert await round_trip(client, first, relay) == b"ping"
    bucket = relay._peers[identity.peer_id].bucket
    again = await relayed_peer(nursery, relay, identity)  # the same peer registers a second time
    await wait_for(lambda: first.registration.last_error is not None, "the first registration replaced")
    assert relay._peers[identity.peer_id].bucket is bucket
    with pytest.raises(Exception, match="circuit_limit"):
        await round_trip(clients[2], again, relay)
    assert relay.metrics.value("meshd_relay_open_circuits") == 2


async def test_oversize_message_is_refused(nursery):
    relay = await start_relay(nursery, max_message_bytes=64 * 1024)
    target = await relayed_peer(nursery, relay)
    async with open_websocket("127.0.0.1", relay.port, DIAL_PREFIX + target.peer_id, use_ssl=False) as ws:
        await wait_for(lambda: relay.metrics.value("meshd_relay_open_circuits") == 1, "circuit")
        await ws.send_message(b"\x16" * (64 * 1024 + 1))
        code, _ = await closed_with(ws)
        assert code == 1009
    await wait_for(lambda: rejections(relay, Reason.MESSAGE_TOO_LARGE) == 1, "message_too_large")
    assert await round_trip(await dialer(nursery), target, relay) == b"ping"


async def test_bandwidth_cap_slows_then_cuts_a_peer(nursery):
    relay = await start_relay(nursery, bandwidth_bytes_per_s=64 * 1024, bandwidth_burst_bytes=128 * 1024,
                              bandwidth_max_delay_s=0.5, max_message_bytes=128 * 1024)
    target = await relayed_peer(nursery, relay)
    client = await dialer(nursery)
    assert await round_trip(client, target, relay, b"x" * 1000) == b"x" * 1000  # within the cap
    async with open_websocket("127.0.0.1", relay.port, DIAL_PREFIX + target.peer_id, use_ssl=False) as ws:
        await wait_for(lambda: relay.metrics.value("meshd_relay_open_circuits") == 2, "circuit")
        for _ in range(3):
            await ws.send_message(b"\x17" * (120 * 1024))  # far above 64 KiB/s
        code, reason = await closed_with(ws)
        assert (code, reason) == (CLOSE_CODES[Reason.BANDWIDTH_LIMIT], "bandwidth_limit")
    assert rejections(relay, Reason.BANDWIDTH_LIMIT) == 1
    other = await relayed_peer(nursery, relay)
    assert await round_trip(client, other, relay) == b"ping"


async def test_idle_circuits_are_closed(nursery):
    relay = await start_relay(nursery, idle_timeout_s=0.3)
    target = await relayed_peer(nursery, relay)
    client = await dialer(nursery)
    assert await round_trip(client, target, relay) == b"ping"
    await wait_for(lambda: relay.metrics.value("meshd_relay_circuits_closed_total", reason="idle_timeout") == 1,
                   "idle close")
    assert await round_trip(client, target, relay) == b"ping"  # the next request dials a new circuit


async def test_metrics_endpoint_serves_prometheus_text(nursery):
    relay = await start_relay(nursery, metrics="127.0.0.1:0")
    target = await relayed_peer(nursery, relay)
    assert await round_trip(await dialer(nursery), target, relay) == b"ping"
    stream = await trio.open_tcp_stream("127.0.0.1", relay.metrics_port)
    async with stream:
        await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
        body = b""
        while chunk := await stream.receive_some():
            body += chunk
    text = body.decode()
    for name in ("meshd_relay_registered_peers 1.0", "meshd_relay_open_circuits 1.0",
                 'meshd_relay_bytes_relayed_total{direction="to_peer"}', "meshd_relay_rejections_total"):
        assert name in text, name


# -- what the relay sees ---------------------------------------------------------------------------


def tls_records(data: bytes) -> list[tuple[int, int]]:
    """Walk a byte stream as TLS records; fail on anything that is not one."""
    records, offset = [], 0
    while offset < len(data):
        assert len(data) - offset >= 5, "a truncated record header"
        kind, version, length = struct.unpack("!BHH", data[offset:offset + 5])
        assert kind in (0x14, 0x15, 0x16, 0x17), f"record type {kind:#x} at {offset}"
        assert version == 0x0303 or (version == 0x0301 and not records), f"record version {version:#x}"
        assert length <= 2**14 + 256, "record longer than TLS allows"
        records.append((kind, length))
        offset += 5 + length
    assert offset == len(data)
    return records


async def test_relay_forwards_only_tls_records(nursery):
    captured: dict[str, bytearray] = {"to_peer": bytearray(), "from_peer": bytearray()}
    relay = await start_relay(nursery, tap=lambda _c, direction, message: captured[direction].extend(message))
    target = await relayed_peer(nursery, relay)
    client = await dialer(nursery)
    token_ids = torch.tensor([31337, 4242, 27182, 16180, 14142], dtype=torch.long)
    bundle = HiddenStateBundle(session_id="secret-session-7f3a", epoch=1, phase=Phase.PREFILL, start_position=0,
                               token_count=5, tensors={"input_ids": token_ids}, range_start=0, range_end=2)
    encoded = encode(bundle)
    assert await round_trip(client, target, relay, encoded) == encoded

    for direction, data in captured.items():
        records = tls_records(bytes(data))
        assert {kind for kind, _ in records} <= {0x14, 0x16, 0x17}, direction
        assert sum(1 for kind, _ in records if kind == 0x17) >= 2, "application data went through"
        for needle in (encoded[:32], encoded[-32:], token_ids.numpy().tobytes(), b"secret-session-7f3a",
                       b"/test/echo", b"meshdCA1", target.peer_id.encode()):
            assert needle not in data, f"{needle!r} in the clear ({direction})"


# -- peers -----------------------------------------------------------------------------------------


async def test_a_relayed_connection_is_replaced_by_a_direct_one(nursery):
    relay = await start_relay(nursery)
    target = await relayed_peer(nursery, relay)
    port = await nursery.start(target.transport.serve, "127.0.0.1:0", echo)
    client = await dialer(nursery)
    assert await round_trip(client, target, relay) == b"ping"
    assert client.connection_route(target.peer_id) == "relay"
    assert await client.request(target.peer_id, Address("127.0.0.1", port), ECHO, b"direct") == b"direct"
    assert client.connection_route(target.peer_id) == "direct"
    assert await client.check_dialable(target.peer_id, f"127.0.0.1:{port}") is None
    assert await client.check_dialable(Identity.generate().peer_id, f"127.0.0.1:{port}") is not None


async def test_peers_re_register_after_a_relay_restart(nursery):
    first = RelayServer(relay_config())
    scope = trio.CancelScope()
    nursery.start_soon(_serve_in, first, scope)
    await wait_for(lambda: first.port is not None, "relay up")
    port = first.port
    target = await relayed_peer(nursery, first)
    client = await dialer(nursery)
    assert await round_trip(client, target, first) == b"ping"

    scope.cancel()  # the relay goes away, taking its circuits with it
    await wait_for(lambda: not target.registration.registered, "registration lost")
    second = await start_relay(nursery, listen=f"127.0.0.1:{port}")
    await wait_for(lambda: target.registration.registered, "re-registration")
    assert second.registered == [target.peer_id]
    assert await round_trip(client, target, second) == b"ping"
    assert target.registration.registrations == 2


async def _serve_in(server: RelayServer, scope: trio.CancelScope) -> None:
    with scope:
        await server.serve()


# -- choosing addresses and costing relayed seams -----------------------------------------------------


def test_dialers_prefer_direct_addresses_and_cards_follow_reachability(tmp_path):
    from meshd.daemon.config import PeerConfig
    from meshd.daemon.reachability import Reachability
    from meshd.tracker.view import dial_address, relayed_through
    from meshd.wire import card_pb2 as cpb

    both = cpb.CapabilityCard(addresses=["198.51.100.1:7700"], relay_addresses=["relay:192.0.2.5:7800"])
    relayed = cpb.CapabilityCard(relay_addresses=["relay:192.0.2.5:7800"])
    assert dial_address(both) == "198.51.100.1:7700" and relayed_through(both) == []
    assert dial_address(relayed) == "relay:192.0.2.5:7800" and relayed_through(relayed) == ["relay:192.0.2.5:7800"]
    assert dial_address(cpb.CapabilityCard()) is None

    def reach(mode: str, relays: list[str]) -> Reachability:
        config = PeerConfig(data_dir=tmp_path, advertise="198.51.100.1:7700", relays=relays, reachability=mode)
        return Reachability(config, Transport(Identity.generate()), Identity.generate(),
                            advertised=lambda: config.advertised, on_change=lambda: None)

    assert reach("direct", []).direct_addresses() == ["198.51.100.1:7700"]
    assert reach("direct", []).registrations == []
    with pytest.raises(ValueError, match="direct never uses them"):  # relays it would ignore are refused
        reach("direct", ["192.0.2.5:7800"])
    assert reach("relayed", ["192.0.2.5:7800"]).direct_addresses() == []
    assert reach("auto", []).direct_addresses() == ["198.51.100.1:7700"]  # nothing to fall back on
    auto = reach("auto", ["192.0.2.5:7800"])
    assert auto.direct_addresses() == [] and auto.relay_addresses() == []  # not registered yet
    auto.dialable = True
    assert auto.direct_addresses() == ["198.51.100.1:7700"]


def test_relayed_seams_cost_their_measured_rtt():
    from meshd.tracker.routing import RELAY_PENALTY_MS, UNMEASURED_RTT_MS, plan_route, seam_ms
    from meshd.tracker.view import ShardOffer

    def offer(peer: str, rng: tuple[int, int], relayed: bool) -> ShardOffer:
        return ShardOffer(peer_id=peer, model_id="m", compat_key="k", n_layers=4, layer_bytes=1, edge_bytes=1,
                          memory_budget_bytes=10, range=rng, relayed=relayed)

    near, far = offer("a", (0, 4), relayed=True), offer("b", (0, 4), relayed=False)
    assert seam_ms(near, None) == UNMEASURED_RTT_MS + RELAY_PENALTY_MS  # unmeasured: assume the relay is slow
    assert seam_ms(near, 0.8) == 0.8  # measured: the RTT already includes the relay path
    assert plan_route("m", [near, far], lambda p: None).hops[0].peer_id == "b"
    assert plan_route("m", [near, far], lambda p: {"a": 0.5, "b": 9.0}[p]).hops[0].peer_id == "a"


async def test_dial_back_requests_are_rate_limited_per_peer_in_bounded_memory(monkeypatch):
    from meshd.daemon import reachability
    from meshd.daemon.config import PeerConfig
    from meshd.daemon.reachability import DialbackRefused, Reachability
    from meshd.wire import rpc_pb2 as rpb

    class Dialer:
        async def check_dialable(self, peer_id: str, address: object, timeout: float) -> str | None:
            return None

    monkeypatch.setattr(reachability, "DIALBACK_ASKERS_KEPT", 50)
    helper = Reachability(PeerConfig(reachability="direct"), Dialer(), Identity.generate(),  # type: ignore[arg-type]
                          lambda: "127.0.0.1:7700", lambda: None)
    ask = rpb.DialbackRequest(address="127.0.0.1:7799")
    assert (await helper.serve_dialback("first", ask)).dialable
    with pytest.raises(DialbackRefused, match="too often"):
        await helper.serve_dialback("first", ask)
    for i in range(500):  # throwaway identities: their times are remembered, the latest 50
        await helper.serve_dialback(f"asker-{i}", ask)
    assert len(helper._asked_at) == 50
    with pytest.raises(DialbackRefused, match="too often"):
        await helper.serve_dialback("asker-499", ask)


def _raw_relay_client(port: int, first: bytes, then: bytes = b"", reset: bool = False) -> None:
    """A client that is no WebSocket peer: ``first``, the relay's answer read, ``then``, and a close (a
    reset with ``reset``)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(first)
        if then:
            s.recv(4096)
            s.sendall(then)
        if reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def test_clients_that_break_the_protocol_cost_the_relay_nothing(nursery):
    """Garbage then a reset, and a PING answering the relay's refusal, each failed in trio-websocket's
    reader and ended the whole relay."""
    import base64

    relay = await start_relay(nursery)
    upgrade = (f"GET {DIAL_PREFIX}nosuchpeer HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {base64.b64encode(bytes(16)).decode()}\r\nSec-WebSocket-Version: 13\r\n\r\n")
    for _ in range(20):
        await trio.to_thread.run_sync(_raw_relay_client, relay.port, b"\x00garbage that is not HTTP\r\n\r\n", b"",
                                      True)
        await trio.to_thread.run_sync(_raw_relay_client, relay.port, upgrade.encode(),
                                      bytes([0x89, 0x80]) + bytes(4))  # a masked, empty PING
    await trio.sleep(0.5)
    target = await relayed_peer(nursery, relay)
    assert await round_trip(await dialer(nursery), target, relay) == b"ping"


async def test_a_relay_answering_garbage_fails_the_dial_and_the_registration_only(nursery):
    async def bad_upgrade(stream) -> None:
        with contextlib.suppress(Exception):
            await stream.receive_some(65536)
            await stream.send_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade"
                                  b"\r\nSec-WebSocket-Accept: AAAAAAAAAAAAAAAAAAAAAAAAAAA=\r\n\r\n")
            await trio.sleep(2)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, bad_upgrade, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    client = await dialer(nursery)
    with pytest.raises(TransportError, match="did not answer as a WebSocket relay"):
        await client.request(Identity.generate().peer_id, relay_address(f"127.0.0.1:{port}"), ECHO, b"hi",
                             timeout=5)
    registration = RelayRegistration(Identity.generate(), f"127.0.0.1:{port}", None, backoff_initial=0.01,
                                     backoff_max=0.02)
    async with trio.open_nursery() as inner:
        inner.start_soon(registration.run)
        await wait_for(lambda: "did not answer as a WebSocket relay" in (registration.last_error or ""),
                       "a failed registration")
        inner.cancel_scope.cancel()
    relay = await start_relay(nursery)  # the dialler's transport still works
    target = await relayed_peer(nursery, relay)
    assert await round_trip(client, target, relay) == b"ping"
