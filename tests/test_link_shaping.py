"""Shaped links: the sans-IO link model, its Trio adapter, profile parsing, the calibration, a shaped
transport, and a mesh of shaped peers that still answers.

Timing assertions on real sockets only bound from below by the setting and from above by the
setting plus a wide margin, so that a loaded machine cannot make them fail.
"""

from __future__ import annotations

import random
import time
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from meshd.address import Address
from meshd.identity import Identity
from meshd.links.calibrate import measure_link
from meshd.links.profiles import PROFILES, LinkShape, LinkShapeError, parse_link_shape, parse_link_shapes
from meshd.links.shaper import MIN_BACKLOG_BYTES, SEGMENT_BYTES, Shaper
from meshd.links.stream import ShapedStream
from meshd.transport import Transport

MS = 1e-3
SLACK_MS = 50.0  # what a loaded machine may add to a delay on real sockets


# -- profiles ---------------------------------------------------------------------------------


def test_the_named_profiles_have_their_documented_shapes():
    assert PROFILES["lan"].spec == "0.5ms/1Gbit"
    assert PROFILES["wifi"].spec == "3ms±2ms/200Mbit" and PROFILES["wifi"].jitter == "uniform"
    assert PROFILES["wan"].spec == "20ms/50Mbit"
    assert parse_link_shape("WAN") is PROFILES["wan"]


@pytest.mark.parametrize(("text", "delay_ms", "jitter_ms", "jitter", "rate_bit_s"), [
    ("10ms/100Mbit", 10, 0, "uniform", 100e6),
    ("3ms±2ms/200Mbit", 3, 2, "uniform", 200e6),
    ("3ms+-2ms/200M", 3, 2, "uniform", 200e6),
    ("10ms~3ms/1Gbit/s", 10, 3, "normal", 1e9),
    ("500us/2.5Gbps", 0.5, 0, "uniform", 2.5e9),
    ("0.25s/800kbit", 250, 0, "uniform", 800e3),
    ("0ms/1000", 0, 0, "uniform", 1000),
])
def test_explicit_shapes_parse_to_delay_jitter_and_rate(text, delay_ms, jitter_ms, jitter, rate_bit_s):
    shape = parse_link_shape(text)
    assert shape.delay_s == pytest.approx(delay_ms * MS)
    assert shape.jitter_s == pytest.approx(jitter_ms * MS)
    assert shape.jitter == jitter
    assert shape.rate_bit_s == pytest.approx(rate_bit_s)
    assert shape.label == text
    again = parse_link_shape(shape.spec)  # the canonical text reads back as the same link
    assert (again.delay_s, again.jitter_s, again.jitter, again.rate_bit_s) == pytest.approx(
        (shape.delay_s, shape.jitter_s, shape.jitter, shape.rate_bit_s))


@pytest.mark.parametrize(("text", "says"), [
    ("satellite", "neither a profile"),
    ("10/100Mbit", "needs a unit"),
    ("10 parsecs/100Mbit", "not a duration"),
    ("10ms/fast", "not a rate"),
    ("10ms/100MB", "bits per second"),
    ("10ms/0Mbit", "more than 0"),
    ("2ms±3ms/100Mbit", "exceeds the delay"),
    ("3ms±1ms~1ms/100Mbit", "more than one jitter"),
    ("", "neither a profile"),
])
def test_bad_shapes_are_refused_with_what_is_wrong(text, says):
    with pytest.raises(LinkShapeError, match=says):
        parse_link_shape(text)


def test_a_list_of_shapes_keeps_its_order_and_drops_repeats():
    assert [s.label for s in parse_link_shapes("wan, lan,wan,10ms/1Gbit")] == ["wan", "lan", "10ms/1Gbit"]
    with pytest.raises(LinkShapeError):
        parse_link_shapes(" , ")


def test_the_peer_setting_refuses_a_bad_shape_and_keeps_a_good_one():
    from meshd.daemon.config import load_config

    assert load_config(None, {"link_shape": "wifi"}).link_shape == "wifi"
    assert load_config(None, {}).link_shape == ""
    with pytest.raises(ValueError, match="not a rate"):
        load_config(None, {"link_shape": "10ms/quick"})


# -- the link model (sans-IO) -----------------------------------------------------------------

FAST = 8e12  # bit/s: serialization too short to matter


def test_a_chunk_is_released_one_delay_after_it_is_serialized():
    shaper = Shaper(LinkShape(delay_s=0.010, rate_bit_s=8e6))  # 1 MB/s
    release = shaper.send(b"x" * 1000, now=5.0)
    assert release == pytest.approx(5.0 + 0.001 + 0.010)
    assert shaper.next_release() == release
    assert shaper.take_due(release - 1e-6) == b""
    assert shaper.take_due(release) == b"x" * 1000
    assert shaper.next_release() is None and shaper.queued_bytes == 0


def test_the_rate_serializes_chunks_one_after_another():
    shaper = Shaper(LinkShape(delay_s=0.002, rate_bit_s=8e6), segment_bytes=10_000)
    first = shaper.send(b"a" * 10_000, now=0.0)
    second = shaper.send(b"b" * 10_000, now=0.0)  # sent together: waits for the link
    assert first == pytest.approx(0.010 + 0.002)
    assert second - first == pytest.approx(0.010)
    later = shaper.send(b"c" * 1000, now=1.0)  # the link is idle again: no wait
    assert later == pytest.approx(1.0 + 0.001 + 0.002)


def test_a_large_write_streams_out_in_segments_at_the_rate():
    shaper = Shaper(LinkShape(delay_s=0.0, rate_bit_s=8e6), backlog_bytes=10**7)
    data = random.Random(1).randbytes(5 * SEGMENT_BYTES)
    shaper.send(data, now=0.0)
    out = b""
    times = []
    while (due := shaper.next_release()) is not None:
        times.append(due)
        out += shaper.take_due(due)
    assert out == data
    assert len(times) == 5
    assert times[0] == pytest.approx(SEGMENT_BYTES / 1e6)  # the first segment arrives before the rest is sent
    assert times[-1] == pytest.approx(5 * SEGMENT_BYTES / 1e6)


@pytest.mark.parametrize("jitter", ["uniform", "normal"])
def test_jitter_varies_the_delay_but_never_reorders_bytes(jitter):
    shape = LinkShape(delay_s=0.005, jitter_s=0.004, jitter=jitter, rate_bit_s=FAST)
    shaper = Shaper(shape, seed=7)
    sent = [i.to_bytes(4, "big") for i in range(2000)]
    releases = [shaper.send(chunk, now=i * 0.0001) for i, chunk in enumerate(sent)]
    assert releases == sorted(releases)
    gaps = [r - i * 0.0001 for i, r in enumerate(releases)]
    assert min(gaps) >= (0.001 - 1e-9 if jitter == "uniform" else 0.0)
    assert max(gaps) > min(gaps) + 0.002  # the jitter is really there
    assert shaper.take_due(releases[-1]) == b"".join(sent)


def test_jitter_is_seeded():
    shape = PROFILES["wifi"]

    def releases(seed: int) -> list[float]:
        shaper = Shaper(shape, seed=seed)
        return [shaper.send(b"x", now=i * 0.01) for i in range(50)]

    assert releases(3) == releases(3)
    assert releases(3) != releases(4)


def test_the_backlog_bounds_what_a_sender_may_queue():
    shaper = Shaper(LinkShape(delay_s=0.050, rate_bit_s=8e6), backlog_bytes=100_000)  # 1 MB/s
    assert shaper.room(0.0) == 100_000
    shaper.send(b"x" * 100_000, now=0.0)
    assert shaper.room(0.0) == 0
    assert shaper.room(0.05) == pytest.approx(50_000, abs=1)  # half of it serialized by now
    # room for 20 kB once 20 kB has gone out; bytes in their delay do not count against it
    assert shaper.ready_at(20_000) == pytest.approx(0.02)
    assert shaper.room(0.1) == 100_000
    assert shaper.queued_bytes == 100_000  # none of it has arrived yet (50 ms delay after 100 ms serializing)


def test_the_default_backlog_is_ten_milliseconds_of_the_link_and_at_least_256_kib():
    assert Shaper(PROFILES["wan"]).backlog_bytes == MIN_BACKLOG_BYTES
    assert Shaper(PROFILES["lan"]).backlog_bytes == 1_250_000


def test_dropping_forgets_what_is_queued():
    shaper = Shaper(PROFILES["wan"])
    shaper.send(b"x" * 1000, now=0.0)
    assert shaper.drop() == 1000
    assert shaper.next_release() is None and shaper.take_due(10.0) == b""


# -- the Trio adapter, on a fake clock ----------------------------------------------------------


async def _read_all(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
    while chunk := await stream.receive_some(65536):
        into += chunk


@asynccontextmanager
async def shaped_pair(shape: LinkShape, **options):
    """A ``ShapedStream`` over an in-memory stream, the far end's bytes collected in ``received``."""
    near, far = trio.testing.memory_stream_pair()
    received = bytearray()
    async with trio.open_nursery() as nursery:
        link = ShapedStream(near, shape, nursery, spin_s=0.0, **options)
        nursery.start_soon(_read_all, far, received)
        yield link, received
        nursery.cancel_scope.cancel()


async def test_send_all_waits_while_the_backlog_is_full(autojump_clock):
    shape = LinkShape(delay_s=0.010, rate_bit_s=8e6)  # 1 MB/s: 1 MiB takes about a second
    data = random.Random(2).randbytes(1024 * 1024)
    async with shaped_pair(shape) as (link, received):
        done = trio.Event()

        async def send() -> None:
            await link.send_all(data)
            done.set()

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await trio.sleep(0.001)
            assert not done.is_set()
            assert link.shaper.backlog(trio.current_time()) <= link.shaper.backlog_bytes
            assert link.shaper.queued_bytes <= link.shaper.backlog_bytes + SEGMENT_BYTES
        # send_all returned once the last byte was accepted: everything but the backlog had gone out
        assert trio.current_time() - started >= (len(data) - link.shaper.backlog_bytes) / 1e6 - 0.01
        while len(received) < len(data):
            await trio.sleep(0.01)
        assert bytes(received) == data
        assert trio.current_time() - started >= len(data) / 1e6 + 0.010


async def test_a_cancelled_send_leaves_a_prefix_and_later_bytes_follow_it_in_order(autojump_clock):
    shape = LinkShape(delay_s=0.005, jitter_s=0.005, rate_bit_s=8e6)
    data = random.Random(3).randbytes(2 * 1024 * 1024)
    async with shaped_pair(shape, seed=5) as (link, received):
        with trio.move_on_after(0.3):
            await link.send_all(data)
        await link.send_all(b"--after--")
        while not received.endswith(b"--after--"):
            await trio.sleep(0.01)
        sent = len(received) - len(b"--after--")
        assert 0 < sent < len(data)
        assert bytes(received[:sent]) == data[:sent]


async def test_closing_flushes_what_is_queued(autojump_clock):
    near, far = trio.testing.memory_stream_pair()
    received = bytearray()
    data = random.Random(4).randbytes(200_000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_read_all, far, received)
        link = ShapedStream(near, LinkShape(delay_s=0.020, rate_bit_s=8e6), nursery, spin_s=0.0)
        await link.send_all(data)
        await link.aclose()
    assert bytes(received) == data  # and then the far end saw the stream end
    with pytest.raises(trio.ClosedResourceError):
        await link.send_all(b"more")


async def test_a_forced_close_drops_the_queue_at_once(autojump_clock):
    near, far = trio.testing.memory_stream_pair()
    received = bytearray()
    data = random.Random(5).randbytes(200_000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_read_all, far, received)
        link = ShapedStream(near, LinkShape(delay_s=1.0, rate_bit_s=8e6), nursery, spin_s=0.0)
        await link.send_all(data)
        started = trio.current_time()
        await trio.aclose_forcefully(link)
        assert trio.current_time() == started
    assert bytes(received) == b""  # nothing was due yet


async def test_a_broken_inner_stream_fails_later_sends_and_not_the_nursery(autojump_clock):
    near, _far = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        link = ShapedStream(near, PROFILES["wan"], nursery, spin_s=0.0)
        await near.send_stream.aclose()  # the socket underneath goes away
        await link.send_all(b"lost")
        await trio.sleep(0.1)
        with pytest.raises(trio.BrokenResourceError):
            await link.send_all(b"more")
        await link.aclose()


async def test_after_stop_shaping_bytes_go_straight_through_behind_those_queued(autojump_clock):
    async with shaped_pair(LinkShape(delay_s=1.0, rate_bit_s=8e6)) as (link, received):
        await link.send_all(b"shaped ")
        link.stop_shaping()
        started = trio.current_time()
        await link.send_all(b"then direct")  # waits for the queued bytes: order is kept
        assert trio.current_time() - started >= 0.99
        while not received.endswith(b"direct"):
            await trio.sleep(0.001)
        assert bytes(received) == b"shaped then direct"
        started = trio.current_time()
        await link.send_all(b"!")
        assert trio.current_time() == started


# -- real loopback sockets --------------------------------------------------------------------


async def test_a_shaped_loopback_connection_delivers_the_set_delay_and_rate():
    shape = LinkShape(delay_s=0.020, rate_bit_s=100e6)
    got = (await measure_link(shape, probes=20, bulk_s=0.2)).as_json()
    assert got["set_delay_ms"] == 20 and got["set_rate_mbit"] == 100
    assert 20 <= got["measured_delay_ms_p5"] <= got["measured_delay_ms_p50"] <= 20 + SLACK_MS
    assert got["measured_delay_ms_p95"] <= 20 + SLACK_MS
    assert 25 <= got["measured_rate_mbit"] <= 120  # never faster than set; slower only on a very busy machine


async def test_jitter_on_loopback_stays_within_its_bounds_from_below():
    shape = PROFILES["wifi"]
    measured = await measure_link(shape, probes=30, bulk_s=0.05)
    assert min(measured.delays_s) >= shape.delay_s - shape.jitter_s
    assert measured.delay_ms(0.5) <= 3 + SLACK_MS
    assert measured.jitter_ms > 0


@asynccontextmanager
async def shaped_transports(shape: LinkShape):
    async def echo(stream):
        async for message in stream:
            await stream.send_message(message)

    async with Transport(Identity.generate(), link_shape=shape) as server, \
            Transport(Identity.generate(), link_shape=shape) as client, trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, Address("127.0.0.1", 0), echo)
        yield client, server, f"127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


async def test_a_shaped_transport_delays_both_directions_of_a_connection():
    shape = LinkShape(delay_s=0.015, rate_bit_s=1e9)
    with trio.fail_after(20):
        async with shaped_transports(shape) as (client, server, address):
            await client.request(server.identity.peer_id, address, "/echo", b"warm-up")
            round_trips = []
            for _ in range(5):
                started = time.perf_counter()
                assert await client.request(server.identity.peer_id, address, "/echo", b"ping" * 100) == b"ping" * 100
                round_trips.append(time.perf_counter() - started)
            # the request crosses the client's shaper, the reply the server's
            assert 2 * shape.delay_s <= min(round_trips) <= 2 * shape.delay_s + 2 * SLACK_MS * MS


async def test_a_peer_connecting_to_itself_is_not_shaped():
    """An entry that is also its route's head talks to itself through its transport, in memory; no link
    is crossed."""
    shape = LinkShape(delay_s=0.5, rate_bit_s=1e9)
    with trio.fail_after(30):
        async with shaped_transports(shape) as (_client, server, address):
            started = time.perf_counter()
            assert await server.request(server.identity.peer_id, address, "/echo", b"ping") == b"ping"
            assert time.perf_counter() - started < shape.delay_s  # shaped, one way alone would take that


# -- a mesh of shaped peers -------------------------------------------------------------------


@pytest.mark.slow
def test_peers_on_a_shaped_link_still_answer_token_identical(tiny_model, tmp_path):
    from openai import OpenAI

    from meshd.daemon.local_mesh import LocalMesh
    from tests.helpers import chat_reference

    question, tokens = "How far away are you?", 12
    expected = chat_reference(tiny_model, question, tokens)
    with LocalMesh(tmp_path / "shaped", link_shape="10ms/100Mbit") as mesh:
        head, tail = mesh.start_peers([dict(model=tiny_model, layers=(0, 2)), dict(model=tiny_model, layers=(2, 4))])
        mesh.wait_covered("tiny", timeout=60)
        assert head.get("/status")["link_shape"] == tail.get("/status")["link_shape"] == "10ms/100Mbit"
        client = OpenAI(base_url=f"http://{head.api}/v1", api_key="unused", timeout=60, max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                               temperature=0, max_tokens=tokens, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == expected
        seam = tail.get("/stats")["seam_ms"]  # head -> tail hidden states, timed by the tail
        assert seam["count"] > 0 and 10 <= seam["p50"] <= 10 + SLACK_MS
