"""Capture and replay among real daemons: a three-peer mesh of the built-in tiny model whose entries
capture (one in full, one metadata only) the requests they answer; capture files keep no prompt or
reply text unless full capture is on, and then no credential; every captured reply, greedy and
sampled (with a seed, and without one: the seed the entry drew), comes out the same when replayed on
the other route; a peer that computes its layers wrong changes the replies replayed through it, and
the replay says at which token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from meshd.capture.store import read_capture
from meshd.daemon.local_mesh import LocalMesh

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((REPO / "meshd" / "cli" / "schemas" / "replay.json").read_text())
SECRET = "sk-meshsecret-4242"
PROMPT_WORDS = ("periwinkle", "xylophone", "lighthouse", "saffron", "umbrella", "cathedral")
REQUESTS = [
    {"model": "tiny", "messages": [{"role": "user", "content": "periwinkle xylophone lighthouse"}], "max_tokens": 16,
     "temperature": 0},
    {"model": "tiny", "messages": [{"role": "user", "content": "periwinkle lighthouse at dusk"}], "max_tokens": 16,
     "temperature": 0.9, "seed": 1234},
    {"model": "tiny", "messages": [{"role": "user", "content": "xylophone in the lighthouse"}], "max_tokens": 16,
     "temperature": 1.2, "top_p": 0.9},  # no seed: the entry draws one, and the record keeps it
    {"model": "tiny", "prompt": "saffron umbrella cathedral", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    {"model": "tiny", "max_tokens": 10, "temperature": 0, "messages": [
        {"role": "user", "content": "look up the umbrella forecast"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "forecast", "arguments": json.dumps({"city": "Paris", "api_key": SECRET})}}]},
        {"role": "user", "content": "and the cathedral?"}]},
]


def post(peer, path: str, body: dict) -> dict:
    import httpx2 as httpx

    reply = httpx.post(f"http://{peer.api}{path}", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def reply_text(body: dict, answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "messages" in body else choice["text"]


def meshctl(peer, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", *args, "--control", peer.control],
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    with LocalMesh(tmp_path_factory.mktemp("capture"), env={"PYTHONPATH": str(REPO)}) as m:
        m.start_peer(model=tiny_model, layers=(0, 2), extra=["--capture", "full", "--audit-rate", "0"])
        m.start_peer(model=tiny_model, layers=(2, 4), extra=["--capture", "metadata", "--audit-rate", "0"])
        m.start_peer(model=tiny_model, layers=(0, 4), extra=["--audit-rate", "0"])
        m.wait_covered("tiny", timeout=90)
        yield m


@pytest.fixture(scope="module")
def captured(mesh):
    """Every request sent to both capturing entries, plus one cut by a stop string; their replies."""
    full, metadata = mesh.peers[0], mesh.peers[1]
    bodies = list(REQUESTS)
    completion = post(full, "/v1/completions", REQUESTS[3])["choices"][0]["text"]
    assert len(completion) >= 6, completion
    bodies.append({**REQUESTS[3], "stop": [completion[3:5]]})  # cut short by a stop string mid-reply
    replies = {}
    for peer in (full, metadata):
        for i, body in enumerate(bodies):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            replies[(peer.index, i)] = reply_text(body, post(peer, path, body))
    mesh.wait_until(lambda: full.get("/status")["capture"]["records"] == len(bodies) + 1, 30, "the full capture")
    mesh.wait_until(lambda: metadata.get("/status")["capture"]["records"] == len(bodies), 30, "the metadata capture")
    stop = completion[3:5]
    assert replies[(0, len(bodies) - 1)] == completion[:completion.find(stop)]
    return bodies, replies


def capture_bytes(peer) -> bytes:
    return b"".join(p.read_bytes() for p in sorted((peer.data_dir / "capture").glob("capture-*.jsonl")))


def other_route(mesh, record: dict) -> str:
    """The route the record did not take: both halves, or the peer holding every layer."""
    head, tail, whole = mesh.peers[0], mesh.peers[1], mesh.peers[2]
    used = [h["peer_id"] for h in record["route"]["hops"]]
    if used == [whole.peer_id]:
        return f"{head.peer_id}:0:2,{tail.peer_id}:2:4"
    return f"{whole.peer_id}:0:4"


def replay_on_other_routes(mesh, entry, capture_dir: Path, tmp_path: Path, *extra: str) -> list[dict]:
    """Replay every record of ``capture_dir`` on the route it did not take; the results."""
    groups: dict[str, list[dict]] = {}
    for record in read_capture(capture_dir).records:
        groups.setdefault(other_route(mesh, record), []).append(record)
    results = []
    for n, (route, records) in enumerate(groups.items()):
        part = tmp_path / f"part{n}.jsonl"
        part.write_text("".join(json.dumps(r) + "\n" for r in records))
        run = meshctl(entry, "replay", str(part), "--route", route, "--json", *extra)
        assert run.returncode == 0, run.stdout + run.stderr
        doc = json.loads(run.stdout)
        jsonschema.validate(doc, SCHEMA)
        assert doc["summary"]["identical"] == len(records), doc
        results += doc["results"]
    return results


def test_capture_files_hold_no_prompt_or_reply_text_unless_full(mesh, captured):
    bodies, replies = captured
    status = json.loads((REPO / "meshd" / "cli" / "schemas" / "status.json").read_text())
    for peer in mesh.peers:
        jsonschema.validate(peer.get("/status"), status)
    metadata = capture_bytes(mesh.peers[1]).decode()
    texts = [t for (peer, _), t in replies.items() if peer == 1 and len(t.strip()) >= 6]
    assert texts, replies
    for needle in (*PROMPT_WORDS, *texts, SECRET, "Paris"):
        assert needle not in metadata, needle
    records = [json.loads(line) for line in metadata.splitlines()]
    assert len(records) == len(bodies)
    assert all("request" not in r and "reply" not in r for r in records)
    seeds = [r["sampling"] for r in records]
    assert seeds[1] == {"temperature": 0.9, "top_p": 1.0, "seed": 1234, "seed_drawn": False}
    assert seeds[2]["seed_drawn"] is True and seeds[2]["seed"] > 0
    assert records[-1]["ended_by"] == "stop_string"
    assert all(r["ttft_ms"] > 0 and r["total_ms"] >= r["ttft_ms"] for r in records)
    assert all(r["numerics"] and r["compat_key"] == mesh.peers[1].get("/status")["compat_key"] for r in records)

    full = capture_bytes(mesh.peers[0]).decode()
    assert SECRET not in full and "[REDACTED]" in full and "Paris" in full  # credentials only are removed
    assert all(word in full for word in PROMPT_WORDS)
    for path in (mesh.peers[0].data_dir / "capture").iterdir():
        assert path.stat().st_mode & 0o077 == 0
    assert (mesh.peers[0].data_dir / "capture.key").stat().st_mode & 0o777 == 0o600


def test_replay_reproduces_every_full_record_on_the_other_route(mesh, captured, tmp_path):
    entry = mesh.peers[0]
    results = replay_on_other_routes(mesh, entry, entry.data_dir / "capture", tmp_path)
    assert len(results) == len(captured[0]) + 1
    for result in results:
        assert result["status"] == "identical" and result["prompt_checked"], result
        assert not result["same_route"] and result["replayed"]["tokens"] == result["captured"]["tokens"]
    assert {r["replayed"]["ended_by"] for r in results} >= {"stop_string", "length"}
    # without a route named: the best route of the captured compat key now
    run = meshctl(entry, "replay", str(entry.data_dir / "capture"), "--limit", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 records: 2 identical, 0 differ, 0 not replayed" in run.stdout


def test_replay_reproduces_every_metadata_record_from_the_requests_given_again(mesh, captured, tmp_path):
    entry = mesh.peers[1]
    requests = tmp_path / "requests.jsonl"
    unrelated = {"model": "tiny", "prompt": "nothing captured this", "max_tokens": 3}
    requests.write_text("".join(json.dumps(b) + "\n" for b in [*captured[0], unrelated]))
    results = replay_on_other_routes(mesh, entry, entry.data_dir / "capture", tmp_path, "--requests", str(requests))
    assert len(results) == len(captured[0])
    assert all(r["status"] == "identical" and not r["same_route"] for r in results)
    # without the requests, a metadata record cannot be replayed: said, and exit status 3
    run = meshctl(entry, "replay", str(entry.data_dir / "capture"), "--json")
    assert run.returncode == 3, run.stdout + run.stderr
    assert json.loads(run.stdout)["summary"]["unmatched"] == len(captured[0])


def test_replay_through_a_peer_computing_wrong_finds_the_first_differing_token(mesh, captured, tiny_model):
    liar = mesh.start_peer(model=tiny_model, layers=(2, 4), module="tests.corrupt_hop", extra=["--audit-rate", "0"])
    full, metadata = mesh.peers[0], mesh.peers[1]
    for peer in (full, metadata):
        mesh.wait_until(lambda p=peer: any(r["peer_id"] == liar.peer_id and r["models"] and r["models"][0]["end"]
                                           for r in p.get("/peers")["peers"]), 60, "the new peer's card")
    run = meshctl(full, "replay", str(full.data_dir / "capture"), "--through", liar.peer_id[:10])
    print("\n" + run.stdout)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"gate: routes through {liar.peer_id[:10]} change" in run.stdout
    assert "first difference at token" in run.stdout

    run = meshctl(full, "replay", str(full.data_dir / "capture"), "--through", liar.peer_id, "--json")
    assert run.returncode == 1
    doc = json.loads(run.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["summary"]["differs"] == len(doc["results"]) == len(captured[0]) + 1
    for result in doc["results"]:
        assert [h["peer_id"] for h in result["replayed"]["hops"]] == [full.peer_id, liar.peer_id]
        diff = result["first_difference"]
        assert diff["index"] >= 0 and (diff["captured"] or diff["replayed"])
        for side in ("captured", "replayed"):
            assert diff[side] is None or isinstance(diff[side]["text"], str)

    requests = full.data_dir.parent / "requests.jsonl"
    requests.write_text("".join(json.dumps(b) + "\n" for b in captured[0]))
    run = meshctl(metadata, "replay", str(metadata.data_dir / "capture"), "--through", liar.peer_id, "--json",
                  "--requests", str(requests))
    assert run.returncode == 1, run.stdout + run.stderr
    doc = json.loads(run.stdout)
    assert doc["summary"]["differs"] == len(captured[0])
    assert all(r["first_difference"] is None for r in doc["results"])  # metadata: differs, not where
