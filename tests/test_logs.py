"""Logs: the ids a record carries from its task's context, both formats, and the recent records."""

from __future__ import annotations

import json
import logging

import trio

from meshd.logs import (
    ContextFilter,
    JsonFormatter,
    RecentRecords,
    TextFormatter,
    bind_log_context,
    log_context,
    route_id,
)


def _record(message: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("meshd.test", logging.INFO, __file__, 1, message, (), None)
    for k, v in extra.items():
        setattr(record, k, v)
    return record


def test_records_carry_the_ids_of_their_context_in_both_formats() -> None:
    context = ContextFilter(peer="peerA")
    with log_context(session="s1", route=route_id(2, ["abcdefghij", "klmnopqrst"])):
        record = _record("hello")
        context.filter(record)
    doc = json.loads(JsonFormatter().format(record))
    assert doc["msg"] == "hello" and doc["peer"] == "peerA" and doc["session"] == "s1"
    assert doc["route"] == "2:abcdefgh>klmnopqr"
    text = TextFormatter().format(record)
    assert text.endswith("meshd.test: hello session=s1 route=2:abcdefgh>klmnopqr")
    outside = _record("later")
    context.filter(outside)
    assert "session" not in json.loads(JsonFormatter().format(outside))


async def test_tasks_inherit_the_ids_bound_by_the_task_that_started_them() -> None:
    context = ContextFilter()
    recent = RecentRecords(size=10)
    recent.addFilter(context)
    log = logging.getLogger("meshd.test.tasks")
    log.addHandler(recent)
    log.setLevel(logging.INFO)

    async def serve(session: str) -> None:
        bind_log_context(session=session)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)

    async def child() -> None:
        await trio.sleep(0)
        log.info("step")

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, "a")
            nursery.start_soon(serve, "b")
        log.info("outside")
    finally:
        log.removeHandler(recent)
    assert sorted(r.get("session", "-") for r in recent.latest(10)) == ["-", "a", "b"]
    assert [r["message"] for r in recent.latest(10, session="a")] == ["step"]
    assert len(recent.latest(1)) == 1 and recent.latest(0) == []
