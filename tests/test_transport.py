"""Peer transport: framing, client auth, and two real peers over TCP on loopback."""

from __future__ import annotations

import logging
import os
import time
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from meshd.address import Address
from meshd.identity import Identity
from meshd.transport import (
    ErrorCodes,
    FramingError,
    MessageDecoder,
    MessageTooLarge,
    PeerAuthError,
    StreamReset,
    Transport,
    TransportError,
    auth,
    encode_message,
)
from meshd.transport.framing import LENGTH_PREFIX
from meshd.transport.handshake import receive_exactly
from meshd.transport.tls import client_context, make_certificate, peer_id_from_certificate

HOST = "127.0.0.1"
TEST_TIMEOUT = 10


@pytest.fixture
def server_identity(tmp_path):
    return Identity.load_or_create(tmp_path / "server")


@pytest.fixture
def client_identity(tmp_path):
    return Identity.load_or_create(tmp_path / "client")


@asynccontextmanager
async def serving(identity, handler, port=0, **settings):
    async with Transport(identity, **settings) as transport, trio.open_nursery() as nursery:
        await nursery.start(transport.serve, Address(HOST, port), handler)
        yield transport
        nursery.cancel_scope.cancel()


async def echo(stream):
    async for message in stream:
        await stream.send_message(message)


async def wait_until(predicate, interval=0.005):
    while not predicate():
        await trio.sleep(interval)


# -- sans-IO pieces ---------------------------------------------------------------------------


def test_decoder_reassembles_split_and_batched_messages():
    wire = encode_message(b"one") + encode_message(b"") + encode_message(b"three" * 1000)
    decoder = MessageDecoder(max_message_bytes=10_000)
    out = []
    for i in range(0, len(wire), 7):
        out += decoder.feed(wire[i : i + 7])
    assert out == [b"one", b"", b"three" * 1000]
    assert not decoder.pending
    decoder.end()
    assert MessageDecoder().feed(wire) == out


def test_decoder_rejects_oversized_prefix_before_buffering():
    decoder = MessageDecoder(max_message_bytes=100)
    with pytest.raises(MessageTooLarge):
        decoder.feed(LENGTH_PREFIX.pack(101))
    with pytest.raises(MessageTooLarge):
        decoder.feed(b"more")  # poisoned for good
    with pytest.raises(MessageTooLarge):
        encode_message(b"x" * 101, max_message_bytes=100)


def test_decoder_rejects_truncated_stream():
    decoder = MessageDecoder()
    assert decoder.feed(LENGTH_PREFIX.pack(10) + b"abc") == []
    with pytest.raises(FramingError, match="inside a message"):
        decoder.end()


def test_client_auth_is_bound_to_nonce_and_server_certificate():
    server, client = Identity.generate(), Identity.generate()
    cert = make_certificate(server)
    assert peer_id_from_certificate(cert.der) == server.peer_id
    nonce = auth.new_nonce()
    response = auth.encode_response(client, nonce, cert.der)
    assert auth.verify_response(response, nonce, cert.der).peer_id == client.peer_id
    with pytest.raises(PeerAuthError):
        auth.verify_response(response, auth.new_nonce(), cert.der)  # replayed to a new challenge
    with pytest.raises(PeerAuthError):
        auth.verify_response(response, nonce, make_certificate(Identity.generate()).der)  # relayed


# -- two peers over TCP -----------------------------------------------------------------------


async def test_unary_request_authenticates_both_sides(server_identity, client_identity):
    seen = []

    async def handler(stream):
        seen.append((stream.peer_id, stream.path, stream.headers))
        message = await stream.receive_message()
        await stream.send_message(b"re:" + message)

    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, handler) as server, Transport(client_identity) as client:
            address = Address(HOST, server.listen_port)
            reply = await client.request(server_identity.peer_id, address, "/v1/ping", b"hi", headers={"X-Trace": "7"})
            assert reply == b"re:hi"
            assert seen == [(client_identity.peer_id, "/v1/ping", {"x-trace": "7"})]
            # A dialer that does not know the id learns the proven one.
            stream = await client.open_stream(None, address, "/v1/ping")
            async with stream:
                assert stream.peer_id == server_identity.peer_id
                await stream.send_message(b"again")
                assert await stream.receive_message() == b"re:again"
                assert await stream.receive_message() is None


async def test_each_side_knows_when_the_other_last_sent_it_bytes(server_identity, client_identity):
    async def handler(stream):
        await stream.send_message(await stream.receive_message())

    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, handler) as server, Transport(client_identity) as client:
            assert client.last_received() == {} and server.last_received() == {}
            address = Address(HOST, server.listen_port)
            await client.request(server_identity.peer_id, address, "/v1/echo", b"one")
            first = client.last_received()[server_identity.peer_id]
            assert client_identity.peer_id in server.last_received()
            await trio.sleep(0.05)
            before = time.monotonic()
            await client.request(server_identity.peer_id, address, "/v1/echo", b"two")
            second = client.last_received()[server_identity.peer_id]
            assert second >= before > first  # the reply moved it, the quiet time in between did not
            assert server.last_received()[client_identity.peer_id] >= before


async def test_handler_error_status_is_reported(server_identity, client_identity):
    async def handler(stream):
        await stream.respond(404)
        await stream.send_message(b"no such seam")

    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, handler) as server, Transport(client_identity) as client:
            with pytest.raises(TransportError, match="404: no such seam"):
                await client.request(server_identity.peer_id, Address(HOST, server.listen_port), "/x", b"", timeout=5)


async def test_fifty_streams_share_one_connection(server_identity, client_identity):
    results = {}

    async def session(client, address, n):
        async with await client.open_stream(server_identity.peer_id, address, f"/session/{n}") as stream:
            echoed = []
            for step in range(5):
                payload = f"{n}:{step}".encode() * (step + 1)
                await stream.send_message(payload)
                echoed.append(await stream.receive_message() == payload)
            await stream.end()
            assert await stream.receive_message() is None
            results[n] = all(echoed)

    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, echo) as server, Transport(client_identity) as client:
            address = Address(HOST, server.listen_port)
            async with trio.open_nursery() as nursery:
                for n in range(50):
                    nursery.start_soon(session, client, address, n)
            assert results == {n: True for n in range(50)}
            assert client.connection_count == 1
            assert server.inbound_connection_count == 1


async def test_large_message_waits_for_a_slow_reader(server_identity, client_identity):
    window = 256 * 1024
    size = 8 * 1024 * 1024
    payload = os.urandom(size)
    release = trio.Event()
    server_streams = []

    async def slow_handler(stream):
        server_streams.append(stream)
        await release.wait()
        message = await stream.receive_message()
        await stream.send_message(LENGTH_PREFIX.pack(len(message)) + message[-16:])

    with trio.fail_after(TEST_TIMEOUT):
        async with (
            serving(server_identity, slow_handler, stream_window=window) as server,
            Transport(client_identity, stream_window=window) as client,
        ):
            stream = await client.open_stream(server_identity.peer_id, Address(HOST, server.listen_port), "/big")
            sent = trio.Event()

            async def send():
                await stream.send_message(payload)
                sent.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                h2conn = stream._conn._h2
                await wait_until(lambda: server_streams and h2conn.local_flow_control_window(stream.stream_id) == 0)
                # The sender has used up the stream window and waits; the receiver holds at most
                # one window of unread data, not the message.
                assert not sent.is_set()
                await trio.sleep(0.05)
                assert not sent.is_set()
                assert 0 < server_streams[0].buffered_bytes <= window
                release.set()
            reply = await stream.receive_message()
            assert reply == LENGTH_PREFIX.pack(size) + payload[-16:]
            await stream.aclose()


async def test_dialling_the_wrong_identity_fails(server_identity, client_identity, caplog):
    impostor = Identity.generate()
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, echo) as server, Transport(client_identity) as client:
            with pytest.raises(PeerAuthError, match=f"dialled peer {impostor.peer_id}"):
                await client.open_stream(impostor.peer_id, Address(HOST, server.listen_port), "/x")
            assert client.connection_count == 0


async def _raw_client_auth(port, response_for):
    """Do TLS, then answer the challenge with ``response_for(nonce, server_cert_der)``."""
    tcp = await trio.open_tcp_stream(HOST, port)
    stream = trio.SSLStream(tcp, client_context(), server_hostname=None)
    try:
        await stream.do_handshake()
        server_der = stream.getpeercert(binary_form=True)
        nonce = auth.decode_challenge(await receive_exactly(stream, auth.CHALLENGE_BYTES))
        await stream.send_all(response_for(nonce, server_der))
        verdict = await stream.receive_some(1)
        try:
            rest = await stream.receive_some(1)
        except trio.BrokenResourceError:
            rest = b""
        return verdict, rest
    finally:
        await trio.aclose_forcefully(stream)


async def test_forged_client_auth_is_rejected(server_identity, client_identity, caplog):
    caplog.set_level(logging.WARNING, logger="meshd.transport")
    victim = Identity.generate()
    forger = Identity.generate()

    def garbage_signature(nonce, server_der):
        return auth.MAGIC + victim.public_key + forger.sign(b"whatever")

    def relayed(nonce, server_der):
        # A genuine signature, but made for another server's certificate.
        other_der = make_certificate(Identity.generate()).der
        return auth.encode_response(victim, nonce, other_der)

    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, echo) as server, Transport(client_identity) as client:
            for forge in (garbage_signature, relayed):
                verdict, rest = await _raw_client_auth(server.listen_port, forge)
                assert verdict == auth.REJECTED
                assert rest == b""  # and the server closed the connection
            assert server.inbound_connection_count == 0
            rejections = [r for r in caplog.records if "rejected connection" in r.getMessage()]
            assert len(rejections) == 2
            assert all(r.levelno == logging.WARNING for r in rejections)
            assert "signature does not verify" in rejections[0].getMessage()
            # The server keeps serving honest peers.
            reply = await client.request(server_identity.peer_id, Address(HOST, server.listen_port), "/echo", b"ok")
            assert reply == b"ok"


async def test_bad_framing_resets_only_its_stream(server_identity, client_identity):
    handler_errors = []

    async def handler(stream):
        try:
            await echo(stream)
        except FramingError as exc:
            handler_errors.append(type(exc))
            raise

    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, handler) as server, Transport(client_identity) as client:
            address = Address(HOST, server.listen_port)
            good = await client.open_stream(server_identity.peer_id, address, "/good")
            await good.send_message(b"before")
            assert await good.receive_message() == b"before"

            oversized = await client.open_stream(server_identity.peer_id, address, "/oversized")
            await oversized._send_bytes(LENGTH_PREFIX.pack(2**31))
            with pytest.raises(StreamReset) as reset:
                await oversized.receive_message()
            assert reset.value.error_code == ErrorCodes.FRAME_SIZE_ERROR

            truncated = await client.open_stream(server_identity.peer_id, address, "/truncated")
            await truncated._send_bytes(LENGTH_PREFIX.pack(10) + b"abc")
            await truncated.end()
            with pytest.raises(StreamReset) as reset:
                await truncated.receive_message()
            assert reset.value.error_code == ErrorCodes.PROTOCOL_ERROR

            assert handler_errors == [MessageTooLarge, FramingError]
            await good.send_message(b"after")
            assert await good.receive_message() == b"after"
            assert client.connection_count == 1
            await good.aclose()


async def test_local_oversized_send_leaves_stream_usable(server_identity, client_identity):
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            serving(server_identity, echo, max_message_bytes=1024) as server,
            Transport(client_identity, max_message_bytes=1024) as client,
        ):
            stream = await client.open_stream(server_identity.peer_id, Address(HOST, server.listen_port), "/e")
            with pytest.raises(MessageTooLarge):
                await stream.send_message(b"x" * 1025)
            await stream.send_message(b"x" * 1024)
            assert await stream.receive_message() == b"x" * 1024
            await stream.aclose()


async def test_failing_handler_resets_its_stream_only(server_identity, client_identity, caplog):
    async def handler(stream):
        if stream.path == "/boom":
            raise RuntimeError("boom")
        await echo(stream)

    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, handler) as server, Transport(client_identity) as client:
            address = Address(HOST, server.listen_port)
            stream = await client.open_stream(server_identity.peer_id, address, "/boom")
            with pytest.raises(StreamReset) as reset:
                await stream.receive_message()
            assert reset.value.error_code == ErrorCodes.INTERNAL_ERROR
            assert await client.request(server_identity.peer_id, address, "/echo", b"still here") == b"still here"
            assert client.connection_count == 1
            assert any("handler for /boom" in r.getMessage() for r in caplog.records)


async def test_redials_after_the_server_restarts(server_identity, client_identity):
    with trio.fail_after(TEST_TIMEOUT):
        async with Transport(client_identity) as client:
            async with serving(server_identity, echo) as server:
                port = server.listen_port
                address = Address(HOST, port)
                assert await client.request(server_identity.peer_id, address, "/e", b"1") == b"1"
                first = client._outbound[server_identity.peer_id]
            # The server is gone: its end of the connection was closed.
            await wait_until(lambda: not first.is_alive)
            assert client.connection_count == 0
            with pytest.raises(TransportError):
                await client.request(server_identity.peer_id, address, "/e", b"2")
            async with serving(server_identity, echo, port=port):
                assert await client.request(server_identity.peer_id, address, "/e", b"3") == b"3"
                assert client._outbound[server_identity.peer_id] is not first
                assert client.connection_count == 1


async def test_redials_after_the_connection_is_killed(server_identity, client_identity):
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, echo) as server, Transport(client_identity) as client:
            address = Address(HOST, server.listen_port)
            assert await client.request(server_identity.peer_id, address, "/e", b"1") == b"1"
            first = client._outbound[server_identity.peer_id]
            stream = await client.open_stream(server_identity.peer_id, address, "/e")
            await first.aclose()
            with pytest.raises(TransportError):
                await stream.receive_message()
            assert await client.request(server_identity.peer_id, address, "/e", b"2") == b"2"
            assert client._outbound[server_identity.peer_id] is not first
            await wait_until(lambda: server.inbound_connection_count == 1)


# -- streams to this very peer ----------------------------------------------------------------


async def test_a_stream_to_itself_stays_in_memory_with_its_headers(server_identity):
    seen = []

    async def handler(stream):
        seen.append((stream.peer_id, stream.path, dict(stream.headers)))
        await echo(stream)

    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, handler) as server:
            server.stream_headers["meshd-membership"] = "card"
            own = server_identity.peer_id
            stream = await server.open_stream(own, Address(HOST, server.listen_port), "/seam", {"x-kind": "seam"})
            for message in (b"one", b"", b"three" * 1000):
                await stream.send_message(message)
                assert await stream.receive_message() == message
            await stream.end()
            assert await stream.receive_message() is None
            assert await server.request(own, Address(HOST, server.listen_port), "/rpc", b"ask") == b"ask"
            # no connection was dialled or accepted: no TLS, HTTP/2 or socket carried any of it
            assert server.connection_count == server.inbound_connection_count == 0
    assert seen == [(own, "/seam", {"meshd-membership": "card", "x-kind": "seam"}),
                    (own, "/rpc", {"meshd-membership": "card"})]


async def test_a_stream_to_itself_keeps_the_limits_and_failures_of_a_real_one(server_identity, caplog):
    async def handler(stream):
        if stream.path == "/boom":
            raise RuntimeError("boom")
        if stream.path == "/quiet":
            return  # a handler that returns without answering ends its side
        await echo(stream)

    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, handler, max_message_bytes=1024) as server:
            own, address = server_identity.peer_id, Address(HOST, server.listen_port)
            stream = await server.open_stream(own, address, "/e")
            with pytest.raises(MessageTooLarge):
                await stream.send_message(b"x" * 1025)
            await stream.send_message(b"x" * 1024)
            assert await stream.receive_message() == b"x" * 1024
            await stream.aclose()

            boom = await server.open_stream(own, address, "/boom")
            with pytest.raises(StreamReset) as reset:
                await boom.receive_message()
            assert reset.value.error_code == ErrorCodes.INTERNAL_ERROR
            assert any("handler for own stream /boom failed" in r.getMessage() for r in caplog.records)

            quiet = await server.open_stream(own, address, "/quiet")
            assert await quiet.receive_message() is None
            assert await server.request(own, address, "/echo", b"still here") == b"still here"


async def test_a_stream_to_itself_breaks_when_the_peer_stops_serving(server_identity):
    serving_scope = trio.CancelScope()

    async def serve(task_status=trio.TASK_STATUS_IGNORED):
        with serving_scope:
            await transport.serve(Address(HOST, 0), echo, task_status=task_status)

    async def stop_serving_once_all_wait():
        await trio.testing.wait_all_tasks_blocked()  # the reader below is waiting for its echo
        serving_scope.cancel()

    with trio.fail_after(TEST_TIMEOUT):
        async with Transport(server_identity) as transport, trio.open_nursery() as nursery:
            await nursery.start(serve)
            address = Address(HOST, transport.listen_port)
            stream = await transport.open_stream(server_identity.peer_id, address, "/e")
            await stream.send_message(b"before")
            assert await stream.receive_message() == b"before"
            nursery.start_soon(stop_serving_once_all_wait)
            with pytest.raises(StreamReset):  # not left waiting for a handler that is gone
                await stream.receive_message()
            # no longer serving: a stream to itself is dialled as to anyone (and nobody answers now)
            with pytest.raises(TransportError):
                await transport.open_stream(server_identity.peer_id, address, "/e")


async def test_a_stream_to_itself_holds_at_most_a_window_of_unread_messages(server_identity):
    """As on a connection, a sender waits while its reader holds a stream window unread; a message
    larger than the window still goes once nothing is unread."""
    window = 64 * 1024
    release = trio.Event()
    streams = []

    async def slow_reader(stream):
        streams.append(stream)
        await release.wait()
        got = [message async for message in stream]
        await stream.send_message(LENGTH_PREFIX.pack(sum(map(len, got))))

    sent = []

    async def send_all(stream, messages):
        for message in messages:
            await stream.send_message(message)
            sent.append(len(message))
        await stream.end()

    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, slow_reader, stream_window=window) as server:
            stream = await server.open_stream(server_identity.peer_id, Address(HOST, server.listen_port), "/slow")
            messages = [b"a" * 20_000] * 10 + [b"b" * (3 * window)]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all, stream, messages)
                await trio.testing.wait_all_tasks_blocked()
                assert sent == [20_000] * 3  # a fourth would pass the window: the sender waits
                assert streams[0]._unread == 60_000
                release.set()
            assert sent == [len(m) for m in messages]
            assert await stream.receive_message() == LENGTH_PREFIX.pack(sum(sent))


async def test_a_sender_waiting_for_window_is_released_when_the_stream_breaks(server_identity):
    window = 64 * 1024
    stop_reading = trio.Event()

    async def never_reads(stream):
        await stop_reading.wait()
        await stream.reset()

    with trio.fail_after(TEST_TIMEOUT):
        async with serving(server_identity, never_reads, stream_window=window) as server:
            address = Address(HOST, server.listen_port)
            stream = await server.open_stream(server_identity.peer_id, address, "/stuck")
            await stream.send_message(b"x" * window)

            async def reset_once_it_waits():
                await trio.testing.wait_all_tasks_blocked()
                await stream.reset()  # this end gives up: its own waiting send fails

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reset_once_it_waits)
                with pytest.raises(StreamReset):
                    await stream.send_message(b"y")

            other = await server.open_stream(server_identity.peer_id, address, "/stuck")
            await other.send_message(b"x" * window)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(other.send_message, b"y")
                await trio.testing.wait_all_tasks_blocked()
                stop_reading.set()  # the reader resets: the waiting send is let go, and goes nowhere
            with pytest.raises(StreamReset):
                await other.receive_message()
