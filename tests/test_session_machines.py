"""The session plane's state machines on their own: repair policy, hop book, entry attempt."""

from __future__ import annotations

import pytest
import torch

from meshd.errors import BundleError, ErrorCode
from meshd.runtime.shard import HIDDEN_STATES, INPUT_IDS, StepResult
from meshd.session.attempt import EntryAttempt, Received, SendToHead, SessionFailed, SessionPlan, Source, StreamEnded
from meshd.session.hop_state import (
    AdmissionLimits,
    Compute,
    Holding,
    HopBook,
    HopSession,
    Refused,
    SendDownstream,
    SendToken,
)
from meshd.session.repair import REFUSALS, AllRefused, NoCompleteRoute, RepairConfig, RepairFailed, RepairPolicy
from meshd.tracker.view import Hop, Route
from meshd.wire import session_pb2 as pb
from meshd.wire.bundle import HiddenStateBundle, Phase, Sampling

ROUTE = Route("m", "k", (Hop("a", 0, 2), Hop("b", 2, 4)), epoch=0, cost_ms=1.0)
OTHER = Route("m", "k", (Hop("a", 0, 2), Hop("c", 2, 4)), epoch=0, cost_ms=1.0)


def failed(code: ErrorCode, peer: str = "b") -> SessionFailed:
    return SessionFailed(code, "it broke", peer)


# -- repair policy ------------------------------------------------------------------------------------


def test_a_failed_peer_is_excluded_for_a_while_and_reported_unreachable():
    policy = RepairPolicy(RepairConfig(blame_s=5.0))
    policy.begin(ROUTE)
    assert policy.on_failure(failed(ErrorCode.UNREACHABLE), 3, ROUTE, now=10.0) == "b"
    assert policy.choice(11.0).exclude == {"b"} and policy.choice(11.0).keep == {"a"}
    assert policy.choice(15.5).exclude == frozenset()  # the peer may be back: it is tried again
    epoch, resume_from, unchanged = policy.begin(OTHER)
    assert (epoch, resume_from, unchanged) == (1, 0, 1)


def test_refusals_exclude_without_reporting_and_a_cache_miss_blames_nobody():
    policy = RepairPolicy()
    policy.begin(ROUTE)
    assert policy.on_failure(failed(ErrorCode.KV_BUDGET), 0, ROUTE, now=0.0) is None
    assert policy.choice(0.0).exclude == {"b"}
    policy.begin(ROUTE)
    assert policy.on_failure(failed(ErrorCode.CACHE_MISS, "a"), 4, ROUTE, now=1.0) is None
    assert "a" not in policy.choice(1.0).exclude


def test_a_stall_avoids_every_peer_of_the_route_without_excluding_any():
    policy = RepairPolicy()
    policy.begin(ROUTE)
    assert policy.on_failure(SessionFailed(ErrorCode.STEP_TIMEOUT, "no token"), 2, ROUTE, now=0.0) is None
    choice = policy.choice(0.0)
    assert choice.avoid == {"a", "b"} and choice.exclude == frozenset()


def test_no_route_before_the_first_attempt_is_an_answer_at_once():
    with pytest.raises(NoCompleteRoute, match=r"\[2, 4\)"):
        RepairPolicy().on_no_route("m", [(2, 4)], 0, now=0.0)


def test_no_route_after_refusals_only_is_overloaded():
    policy = RepairPolicy()
    policy.begin(ROUTE)
    policy.on_failure(failed(ErrorCode.OVERLOADED), 0, ROUTE, now=0.0)
    with pytest.raises(AllRefused, match="overloaded"):
        policy.on_no_route("m", [], 0, now=0.1)


def test_waiting_for_coverage_backs_off_until_the_repair_budget_is_spent():
    policy = RepairPolicy(RepairConfig(budget_s=10.0, backoff_s=0.25, backoff_max_s=2.0))
    policy.begin(ROUTE)
    policy.on_failure(failed(ErrorCode.UNREACHABLE), 5, ROUTE, now=100.0)
    now, waits = 100.0, []
    with pytest.raises(RepairFailed, match="layers not covered"):
        while True:
            wait = policy.on_no_route("m", [(2, 4)], 5, now)
            waits.append(round(wait.until - now, 2))
            now = wait.until
    assert waits[:5] == [0.25, 0.5, 1.0, 2.0, 2.0]
    assert now == pytest.approx(110.0)


def test_attempts_run_out_into_the_last_cause():
    policy = RepairPolicy(RepairConfig(attempts=2))
    for _ in range(2):
        policy.begin(ROUTE)
        policy.on_failure(failed(ErrorCode.SEAM_CLOSED), 1, ROUTE, now=0.0)
    policy.begin(ROUTE)
    with pytest.raises(RepairFailed, match="seam_closed"):
        policy.on_failure(failed(ErrorCode.SEAM_CLOSED), 1, ROUTE, now=0.0)


def test_the_first_token_after_a_failure_reports_how_long_the_repair_took():
    policy = RepairPolicy()
    policy.begin(ROUTE)
    assert policy.on_token(0.0) is None
    policy.on_failure(failed(ErrorCode.UNREACHABLE), 7, ROUTE, now=1.0)
    assert policy.on_token(1.25) == (250.0, "tail")
    assert policy.on_token(1.5) is None


# -- hop book and session -----------------------------------------------------------------------------

HOLDING = Holding(peer_id="b", model_id="m", compat_key="k", layers=(2, 4), kv_bytes_per_token=100,
                  kv_budget_bytes=10_000)


def session_open(epoch: int = 0, **fields) -> pb.SessionOpen:
    hops = [pb.HopAddress(peer_id="a", address="a:1", range_start=0, range_end=2),
            pb.HopAddress(peer_id="b", address="b:1", range_start=2, range_end=4),
            pb.HopAddress(peer_id="c", address="c:1", range_start=4, range_end=6)]
    base = dict(session_id="s", epoch=epoch, model_id="m", compat_key="k", hops=hops, hop_index=1, max_tokens=50,
                prompt_tokens=10)
    return pb.SessionOpen(**{**base, **fields})


def test_admission_refuses_with_the_code_the_entry_routes_by():
    book = HopBook("b", AdmissionLimits(max_sessions=1, max_queue=2))
    book.admit(session_open(), HOLDING, queued=0)
    with pytest.raises(Refused) as full:
        book.admit(session_open(epoch=1), HOLDING, queued=0)
    assert full.value.code == ErrorCode.OVERLOADED
    roomy = HopBook("b")
    with pytest.raises(Refused) as budget:
        roomy.admit(session_open(max_tokens=101), HOLDING, queued=0)
    assert budget.value.code == ErrorCode.KV_BUDGET
    with pytest.raises(Refused) as queue:
        HopBook("b", AdmissionLimits(max_queue=2)).admit(session_open(), HOLDING, queued=2)
    assert queue.value.code == ErrorCode.OVERLOADED
    roomy.leaving = True
    with pytest.raises(Refused) as leaving:
        roomy.admit(session_open(), HOLDING, queued=0)
    assert leaving.value.code == ErrorCode.LEAVING


def test_each_upstream_peer_opens_sessions_at_a_bounded_rate():
    book = HopBook("b", AdmissionLimits(max_sessions=3, opens_per_s=2.0))
    for n in range(3):  # a burst of max_sessions
        book.admit(session_open(session_id=f"s{n}", max_tokens=1), HOLDING, queued=0, opener="flooder", now=0.0)
    for n in range(3):
        book.finish((f"s{n}", 0), failed=False, kv_held=False, now=0.0)
    with pytest.raises(Refused) as flooded:
        book.admit(session_open(session_id="s3", max_tokens=1), HOLDING, queued=0, opener="flooder", now=0.1)
    assert flooded.value.code == ErrorCode.RATE_LIMITED and flooded.value.code in REFUSALS
    book.admit(session_open(session_id="s4", max_tokens=1), HOLDING, queued=0, opener="someone else", now=0.1)
    book.admit(session_open(session_id="s5", max_tokens=1), HOLDING, queued=0, opener="flooder", now=0.6)


def test_no_upstream_peer_crowds_the_others_out_of_a_nearly_full_hop():
    book = HopBook("b", AdmissionLimits(max_sessions=8, opens_per_s=0))
    alone = HopBook("b", AdmissionLimits(max_sessions=8, opens_per_s=0))
    for n in range(8):  # alone, a peer may take the whole hop
        alone.admit(session_open(session_id=f"g{n}", max_tokens=1), HOLDING, queued=0, opener="greedy")
    book.admit(session_open(session_id="o", max_tokens=1), HOLDING, queued=0, opener="other")
    book.finish(("o", 0), failed=False, kv_held=False, now=0.0)  # another peer uses the hop too
    for n in range(7):
        book.admit(session_open(session_id=f"g{n}", max_tokens=1), HOLDING, queued=0, opener="greedy")
    with pytest.raises(Refused) as crowded:  # 1 of 8 left, and it holds more than half already
        book.admit(session_open(session_id="g7", max_tokens=1), HOLDING, queued=0, opener="greedy")
    assert crowded.value.code == ErrorCode.OVERLOADED and "its share" in str(crowded.value)
    book.admit(session_open(session_id="o0", max_tokens=1), HOLDING, queued=0, opener="other")
    book.finish(("g0", 0), failed=False, kv_held=False, now=0.0)
    book.finish(("g1", 0), failed=False, kv_held=False, now=0.0)  # 2 of 8 free: room again
    book.admit(session_open(session_id="g8", max_tokens=1), HOLDING, queued=0, opener="greedy")


def test_an_open_for_another_range_or_model_is_refused():
    book = HopBook("b")
    with pytest.raises(Exception, match="route names"):
        book.check_open(pb.SeamMessage(open=session_open(hop_index=0)), HOLDING)
    with pytest.raises(Exception, match="serves"):
        book.check_open(pb.SeamMessage(open=session_open(compat_key="other")), HOLDING)
    with pytest.raises(BundleError, match="starts with SessionOpen"):
        book.check_open(pb.SeamMessage(close=pb.Close()), HOLDING)


def test_a_failed_session_keeps_its_kv_for_the_grace_then_releases_it():
    book = HopBook("b", resume_grace_s=5.0)
    key = book.admit(session_open(), HOLDING, queued=0)
    assert book.finish(key, failed=True, kv_held=True, now=10.0) == []
    assert book.expired(14.9) == [] and book.expired(15.0) == [key]
    clean = book.admit(session_open(epoch=3), HOLDING, queued=0)
    assert book.finish(clean, failed=False, kv_held=True, now=20.0) == [clean]


def bundle(start: int, n: int, epoch: int = 1, hidden: int = 4) -> HiddenStateBundle:
    return HiddenStateBundle(session_id="s", epoch=epoch, phase=Phase.PREFILL, start_position=start, token_count=n,
                             tensors={HIDDEN_STATES: torch.arange(start, start + n).float().repeat(hidden, 1).T},
                             range_start=2, range_end=4, sample=True, sampling=Sampling() if start == 0 else None)


def test_a_resumed_hop_passes_kept_outputs_on_and_computes_only_the_rest():
    book = HopBook("b")
    first = session_open(epoch=0)
    key0 = book.admit(first, HOLDING, queued=0)
    old = HopSession(book, first, resumed=0)
    for start in (0, 5):
        part = bundle(start, 5, epoch=0)
        (compute,) = old.on_bundle(part)
        (send,) = old.on_computed(compute.bundle, StepResult(hidden_states=part.tensors[HIDDEN_STATES] + 100))
        old.on_sent(send)
    book.finish(key0, failed=True, kv_held=True, now=0.0)

    repaired = session_open(epoch=1, unchanged_prefix=3, resume_from_epoch=0, prompt_tokens=10)
    book.admit(repaired, HOLDING, queued=0)
    moved: list[tuple] = []
    kept, released = book.resume(repaired, lambda o, n, limit: moved.append((o, n, limit)) or limit, now=1.0)
    assert (kept, released, moved) == (9, [], [(("s", 0), ("s", 1), 9)])
    session = HopSession(book, repaired, kept)
    assert session.downstream_open().unchanged_prefix == 3
    actions = session.on_bundle(bundle(0, 10))
    assert [type(a) for a in actions] == [SendDownstream, Compute]
    passed, compute = actions
    assert (passed.bundle.start_position, passed.bundle.token_count) == (0, 9) and not passed.bundle.sample
    assert torch.equal(passed.bundle.tensors[HIDDEN_STATES][:, 0], torch.arange(9).float() + 100)
    assert (passed.bundle.range_start, passed.bundle.range_end) == (4, 6)  # addressed to the next hop
    assert (compute.bundle.start_position, compute.bundle.token_count) == (9, 1) and compute.bundle.sample


def test_a_new_epoch_that_cannot_resume_releases_the_old_one_at_once():
    book = HopBook("b")
    key0 = book.admit(session_open(epoch=0), HOLDING, queued=0)
    book.finish(key0, failed=True, kv_held=True, now=0.0)
    fresh = session_open(epoch=1, unchanged_prefix=0, resume_from_epoch=0)
    assert book.resume(fresh, lambda *_: pytest.fail("nothing to resume"), now=0.5) == (0, [key0])
    assert HopSession(book, fresh, 0).downstream_open().unchanged_prefix == 0


def test_the_tail_sends_the_sampled_token_for_the_position_after_the_bundle():
    book = HopBook("c")
    tail = session_open(hop_index=2)
    session = HopSession(book, tail, 0)
    assert session.next_hop is None and session.downstream_open() is None
    assert session.on_computed(bundle(0, 10, epoch=0), StepResult(token=77)) == [SendToken(10, 77)]
    with pytest.raises(BundleError, match="another session"):
        session.on_bundle(bundle(10, 1, epoch=5))


# -- entry attempt ------------------------------------------------------------------------------------


def attempt(max_new: int = 3, eos: int | None = None) -> EntryAttempt:
    plan = SessionPlan(route=ROUTE, addresses={"a": "a:1", "b": "b:1"}, prompt=[5, 6, 7], max_new_tokens=max_new,
                       sampling=Sampling(), session_id="s",
                       stop_token_ids=frozenset() if eos is None else frozenset({eos}), chunk_tokens=2,
                       step_timeout_s=3.0)
    entry = EntryAttempt(plan, "e", now=0.0)
    entry.on_results_open(pb.SeamMessage(ready=pb.Ready()), 0.0)
    return entry


def token(position: int, value: int) -> Received:
    return Received(Source.RESULTS, "b", pb.SeamMessage(token=pb.TokenResult(position=position, token=value)))


def test_the_prompt_goes_out_in_chunks_and_each_token_goes_back_in_before_it_is_emitted():
    entry = attempt()
    prefill = entry.start(0.0)
    assert [(a.bundle.start_position, a.bundle.token_count, a.bundle.sample) for a in prefill] == [
        (0, 2, False), (2, 1, True)]
    actions = entry.on_event(token(3, 42), 0.1)
    assert isinstance(actions[0], SendToHead) and actions[0].bundle.start_position == 3
    assert actions[0].bundle.tensors[INPUT_IDS].tolist() == [42] and actions[-1].token.token == 42
    entry.on_event(token(4, 43), 0.2)
    assert [type(a).__name__ for a in entry.on_event(token(5, 44), 0.3)] == ["Emit"] and entry.done


def test_a_token_out_of_place_or_an_error_ends_the_attempt_naming_the_peer():
    entry = attempt()
    entry.start(0.0)
    with pytest.raises(SessionFailed) as wrong:
        entry.on_event(token(9, 1), 0.1)
    assert wrong.value.code == ErrorCode.PROTOCOL and wrong.value.peer_id == "b"
    error = pb.SeamMessage(error=pb.SessionError(code="cache_miss", message="gone", peer_id="a"))
    with pytest.raises(SessionFailed) as remote:
        attempt().on_event(Received(Source.SEAM, "a", error), 0.1)
    assert remote.value.code == ErrorCode.CACHE_MISS and remote.value.peer_id == "a"
    unknown = pb.SeamMessage(error=pb.SessionError(code="from_a_newer_version", message="?", peer_id="a"))
    with pytest.raises(SessionFailed) as newer:
        attempt().on_event(Received(Source.SEAM, "a", unknown), 0.1)
    assert newer.value.code == ErrorCode.UNKNOWN
    with pytest.raises(SessionFailed) as ended:
        attempt().on_event(StreamEnded(Source.SEAM, "a"), 0.1)
    assert ended.value.code == ErrorCode.SEAM_CLOSED


def test_the_step_timeout_counts_from_the_last_progress():
    entry = attempt()
    entry.start(0.0)
    entry.on_event(token(3, 1), 2.0)
    assert entry.deadline == 5.0
    entry.on_timeout(4.9)  # early wake-ups are no timeout
    with pytest.raises(SessionFailed) as late:
        entry.on_timeout(5.0)
    assert late.value.code == ErrorCode.STEP_TIMEOUT and late.value.peer_id == ""


def test_the_first_token_may_take_a_step_timeout_per_prefill_chunk():
    entry = attempt()
    entry.start(0.0)  # the prompt of three tokens goes out in two chunks
    assert entry.deadline == 6.0
    entry.on_timeout(5.9)
    with pytest.raises(SessionFailed) as late:
        entry.on_timeout(6.0)
    assert late.value.code == ErrorCode.STEP_TIMEOUT and "6s" in str(late.value)
    entry = attempt()
    entry.start(0.0)
    entry.on_event(token(3, 1), 1.0)
    assert entry.deadline == 4.0  # decode steps get one each


def test_eos_ends_the_attempt_without_feeding_the_route():
    entry = attempt(max_new=10, eos=2)
    entry.start(0.0)
    assert [type(a).__name__ for a in entry.on_event(token(3, 2), 0.1)] == ["Emit"] and entry.done
