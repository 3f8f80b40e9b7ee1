"""Audits without IO: judging replays, the book's exclusions, signed accusations."""

from __future__ import annotations

import pytest

from meshd.audit.book import GUILTY_TO_EXCLUDE, MAX_ACCUSATIONS, AuditBook
from meshd.audit.records import BadAccusation, check_accusation, sign_accusation
from meshd.audit.verdict import Outcome, Replay, judge
from meshd.identity import Identity


def replay(peers: str, tokens: tuple[int, ...]) -> Replay:
    return Replay(frozenset(peers), tokens)


GOOD, BAD, OTHER = (1, 2, 3), (9, 9, 9), (7, 7, 7)


def test_two_agreeing_routes_convict_the_one_peer_only_the_third_route_has():
    verdict = judge([replay("AB", BAD), replay("AC", GOOD), replay("AD", GOOD)])
    assert verdict.outcome == Outcome.GUILTY and verdict.culprit == "B"
    assert verdict.expected == GOOD and verdict.got == BAD and verdict.cleared == frozenset("ACD")
    assert judge([replay("AC", GOOD), replay("AB", BAD), replay("AD", GOOD)]).culprit == "B"  # any order


def test_an_audit_that_cannot_tell_who_lied_convicts_nobody():
    assert judge([replay("AB", BAD), replay("AC", GOOD)]).outcome == Outcome.INCONCLUSIVE  # two: either one
    assert judge([replay("AB", BAD), replay("AC", GOOD), replay("AD", OTHER)]).outcome == Outcome.INCONCLUSIVE
    # the odd route differs in two peers: which one?
    assert judge([replay("XY", BAD), replay("AC", GOOD), replay("AD", GOOD)]).outcome == Outcome.INCONCLUSIVE
    # the agreeing routes share a peer the odd one lacks: it may be their liar
    assert judge([replay("AB", GOOD), replay("CD", BAD), replay("CE", BAD)]).outcome == Outcome.INCONCLUSIVE
    consistent = judge([replay("AB", GOOD), replay("AC", GOOD), replay("AD", GOOD)])
    assert consistent.outcome == Outcome.CONSISTENT and consistent.cleared == frozenset("ABCD")


def test_a_peer_is_excluded_after_repeated_guilt_and_accusations_alone_do_nothing():
    book = AuditBook("A")
    guilty = judge([replay("AB", BAD), replay("AC", GOOD), replay("AD", GOOD)])
    for n in range(GUILTY_TO_EXCLUDE - 1):
        assert book.record(guilty, float(n)) is None
    assert book.of("B")["state"] == "suspect"  # type: ignore[index]
    assert book.record(guilty, 9.0) == "B"
    assert book.excluded() == frozenset("B") and book.of("B")["state"] == "excluded"  # type: ignore[index]
    assert book.of("C")["passed"] == GUILTY_TO_EXCLUDE  # type: ignore[index]
    liar = Identity.generate()
    signed = sign_accusation(liar, "C", "m", "k", [1, 2], [3], [4], 0)
    assert book.heard(liar.peer_id, "C", signed) and not book.heard(liar.peer_id, "C", signed)
    book.unconfirmed("C")
    assert not book.is_excluded("C")
    assert book.of("C")["state"] == "accused" and book.of("C")["unconfirmed_accusations"] == 1  # type: ignore[index]
    assert signed in book.accusations()


def test_accusers_are_kept_only_while_their_accusations_are():
    """Throwaway identities accusing one peer cannot grow its record: an accuser goes with its
    accusation, the oldest first."""
    book = AuditBook("A")
    accusers = [Identity.generate() for _ in range(MAX_ACCUSATIONS + 100)]
    for liar in accusers:
        assert book.heard(liar.peer_id, "C", sign_accusation(liar, "C", "m", "k", [1], [2], [3], 0))
    record = book.of("C")
    assert record is not None and len(record["accused_by"]) == MAX_ACCUSATIONS
    assert set(record["accused_by"]) == {a.peer_id for a in accusers[-MAX_ACCUSATIONS:]}
    assert len(book.accusations()) <= MAX_ACCUSATIONS


def test_accusations_are_checked_before_they_count():
    accuser = Identity.generate()
    signed = sign_accusation(accuser, "victim", "tiny", "key", [5, 6, 7], [1], [2], 123)
    record = check_accusation(signed)
    assert (record.accuser, record.accused, list(record.prompt)) == (accuser.peer_id, "victim", [5, 6, 7])
    forged = type(signed)(accusation=signed.accusation, signature=Identity.generate().sign(signed.accusation))
    with pytest.raises(BadAccusation, match="not signed"):
        check_accusation(forged)
    with pytest.raises(BadAccusation, match="no audit"):
        check_accusation(sign_accusation(accuser, "victim", "tiny", "key", [], [1], [2], 0))
    with pytest.raises(BadAccusation, match="no other peer"):
        check_accusation(sign_accusation(accuser, accuser.peer_id, "tiny", "key", [1], [1], [2], 0))
    with pytest.raises(BadAccusation):
        check_accusation(type(signed)(accusation=b"\xff\xff", signature=b""))


async def test_a_flood_of_accusations_runs_at_most_two_audits_at_once(nursery):
    import trio

    from meshd.audit.auditor import MAX_RUNNING, MAX_WAITING, Auditor

    peak = 0

    class Offers:  # no rivals anywhere: each audit finds nothing to compare, after a moment's work
        def offers(self) -> list:
            nonlocal peak
            peak = max(peak, auditor.running)
            return []

    class Routes:
        view = Offers()

    me = Identity.generate()
    book = AuditBook(me.peer_id)
    auditor = Auditor(me, None, Routes(), book, None, nursery, rate=0.0, tokens=4)  # type: ignore[arg-type]
    liar = Identity.generate()
    for n in range(40):
        auditor.on_accusation(sign_accusation(liar, f"peer{n}", "tiny", "key", [1, 2], [3], [4], n))
    assert auditor.running <= MAX_RUNNING and len(auditor._waiting) <= MAX_WAITING
    with trio.fail_after(5):
        while auditor.running or auditor._waiting:
            await trio.sleep(0.01)
    assert peak <= MAX_RUNNING
    checked = sum(1 for n in range(40) if (book.of(f"peer{n}") or {}).get("unconfirmed_accusations"))
    assert MAX_WAITING <= checked < 40  # the oldest waiting beyond the queue were dropped unchecked
