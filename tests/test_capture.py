"""Capture records, redaction, the bounded store and replay's route and comparison logic, without a mesh."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import trio

from meshd.api.backend import Finished, GenerationRequest, TokenEvent
from meshd.api.validation import parse_chat, parse_completion
from meshd.capture import recorder as recorder_module
from meshd.capture.recorder import CaptureRecorder, observe
from meshd.capture.records import (
    REDACTED,
    CapturedRequest,
    CaptureFormatError,
    CaptureKey,
    CaptureKeyError,
    RequestObservation,
    build_record,
    is_credential_key,
    redact,
    request_body,
)
from meshd.capture.replay import (
    DIFFERS,
    EXIT_DIFFERS,
    EXIT_IDENTICAL,
    EXIT_INCOMPLETE,
    FAILED,
    IDENTICAL,
    HopSpec,
    PromptIndex,
    ReplayError,
    body_kind,
    exit_code,
    first_difference,
    parse_route_spec,
    pin_route,
    summarize,
    through_constraints,
)
from meshd.capture.store import CaptureStore, Retention, read_capture
from meshd.daemon.config import PeerConfig, load_config
from meshd.tracker.view import Hop, Route, ShardOffer

SECRET_WORDS = ["Bearer-abc123", "sk-live-1", "sk-live-2", "hunter2", "s3cr3t", "tok-xyz", "cookie-val", "pw-9"]


def _request(**extra) -> GenerationRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "zebra quantum marmalade"}], "max_tokens": 6,
            **extra}
    return parse_chat(body, "req-1").generation


def _observed(req: GenerationRequest, reply=(11, 12, 13), text=("ab", "cd", "ef"), finish="length"):
    seen = RequestObservation(request=req, started=100.0, started_wall=1_700_000_000.0)
    route = Route("tiny", "compat-k", (Hop("a" * 32, 0, 2), Hop("b" * 32, 2, 4)), epoch=7, cost_ms=1.0)
    seen.planned(route, "local", "cpu/float32", [1, 2, 3, 4], seed=42, max_new_tokens=6)
    for i, (token, piece) in enumerate(zip(reply, text, strict=True)):
        seen.on_event(TokenEvent(text=piece, token_id=token), 100.5 + i)
    if finish is not None:
        seen.on_event(Finished(finish, 4, len(reply)), 104.0)
    seen.ended_at = 104.0
    return seen


# -- redaction -------------------------------------------------------------------------------------


def test_credential_key_names_are_recognised_but_token_counts_are_not():
    for name in ("api_key", "apiKey", "APIKey", "X-Api-Key", "OPENAI_API_KEY", "Authorization", "access_token",
                 "refresh_token", "password", "client_secret", "Cookie", "privateKey", "auth", "id_token", "secrets"):
        assert is_credential_key(name), name
    for name in ("max_tokens", "prompt_tokens", "completion_tokens", "max_completion_tokens", "total_tokens",
                 "model", "messages", "content", "author", "keyboard", "top_logprobs", "ignore_eos", "monkey"):
        assert not is_credential_key(name), name


def test_redaction_replaces_nested_credentials_in_dicts_lists_and_json_strings():
    body = {
        "model": "tiny", "max_tokens": 5,
        "messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "login", "arguments": json.dumps({"user": "ann", "password": "hunter2", "city": "Paris"})}}]}],
        "extra": {"Authorization": "Bearer-abc123", "layers": [{"apiKey": "sk-live-1"}, [{"X-Api-Key": "sk-live-2"}]],
                  "auth": {"user": "u", "pass": "pw-9"}, "client_secret": "s3cr3t", "refresh_token": "tok-xyz",
                  "headers": {"Cookie": "cookie-val"}, "usage": {"prompt_tokens": 3}},
        "tools": [{"type": "function", "function": {"name": "login", "parameters": {
            "type": "object", "properties": {"api_key": {"type": "string", "description": "the key"}}}}}],
    }
    out = redact(body)
    text = json.dumps(out)
    for secret in SECRET_WORDS:
        assert secret not in text, secret
    assert out["extra"]["Authorization"] == REDACTED
    assert out["extra"]["auth"] == {"user": REDACTED, "pass": REDACTED}  # everything under a credential field
    assert out["extra"]["usage"] == {"prompt_tokens": 3} and out["max_tokens"] == 5
    assert json.loads(out["messages"][0]["tool_calls"][0]["function"]["arguments"]) == {
        "user": "ann", "password": REDACTED, "city": "Paris"}
    # a tool's schema names a parameter api_key: a name, not a credential
    assert out["tools"][0]["function"]["parameters"]["properties"]["api_key"] == {"type": "string",
                                                                                  "description": "the key"}
    assert body["extra"]["Authorization"] == "Bearer-abc123"  # the input is left alone


def test_strings_without_credentials_are_kept_exactly():
    assert redact({"content": '{"a": 1,   "b": [2]}'}) == {"content": '{"a": 1,   "b": [2]}'}
    assert redact(["plain", 3, None, True]) == ["plain", 3, None, True]


# -- the key ---------------------------------------------------------------------------------------


def test_capture_key_is_private_stable_and_keys_its_hashes(tmp_path):
    key = CaptureKey.load_or_create(tmp_path)
    path = tmp_path / "capture.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = CaptureKey.load_or_create(tmp_path)
    assert again.key_id == key.key_id
    assert again.tokens_hash("prompt", [1, 2, 3]) == key.tokens_hash("prompt", [1, 2, 3])
    other = CaptureKey.load_or_create(tmp_path / "other")
    assert other.key_id != key.key_id
    assert other.tokens_hash("prompt", [1, 2, 3]) != key.tokens_hash("prompt", [1, 2, 3])
    assert key.tokens_hash("prompt", [1, 2, 3]) != key.tokens_hash("reply", [1, 2, 3])
    os.chmod(path, 0o644)
    with pytest.raises(CaptureKeyError, match="chmod 600"):
        CaptureKey.load_or_create(tmp_path)


# -- records ---------------------------------------------------------------------------------------


def test_a_metadata_record_holds_no_text_and_no_token_ids(tmp_path):
    key = CaptureKey.load_or_create(tmp_path)
    req = _request(stop=["zzz"])
    record = build_record(_observed(req), "metadata", key, "e" * 32)
    assert record is not None
    text = json.dumps(record)
    for word in ("zebra", "quantum", "marmalade", "abcdef", "zzz"):
        assert word not in text
    assert "request" not in record and "reply" not in record
    assert record["prompt_hash"] == key.tokens_hash("prompt", [1, 2, 3, 4])
    assert record["reply_hash"] == key.tokens_hash("reply", [11, 12, 13])
    assert record["sampling"] == {"temperature": 1.0, "top_p": 1.0, "seed": 42, "seed_drawn": True}
    assert record["route"]["hops"][1] == {"peer_id": "b" * 32, "start": 2, "end": 4}
    assert (record["prompt_tokens"], record["completion_tokens"], record["ended_by"]) == (4, 3, "length")
    assert record["ttft_ms"] == 500.0 and record["total_ms"] == 4000.0
    assert record["numerics"] == "cpu/float32" and record["stop"]["count"] == 1
    parsed = CapturedRequest.from_json(record)
    assert parsed.reply_tokens is None and parsed.request is None and parsed.seed == 42


def test_a_full_record_keeps_the_request_redacted_and_the_reply(tmp_path):
    key = CaptureKey.load_or_create(tmp_path)
    req = _request(seed=5)
    req = GenerationRequest(**{**req.__dict__, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}, "api_key": "sk-live-1"}}]})
    record = build_record(_observed(req), "full", key, "e" * 32)
    assert record is not None
    assert record["request"]["messages"][0]["content"] == "zebra quantum marmalade"
    assert record["request"]["tools"][0]["function"]["api_key"] == REDACTED
    assert record["reply"]["tokens"] == [11, 12, 13] and record["reply"]["text"] == "abcdef"
    assert record["sampling"]["seed_drawn"] is False
    parsed = CapturedRequest.from_json(record)
    assert parsed.reply_tokens == (11, 12, 13) and parsed.request == record["request"]


def test_only_answered_requests_make_records_and_stop_strings_count_as_answers(tmp_path):
    key = CaptureKey.load_or_create(tmp_path)
    cancelled = _observed(_request(), finish=None)  # the client went away: no Finished, no stop string
    assert build_record(cancelled, "metadata", key, "e") is None
    stopped = _observed(_request(stop=["cd"]), finish=None)  # closed by the API once "cd" appeared
    record = build_record(stopped, "metadata", key, "e")
    assert record is not None and record["ended_by"] == "stop_string" and record["finish_reason"] == "stop"
    assert build_record(_observed(_request()), "off", key, "e") is None


def test_a_validated_request_turns_back_into_a_body_that_parses_the_same():
    body = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n"], "ignore_eos": True,
            "tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": False}
    req = parse_chat(body, "a").generation
    again = parse_chat(request_body(req), "a").generation
    assert again == req
    completion = parse_completion({"model": "tiny", "prompt": "once", "max_tokens": 3}, "b").generation
    assert parse_completion(request_body(completion), "b").generation == completion


def test_records_holding_values_no_record_holds_are_refused(tmp_path):
    key = CaptureKey.load_or_create(tmp_path)
    good = build_record(_observed(_request()), "full", key, "e" * 32)
    assert good is not None
    for change in ({"sampling": {**good["sampling"], "temperature": 10**400}},  # no float holds it
                   {"reply": {**good["reply"], "tokens": [11, -1, 13]}},
                   {"max_new_tokens": 2**70}):
        with pytest.raises(CaptureFormatError):
            CapturedRequest.from_json({**good, **change})


def test_a_line_nested_too_deeply_is_skipped_with_the_rest_kept(tmp_path):
    clock = Clock()
    directory = tmp_path / "c"
    store = CaptureStore(directory, Retention(100, 10**9, 10**6), clock=clock)
    store.append(_record(0, clock))
    store.close()
    segment = sorted(directory.glob("capture-*.jsonl"))[-1]
    with segment.open("ab") as f:
        f.write(b"[" * 200_000 + b"]" * 200_000 + b"\n")
    store = CaptureStore(directory, Retention(100, 10**9, 10**6), clock=clock)  # opens as the daemon does
    store.append(_record(2, clock))
    read = read_capture(directory)
    assert [r["id"] for r in read.records] == ["r0", "r2"]
    assert len(read.warnings) == 1 and "not a JSON record" in read.warnings[0]


def test_a_write_the_disk_cuts_short_costs_that_record_only(tmp_path, monkeypatch):
    import errno

    from meshd.capture import store as store_module

    clock = Clock()
    directory = tmp_path / "c"
    store = CaptureStore(directory, Retention(100, 10**9, 10**6), clock=clock)
    store.append(_record(1, clock))
    real_write, failed = os.write, []

    def half_then_full(fd: int, data) -> int:
        if not failed:  # half the record goes out, then the disk is full
            failed.append(True)
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(store_module.os, "write", half_then_full)
    with pytest.raises(OSError):
        store.append(_record(2, clock))
    store.append(_record(3, clock))
    store.append(_record(4, clock))
    read = read_capture(directory)
    assert [r["id"] for r in read.records] == ["r1", "r3", "r4"] and not read.warnings
    assert store.records == 3


def test_records_of_another_version_or_shape_are_refused():
    with pytest.raises(CaptureFormatError, match="version"):
        CapturedRequest.from_json({"v": 99})
    with pytest.raises(CaptureFormatError, match="lacks"):
        CapturedRequest.from_json({"v": 1, "id": "x"})
    with pytest.raises(CaptureFormatError):
        CapturedRequest.from_json([1])


# -- the store -------------------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _record(i: int, clock: Clock, pad: int = 0) -> dict:
    return {"v": 1, "id": f"r{i}", "time_ms": int(clock() * 1000), "pad": "x" * pad}


def _ids(path: Path) -> list[str]:
    return [r["id"] for r in read_capture(path).records]


def test_retention_by_count_drops_the_oldest(tmp_path):
    clock = Clock()
    store = CaptureStore(tmp_path / "c", Retention(5, 10**9, 10**6), clock=clock)
    for i in range(8):
        assert store.append(_record(i, clock))
    assert _ids(tmp_path / "c") == ["r3", "r4", "r5", "r6", "r7"]
    assert store.records == 5
    big = CaptureStore(tmp_path / "big", Retention(160, 10**9, 10**6), clock=clock)  # segments of 10
    for i in range(175):
        big.append(_record(i, clock))
    kept = _ids(tmp_path / "big")
    assert len(kept) <= 160 and len(kept) >= 150 and kept[-1] == "r174"
    assert kept == [f"r{i}" for i in range(175 - len(kept), 175)]


def test_retention_by_bytes_and_a_record_too_big_for_the_store(tmp_path):
    clock = Clock()
    store = CaptureStore(tmp_path / "c", Retention(10**6, 16 * 1000, 10**6), clock=clock)
    for i in range(100):
        store.append(_record(i, clock, pad=200))
    assert store.bytes <= 16 * 1000
    size = sum(p.stat().st_size for p in (tmp_path / "c").iterdir())
    assert size == store.bytes and size >= 15 * 1000 - 300
    assert _ids(tmp_path / "c")[-1] == "r99"
    assert not store.append(_record(100, clock, pad=20_000))  # larger than the whole store may be
    assert _ids(tmp_path / "c")[-1] == "r99"


def test_retention_by_age_even_without_new_records(tmp_path):
    clock = Clock()
    store = CaptureStore(tmp_path / "c", Retention(1000, 10**9, 160.0), clock=clock)
    for i in range(20):
        store.append(_record(i, clock))
        clock.now += 10.0  # one record each 10 s; segments span at most 10 s
    clock.now += 5.0  # r0 was written 205 s ago
    store.prune()
    kept = _ids(tmp_path / "c")
    assert kept and all(clock.now - int(r[1:]) * 10 - 1_000_000 <= 160 for r in kept), kept
    assert kept[-1] == "r19"
    clock.now += 1000.0
    store.prune()
    assert store.records == 0 and not list((tmp_path / "c").glob("capture-*.jsonl"))


def test_a_torn_last_line_is_skipped_on_read_and_cut_before_the_next_append(tmp_path, caplog):
    clock = Clock()
    directory = tmp_path / "c"
    store = CaptureStore(directory, Retention(100, 10**9, 10**6), clock=clock)
    for i in range(3):
        store.append(_record(i, clock))
    store.close()
    segment = sorted(directory.glob("capture-*.jsonl"))[-1]
    with segment.open("ab") as f:
        f.write(b'{"v": 1, "id": "r3", "time_ms": 12')  # the daemon died mid-write
    read = read_capture(directory)
    assert [r["id"] for r in read.records] == ["r0", "r1", "r2"]
    assert len(read.warnings) == 1 and "torn last line" in read.warnings[0]
    store = CaptureStore(directory, Retention(100, 10**9, 10**6), clock=clock)
    assert "torn record" in caplog.text
    store.append(_record(4, clock))
    read = read_capture(directory)
    assert [r["id"] for r in read.records] == ["r0", "r1", "r2", "r4"] and not read.warnings
    assert stat.S_IMODE(segment.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_reading_a_capture_that_is_not_there_says_so(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_capture(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no capture segments"):
        read_capture(tmp_path / "empty")


async def test_the_recorder_writes_off_the_request_path(tmp_path):
    recorder = CaptureRecorder(tmp_path, "full", Retention(100, 10**9, 10**6), "e" * 32)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        seen = observe(_request())
        seen.planned(Route("tiny", "k", (Hop("a" * 32, 0, 4),), 1, 0.0), "local", "", [5, 6], 9, 6)
        seen.on_event(TokenEvent("hi", 7), 1.0)
        seen.on_event(Finished("stop", 2, 1), 1.0)
        recorder.submit(seen)
        recorder.submit(observe(_request()))  # never answered: dropped without a record
        with trio.fail_after(10):
            while recorder.written < 1:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    records = read_capture(tmp_path / "capture").records
    assert [r["reply"]["text"] for r in records] == ["hi"]
    assert recorder.status()["records"] == 1 and recorder.status()["key_id"] == records[0]["key_id"]


async def test_with_capture_off_records_from_before_stay_readable_and_still_age_out(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder_module, "PRUNE_EVERY_S", 0.01)
    clock = Clock()
    retention = Retention(1000, 10**9, 160.0)
    store = CaptureStore(tmp_path / "capture", retention, clock=clock)
    for i in range(4):
        store.append(_record(i, clock))
        clock.now += 60.0  # r0..r3 written at 0, 60, 120 and 180 s
    store.close()
    clock.now = 1_000_000.0 + 200.0  # r0 is 200 s old: past the bound, the others within it
    recorder = CaptureRecorder(tmp_path, "off", retention, "e", clock=clock)
    with trio.fail_after(10):  # the recorder ends of itself once no record is left
        async with trio.open_nursery() as nursery:
            await nursery.start(recorder.run)
            assert _ids(tmp_path / "capture") == ["r1", "r2", "r3"]  # pruned as the recorder started
            assert recorder.status()["records"] == 3 and not recorder.enabled
            recorder.submit(observe(_request()))  # capture is off: nothing new is written
            clock.now += 90.0  # r1 and r2 now past the bound
            while recorder.status()["records"] != 1:  # the recorder prunes once a period
                await trio.sleep(0.01)
            assert _ids(tmp_path / "capture") == ["r3"]
            clock.now += 1000.0  # and r3
    assert not list((tmp_path / "capture").glob("capture-*.jsonl"))
    assert recorder.status()["records"] == 0


async def test_with_capture_off_and_nothing_from_before_the_recorder_makes_nothing(tmp_path):
    recorder = CaptureRecorder(tmp_path, "off", Retention(100, 10**9, 10**6), "e")
    await recorder.run()
    assert not (tmp_path / "capture").exists() and not (tmp_path / "capture.key").exists()
    assert recorder.status()["mode"] == "off" and "records" not in recorder.status()


async def test_a_recorder_whose_key_is_not_private_turns_capture_off(tmp_path):
    CaptureKey.load_or_create(tmp_path)
    os.chmod(tmp_path / "capture.key", 0o640)
    recorder = CaptureRecorder(tmp_path, "metadata", Retention(100, 10**9, 10**6), "e")
    await recorder.run()
    assert not recorder.enabled and "chmod 600" in recorder.error
    recorder.submit(observe(_request()))  # ignored, never raises


# -- settings --------------------------------------------------------------------------------------


def test_capture_settings_are_checked():
    assert PeerConfig().capture == "off"
    config = load_config(None, {"capture": "metadata", "capture_max_age_s": "12h", "capture_max_bytes": "2MiB"})
    assert (config.capture_max_age_s, config.capture_max_bytes) == (43200.0, 2 * 1024**2)
    with pytest.raises(ValueError, match="capture"):
        load_config(None, {"capture": "everything"})
    with pytest.raises(ValueError, match="capture_max_records"):
        PeerConfig(capture_max_records=0)
    with pytest.raises(ValueError, match="capture_max_age_s"):
        load_config(None, {"capture_max_age_s": "soon"})


# -- replay logic ----------------------------------------------------------------------------------

A, B, C, D = ("a" * 32, "b" * 32, "c" * 32, "d" * 32)


def _offer(peer: str, start: int, end: int, compat: str = "k1") -> ShardOffer:
    return ShardOffer(peer, "tiny", compat, 4, 1, 1, 1, (start, end))


OFFERS = [_offer(A, 0, 2), _offer(B, 2, 4), _offer(C, 2, 4), _offer(D, 0, 4, compat="k2")]


def test_route_specs_parse_in_every_form():
    assert parse_route_spec("aaaa:0:2,bbbb:2:4") == [HopSpec("aaaa", (0, 2)), HopSpec("bbbb", (2, 4))]
    assert parse_route_spec("aaaa1234[0,2) -> bbbb1234[2,4)") == [HopSpec("aaaa1234", (0, 2)),
                                                                  HopSpec("bbbb1234", (2, 4))]
    assert parse_route_spec("aaaa, bbbb") == [HopSpec("aaaa", None), HopSpec("bbbb", None)]
    for bad in ("", "aaaa:0", "aaaa:2:2", "not a peer!"):
        with pytest.raises(ReplayError):
            parse_route_spec(bad)


def test_a_pinned_route_must_be_what_the_peers_serve_and_tile_the_model():
    route = pin_route("tiny", parse_route_spec("aaa:0:2,ccc"), OFFERS, epoch=3, entry=A)
    assert [(h.peer_id, h.start, h.end) for h in route.hops] == [(A, 0, 2), (C, 2, 4)]
    assert route.compat_key == "k1" and route.epoch == 3
    assert pin_route("tiny", parse_route_spec("ddd"), OFFERS, 1, A).compat_key == "k2"
    for spec, message in (("aaa,ddd", "compat keys"), ("bbb", "starts at layer 2"), ("aaa", "stops at layer 2"),
                          ("aaa:0:3,bbb", "holds layers"), ("eee", "names no peer"), ("aaa,bbb,ccc", "starts at")):
        with pytest.raises(ReplayError, match=message):
            pin_route("tiny", parse_route_spec(spec), OFFERS, 1, A)
    with pytest.raises(ReplayError, match="compat keys"):  # the layers tile, the keys differ
        pin_route("tiny", parse_route_spec("aaa,ddd"), [*OFFERS[:3], _offer(D, 2, 4, "k2")], 1, A)


def test_a_route_through_peers_excludes_their_rivals():
    assert through_constraints("tiny", [C], OFFERS) == ("k1", frozenset({B}))
    assert through_constraints("tiny", [D], OFFERS) == ("k2", frozenset())
    with pytest.raises(ReplayError, match="different compat keys"):
        through_constraints("tiny", [A, D], OFFERS)
    with pytest.raises(ReplayError, match="overlap"):
        through_constraints("tiny", [B, C], OFFERS)


def test_the_first_difference_names_the_index_and_both_tokens():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    diff = first_difference([1, 2, 3], [1, 5, 3])
    assert (diff.index, diff.captured, diff.replayed) == (1, 2, 5)
    diff = first_difference([1, 2], [1, 2, 9])
    assert (diff.index, diff.captured, diff.replayed) == (2, None, 9)


def test_summary_and_exit_status():
    results = [{"id": "a", "status": IDENTICAL}, {"id": "b", "status": DIFFERS, "first_difference": {"index": 2}}]
    summary = summarize(results)
    assert (summary["identical"], summary["differs"], summary["compared"]) == (1, 1, 2)
    assert summary["differences"] == [{"id": "b", "first_difference": {"index": 2}}]
    assert exit_code(summary) == EXIT_DIFFERS
    assert exit_code(summarize([{"id": "a", "status": IDENTICAL}])) == EXIT_IDENTICAL
    assert exit_code(summarize([{"id": "a", "status": IDENTICAL}, {"id": "b", "status": FAILED}])) == EXIT_INCOMPLETE
    assert exit_code(summarize([])) == EXIT_INCOMPLETE


def test_prompt_index_and_body_kinds(tmp_path):
    key = CaptureKey.load_or_create(tmp_path)
    record = CapturedRequest.from_json(build_record(_observed(_request()), "metadata", key, "e"))
    index = PromptIndex([record])
    assert index.compat_keys("tiny", "chat") == ["compat-k"]
    prompt, stops = key.tokens_hash("prompt", [1, 2, 3, 4]), key.stops_hash([])
    assert index.lookup("tiny", "compat-k", "chat", prompt, stops) == [record.id]
    assert index.lookup("tiny", "compat-k", "chat", key.tokens_hash("prompt", [1, 2, 3]), stops) == []
    assert index.lookup("tiny", "compat-k", "chat", prompt, key.stops_hash(["x"])) == []
    assert body_kind({"messages": []}) == "chat" and body_kind({"prompt": ""}) == "completion"
    with pytest.raises(ReplayError):
        body_kind({"model": "tiny"})


# -- meshctl replay without a daemon ---------------------------------------------------------------


def _meshctl(*argv: str) -> int:
    from meshd.cli.meshctl_main import build_parser

    args = build_parser().parse_args(list(argv))
    return args.func(args)


def test_meshctl_replay_refuses_bad_arguments_and_says_when_the_daemon_is_away(tmp_path, capsys):
    key = CaptureKey.load_or_create(tmp_path)
    capture = tmp_path / "records.jsonl"
    capture.write_text(json.dumps(build_record(_observed(_request()), "full", key, "e")) + "\n")
    assert _meshctl("replay", str(tmp_path / "absent")) == 2
    assert _meshctl("replay", str(capture), "--route", "x:1") == 2
    assert _meshctl("replay", str(capture), "--route", "aaaa", "--through", "bbbb") == 2
    assert "takes neither" in capsys.readouterr().err
    assert _meshctl("replay", str(capture), "--control", "127.0.0.1:9", "--timeout", "2") == 3
    assert "cannot reach" in capsys.readouterr().err
    requests = tmp_path / "requests.jsonl"
    requests.write_text("{not json\n")
    assert _meshctl("replay", str(capture), "--requests", str(requests)) == 2
    assert "requests.jsonl:1" in capsys.readouterr().err
    # a full capture keeps its requests: ones given again would be ignored, so they are refused, the
    # daemon never asked
    requests.write_text(json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert _meshctl("replay", str(capture), "--requests", str(requests), "--control", "127.0.0.1:9") == 2
    err = capsys.readouterr().err
    assert "none of the 1 records selected is one" in err and "cannot reach" not in err
