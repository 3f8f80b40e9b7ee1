"""Real daemons on loopback, each its own process: convergence, parity through the OpenAI API,
peers without layers, hostile input on every surface, and tracker failover."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest
import trio
from openai import OpenAI

from meshd.cards import sign_card
from meshd.daemon.local_mesh import LocalMesh, budgets_for_split
from meshd.identity import Identity, peer_id_from_public_key
from meshd.rpc import RPC_PATH
from meshd.rpc import call as rpc_call
from meshd.session.messages import SEAM_PATH
from meshd.transport import PeerAuthError, Transport
from meshd.wire import card_pb2 as cpb
from meshd.wire import rpc_pb2 as rpb
from tests.helpers import chat_reference, join_mesh

pytestmark = pytest.mark.slow

N_TOKENS = 24
QUESTION = "Which layers do you hold?"


def meshctl(peer, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", *args, "--control", peer.control],
                          capture_output=True, text=True, timeout=60, check=False)


def client(peer) -> OpenAI:
    return OpenAI(base_url=f"http://{peer.api}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    with LocalMesh(tmp_path_factory.mktemp("mesh")) as m:
        m.start_peers([dict(model=tiny_model, memory_budget=b) for b in budgets_for_split(tiny_model, 3)])
        m.wait_covered("tiny", timeout=60)
        yield m


@pytest.fixture(scope="module")
def reference(tiny_model):
    return chat_reference(tiny_model, QUESTION, N_TOKENS)


def chat(peer, stream: bool) -> tuple[str, object]:
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": QUESTION}], temperature=0,
                  max_tokens=N_TOKENS, extra_body={"ignore_eos": True})
    if not stream:
        reply = client(peer).chat.completions.create(**kwargs)
        return reply.choices[0].message.content, reply.usage
    text, usage = "", None
    for chunk in client(peer).chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                      **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    return text, usage


def test_three_daemons_converge_with_one_tracker(mesh):
    views = []
    for peer in mesh.peers[:3]:
        run = meshctl(peer, "peers", "--json")
        assert run.returncode == 0, run.stderr
        views.append(json.loads(run.stdout))
    ids = {p.peer_id for p in mesh.peers[:3]}
    for view in views:
        assert {row["peer_id"] for row in view} >= ids
        trackers = [row["peer_id"] for row in view if row["tracker"]]
        assert len(trackers) == 1
    assert len({tuple(row["peer_id"] for row in v if row["tracker"]) for v in views}) == 1
    ranges = sorted((m["start"], m["end"]) for row in views[0] for m in row["models"])
    assert ranges == [(0, 2), (2, 3), (3, 4)], "the tracker placed three ranges that tile the model"
    table = meshctl(mesh.peers[0], "peers")
    assert "tracker" in table.stdout and "tiny[0,2)" in table.stdout


def test_every_peer_answers_token_identical(mesh, reference, tiny_model):
    if len(mesh.peers) == 3:
        laptop = mesh.start_peer()  # holds no layers at all
        mesh.wait_covered("tiny", timeout=60)
        assert laptop.get("/status")["range"] is None
    for peer in mesh.peers:
        for stream in (False, True):
            text, usage = chat(peer, stream)
            assert text == reference, f"peer{peer.index} stream={stream}"
            assert usage.completion_tokens == N_TOKENS
    models = client(mesh.peers[3]).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_route_and_status_commands(mesh):
    run = meshctl(mesh.peers[1], "route", "tiny", "--json")
    assert run.returncode == 0, run.stderr
    route = json.loads(run.stdout)
    assert [(h["start"], h["end"]) for h in route["hops"]] == [(0, 2), (2, 3), (3, 4)]
    assert all({"compute_ms", "seam_ms", "hop_ms"} <= set(h) for h in route["hops"])
    status = json.loads(meshctl(mesh.peers[1], "status", "--json").stdout)
    assert status["models_covered"] == ["tiny"] and status["tracker"]


def test_api_bad_input_gets_openai_errors_and_the_daemon_keeps_serving(mesh, reference):
    base = f"http://{mesh.peers[0].api}/v1"
    cases = [
        (b"{not json", 400),
        (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(), 404),
        (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}).encode(),
         400),
        (json.dumps({"model": "tiny", "messages": "hello"}).encode(), 400),
        (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": 7}]}).encode(), 400),
        (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"})
         .encode(), 400),
    ]
    for body, status in cases:
        resp = httpx.post(f"{base}/chat/completions", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == status, body
        error = resp.json()["error"]
        assert error["message"] and "type" in error
    assert chat(mesh.peers[0], stream=False)[0] == reference


async def gossip(transport: Transport, target, message: cpb.GossipMessage) -> None:
    reply = await rpc_call(transport, target.peer_id, target.listen, rpb.PeerRequest(gossip=message), timeout=10)
    assert reply.WhichOneof("body") == "accepted"


async def test_forged_replayed_expired_and_mismatched_cards_are_rejected(mesh):
    target = mesh.peers[0]
    before = {(r["peer_id"], r["sequence"]) for r in target.get("/peers")["peers"]}
    rejected_before = target.get("/status")["rejected_cards"]
    key = Identity.generate()
    me = peer_id_from_public_key(key.public_key)
    now = int(time.time() * 1000)

    membership = None

    def card(sequence: int, expires: int, peer_id: str = me) -> cpb.SignedCard:
        c = cpb.CapabilityCard(peer_id=peer_id, public_key=key.public_key, sequence=sequence,
                               issued_at_ms=min(now, expires - 60_000), expires_at_ms=expires,
                               addresses=["127.0.0.1:9"], membership=membership)
        return sign_card(c, key)

    async with Transport(key) as transport:
        membership = await join_mesh(transport, target)  # a member may gossip: what it says is still checked
        bad_signature = card(7, now + 60_000)
        bad_signature.signature = bytes(64)
        forged = [bad_signature, card(3, now - 1000), card(9, now + 60_000, peer_id=mesh.peers[1].peer_id)]
        for signed in forged:
            await gossip(transport, target, cpb.GossipMessage(cards=[signed]))
        after_forged = {r["peer_id"]: r["sequence"] for r in target.get("/peers")["peers"]}
        assert me not in after_forged
        # every real card is still there, at its own sequence or a newer one it issued meanwhile
        for peer_id, sequence in before:
            assert after_forged.get(peer_id, -1) >= sequence, (peer_id, sequence, after_forged)
        # a good card, then an older one: the replay is refused, the newer card stays
        for signed in (card(5, now + 60_000), card(4, now + 60_000)):
            await gossip(transport, target, cpb.GossipMessage(cards=[signed]))
    rows = {r["peer_id"]: r["sequence"] for r in target.get("/peers")["peers"]}
    assert rows.get(me) == 5
    rejected = target.get("/status")["rejected_cards"]
    for reason in ("bad_signature", "expired", "key_mismatch", "replayed"):
        assert rejected.get(reason, 0) > rejected_before.get(reason, 0), reason
    log = target.log_path.read_text()
    assert "rejected (bad_signature)" in log and "rejected (key_mismatch)" in log and "rejected (expired)" in log


async def test_tls_peer_claiming_another_identity_is_refused(mesh):
    async with Transport(Identity.generate()) as transport:
        with pytest.raises(PeerAuthError):
            await transport.request(mesh.peers[1].peer_id, mesh.peers[0].listen, RPC_PATH, b"")


async def test_malformed_and_oversized_seam_frames_reset_only_their_stream(mesh, reference):
    middle = mesh.peers[1]
    results: dict[str, str] = {}

    def long_generation() -> None:
        results["text"] = chat(middle, stream=True)[0]

    worker = threading.Thread(target=long_generation)
    worker.start()
    async with Transport(Identity.generate()) as transport:
        await join_mesh(transport, mesh.peers[0])  # a member: outsiders' seams are refused before any frame
        address = middle.listen
        garbage = await transport.open_stream(middle.peer_id, address, SEAM_PATH)
        await garbage.send_message(b"\xff\x00 definitely not a seam message")
        with trio.fail_after(10):
            reply = await garbage.receive_message()
        assert reply is not None and b"bad_bundle" in reply
        oversized = await transport.open_stream(middle.peer_id, address, SEAM_PATH)
        await oversized._send_bytes(struct.pack(">I", 0xFFFF_FFF0) + b"x" * 16)
        with trio.fail_after(10), pytest.raises(Exception):  # noqa: B017 - reset surfaces as a transport error
            await oversized.receive_message()
    await trio.to_thread.run_sync(worker.join, 60)
    assert results.get("text") == reference
    assert chat(middle, stream=False)[0] == reference


def test_tracker_failover_elects_a_new_tracker_everywhere(tiny_model, tmp_path, reference):
    budget = budgets_for_split(tiny_model, 2)[0]
    with LocalMesh(tmp_path / "failover") as m:
        m.start_peers([dict(model=tiny_model, memory_budget=budget) for _ in range(4)])
        m.wait_covered("tiny", timeout=60)
        m.wait_until(lambda: len({p.get("/status")["tracker"] for p in m.peers}) == 1, 30, "one tracker")
        tracker_id = m.peers[0].get("/status")["tracker"]
        tracker = next(p for p in m.peers if p.peer_id == tracker_id)
        lease = tracker.get("/status")["lease_duration_s"]
        bound = tracker.get("/status")["takeover_bound_s"]
        assert bound <= 2 * lease
        m.kill(tracker, signal.SIGKILL)
        killed_at = time.monotonic()
        survivors = [p for p in m.peers if p is not tracker]

        def new_tracker() -> bool:
            seen = {p.get("/status", timeout=10)["tracker"] for p in survivors}
            return len(seen) == 1 and None not in seen and tracker_id not in seen

        # the bound itself is proven on a fake clock (tests/test_election.py); here, real processes
        # agree on a new tracker, and the time it took is reported
        m.wait_until(new_tracker, bound + 30, "a new tracker", interval=0.1)
        elapsed = time.monotonic() - killed_at
        print(f"new tracker agreed by every survivor {elapsed:.2f}s after SIGKILL (documented bound {bound:.1f}s)")
        m.wait_covered("tiny", timeout=30)
        for peer in survivors:
            assert chat(peer, stream=False)[0] == reference


def test_daemons_stop_cleanly_on_sigterm(tiny_model, tmp_path):
    with LocalMesh(tmp_path / "stop") as m:
        m.start_peers([dict(model=tiny_model, layers=(0, 4))])
        m.stop(grace=30)
    assert all(p.process.returncode == 0 for p in m.peers)  # exited by itself: a SIGKILL would read -9
    assert (m.peers[0].data_dir / "identity.key").stat().st_mode & 0o777 == 0o600
    assert Path(m.peers[0].data_dir / "identity.key").is_file()


def test_partial_coverage_answers_503_with_the_missing_ranges(tiny_model, tmp_path):
    with LocalMesh(tmp_path / "partial") as m:
        (peer,) = m.start_peers([dict(model=tiny_model, layers=(0, 2))])
        # the card offers a loaded range once its speeds are measured, which /status's range does not wait for
        m.wait_until(lambda: [(h["start"], h["end"]) for model in peer.get("/models")["models"]
                              for h in model["holders"]] == [(0, 2)], 30, "layers [0, 2) offered")
        resp = httpx.post(f"http://{peer.api}/v1/chat/completions",
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 503
        assert "[2, 4)" in resp.json()["error"]["message"]
        assert int(resp.headers["retry-after"]) >= 1
        assert httpx.get(f"http://{peer.api}/v1/models").json()["data"] == []
        run = meshctl(peer, "route", "tiny")
        assert run.returncode == 1 and "[2, 4)" in run.stderr


def test_compressed_prefill_bundles_give_the_same_tokens(tiny_model, tmp_path):
    """Two peers told to compress every large bundle: the prefill crosses the seam compressed (the
    tiny model's hidden states are 256 bytes a token, so a 400-token chunk is over the threshold),
    and the answer is token for token the single-process one."""
    question = "Tell me about layers. " * 18
    expected = chat_reference(tiny_model, question, 8)
    extra = ["--compression", "always", "--chunk-tokens", "512"]
    with LocalMesh(tmp_path / "zstd") as m:
        head, tail = m.start_peers([dict(model=tiny_model, layers=(0, 2), extra=extra),
                                    dict(model=tiny_model, layers=(2, 4), extra=extra)])
        m.wait_covered("tiny", timeout=60)
        reply = client(head).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=8,
            extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens >= 300
        assert reply.choices[0].message.content == expected
        stats = head.get("/stats")
        assert stats["compressed_bundles"] >= 1 and stats["compression_saved_bytes"] > 0
        assert tail.get("/stats")["compressed_bundles"] == 0  # the tail sends tokens only


def scrape(peer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(timeout=10) as http:
        reply = http.get(f"http://{peer.status['metrics']}/metrics")
    assert reply.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_the_metrics_endpoint_moves_during_a_generation(mesh):
    entry = mesh.peers[0]
    assert entry.status["metrics"].startswith("127.0.0.1:"), "metrics bind loopback unless configured"
    before = [scrape(p) for p in mesh.peers[:3]]
    assert total(before[0], "meshd_live_cards") >= 3 and total(before[0], "meshd_kv_budget_bytes") > 0
    assert total(before[0], "meshd_election_term") >= 1
    assert sum(total(b, "meshd_is_tracker") for b in before) == 1
    during = None
    long = 600  # tokens: seconds of generation, so that the scrape in the middle finds it running
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": QUESTION}], temperature=0,
                  max_tokens=long, extra_body={"ignore_eos": True}, stream=True)
    for index, _chunk in enumerate(client(entry).chat.completions.create(**kwargs)):
        if index == 8:
            during = scrape(entry)
    finished = total(before[0], "meshd_requests_total", model="tiny", outcome="finished") + 1

    def settled() -> bool:  # the reply's last chunk can reach the client before the entry has counted it
        now = scrape(entry)
        return total(now, "meshd_requests_total", model="tiny", outcome="finished") == finished and \
            total(now, "meshd_entry_sessions") == 0

    mesh.wait_until(settled, timeout=30, what="the entry to count the finished request")
    after = [scrape(p) for p in mesh.peers[:3]]
    assert during is not None
    assert total(during, "meshd_entry_sessions") == 1, "the running generation is visible while it runs"
    tokens = [total(x, "meshd_tokens_generated_total", model="tiny") for x in (before[0], during, after[0])]
    assert tokens[0] < tokens[1] < tokens[2] == tokens[0] + long, tokens
    assert total(after[0], "meshd_time_to_first_token_seconds_count", model="tiny") == \
        total(before[0], "meshd_time_to_first_token_seconds_count", model="tiny") + 1
    seams = [total(a, "meshd_seam_latency_seconds_count") - total(b, "meshd_seam_latency_seconds_count")
             for a, b in zip(after, before, strict=True)]
    # every decode step crosses every hop's seam; a step brings one token, or more when the entry's
    # guesses (n-gram lookup, on by default) are accepted: at most 1 + max_draft_tokens (8)
    assert seams[0] == seams[1] == seams[2], seams
    assert (long - 1) / 9 <= seams[0] <= long - 1, seams
    batches = [total(a, "meshd_decode_batches_total") - total(b, "meshd_decode_batches_total")
               for a, b in zip(after, before, strict=True)]
    assert all(n >= seams[0] for n in batches), batches
    assert total(after[0], "meshd_gossip_messages_total", direction="sent") > \
        total(before[0], "meshd_gossip_messages_total", direction="sent")


def _schema(name: str) -> dict:
    return json.loads((Path(__file__).parents[1] / "meshd" / "cli" / "schemas" / f"{name}.json").read_text())


def test_every_meshctl_command_answers_and_its_json_matches_its_schema(mesh):
    import jsonschema

    entry = mesh.peers[0]
    commands = {"peers": ["peers"], "status": ["status"], "models": ["models"], "route": ["route", "tiny"],
                "sessions": ["sessions"], "logs": ["logs", "-n", "50"]}
    for name, argv in commands.items():
        human = meshctl(entry, *argv)
        assert human.returncode == 0, (name, human.stderr)
        run = meshctl(entry, *argv, "--json")
        assert run.returncode == 0, (name, run.stderr)
        jsonschema.validate(json.loads(run.stdout), _schema(name))
    models = json.loads(meshctl(entry, "models", "--json").stdout)
    tiny = next(m for m in models if m["model"] == "tiny")
    assert tiny["covered"] and tiny["missing"] == []
    held = sorted((h["start"], h["end"]) for h in tiny["holders"] if h["start"] is not None)
    assert held[0][0] == 0 and held[-1][1] == tiny["n_layers"]
    assert "layers 0..4: [" in meshctl(entry, "models").stdout

    # a generation in flight shows on the entry and on every hop of its route; once the client goes
    # away it is gone everywhere, and each peer's records of it can be followed by its id
    seen: dict[str, list] = {}
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"http://{entry.api}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "stream": True,
                  "max_tokens": 1500, "temperature": 0, "ignore_eos": True}) as reply:
        request_id = reply.headers["x-request-id"]
        for index, _line in enumerate(reply.iter_lines()):
            if index == 6:  # 1500 tokens take seconds; these questions, milliseconds each
                for peer in mesh.peers[:3]:
                    seen[peer.peer_id] = json.loads(meshctl(peer, "sessions", "--json").stdout)
                break
    mine = [s for s in seen[entry.peer_id] if s["session_id"] == request_id]
    assert any(s["role"] == "entry" and s["model"] == "tiny" and s["hops"] >= 1 for s in mine), seen
    route = next(s["route"] for s in mine if s["role"] == "entry")
    for peer_id in route:
        roles = [s["role"] for s in seen[peer_id] if s["session_id"] == request_id]
        assert any(r.startswith("hop ") for r in roles), (peer_id, seen[peer_id])
        jsonschema.validate(seen[peer_id], _schema("sessions"))

    def ended_everywhere() -> bool:
        return all(request_id not in meshctl(p, "sessions", "--json").stdout for p in mesh.peers[:3])

    mesh.wait_until(ended_everywhere, timeout=60, what="the cancelled session to end on every peer")
    for peer in mesh.peers[:3]:
        if peer.peer_id in route:
            def closed(peer=peer) -> list:
                found = json.loads(meshctl(peer, "logs", "--session", request_id, "--json").stdout)
                return found if any("closed on this hop" in r["message"] for r in found) else []

            records = mesh.wait_until(closed, timeout=30, what=f"{peer.peer_id[:8]} to log the session's end")
            assert all(r["session"] == request_id for r in records), records


def test_the_status_page_shows_the_mesh_in_a_real_browser(mesh):
    """Headless Chromium loads a peer's status page and runs its script against the live mesh; the
    rendered page is read back (the DOM) and kept as a screenshot in test-artifacts/."""
    import os
    import re
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if os.environ.get("MESHD_REQUIRE_SYSTEM_TOOLS") == "1":
            pytest.fail("chromium is missing; `make test` installs Debian's chromium package")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    page = f"http://{mesh.peers[0].control}/"
    html = httpx.get(page, timeout=10)
    assert html.status_code == 200 and "text/html" in html.headers["content-type"]
    artifacts = Path(__file__).parents[1] / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    profile = artifacts / "chromium-profile"
    common = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--no-first-run", f"--user-data-dir={profile}", "--window-size=1280,1100",
              "--virtual-time-budget=6000"]
    dom = subprocess.run([*common, "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    rows = re.findall(r'<tr data-peer="([a-z0-9]+)"', dom.stdout)
    peers = {p.peer_id for p in mesh.peers}
    assert len(rows) >= 3 and set(rows) == peers, (rows, dom.stdout[-3000:])
    cells = [row.count("<td") for row in re.findall(r'<tr data-peer="[a-z0-9]+">(.*?)</tr>', dom.stdout)]
    assert cells == [10] * len(rows), cells  # through the audit column
    start = dom.stdout.find('<div class="model" data-model="tiny">')
    assert start >= 0, dom.stdout[-3000:]
    tiny = dom.stdout[start:dom.stdout.index("<h2>Live sessions", start)]
    assert '<span class="ok">covered</span>' in tiny, tiny
    spans = re.findall(r'class="held"[^>]*style="left: ([0-9.]+)%; width: ([0-9.]+)%;', tiny)
    assert len(spans) == 3 and abs(sum(float(w) for _, w in spans) - 100) < 0.01, spans
    assert '<div id="error"></div>' in dom.stdout, "the page could read every endpoint"
    shot = artifacts / "status-page.png"
    shot.unlink(missing_ok=True)
    taken = subprocess.run([*common, f"--screenshot={shot}", page], capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]
    shutil.rmtree(profile, ignore_errors=True)
