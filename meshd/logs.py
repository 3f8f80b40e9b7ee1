"""Logs of the daemon and the relay: JSON or text lines, each carrying the ids that let one request be
followed across peers, and the latest records kept in memory for ``meshctl logs``.

The ids come from context variables (:func:`log_context`): a session's tasks set them once, and every
record logged inside, by any module, carries them. Trio copies context into the tasks a task starts.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
RECENT_RECORDS = 2000
CONTEXT_FIELDS = ("peer", "session", "route")
_context: dict[str, contextvars.ContextVar[str | None]] = {
    name: contextvars.ContextVar(f"meshd_log_{name}", default=None) for name in CONTEXT_FIELDS}


@contextmanager
def log_context(**ids: str | None) -> Iterator[None]:
    """Within the block (and the tasks it starts), records carry these ids (``session=``, ``route=``)."""
    tokens = [(_context[name], _context[name].set(value)) for name, value in ids.items()]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def bind_log_context(**ids: str | None) -> None:
    """For the rest of the current task (and the tasks it starts), records carry these ids; for a task
    that serves one session from start to end, where a ``with`` block would have to span everything."""
    for name, value in ids.items():
        _context[name].set(value)


def route_id(epoch: int, peer_ids: Iterator[str] | list[str]) -> str:
    """How logs name one route of a session: its epoch and its peers, head first (8 characters each)."""
    return f"{epoch}:" + ">".join(p[:8] for p in peer_ids)


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's ids and its event fields (``extra={"fields": {...}}``), without empty ones."""
    found = {name: getattr(record, name, None) for name in CONTEXT_FIELDS}
    found.update(getattr(record, "fields", None) or {})
    return {k: v for k, v in found.items() if v is not None}


class ContextFilter(logging.Filter):
    """Copies the context's ids onto each record, so that formatters and the recent buffer see them."""

    def __init__(self, peer: str | None = None) -> None:
        super().__init__()
        self.peer = peer

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in _context.items():
            if getattr(record, name, None) is None:
                setattr(record, name, var.get() or (self.peer if name == "peer" else None))
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, ids and the event's own fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage(), **record_fields(record)}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL logger: message key=value ...``, for people reading a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        fields = record_fields(record)
        fields.pop("peer", None)  # one process, one peer: said once at start, not on every line
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        text = f"{stamp} {record.levelname} {record.name}: {record.getMessage()}" + (f" {extra}" if extra else "")
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class RecentRecords(logging.Handler):
    """The latest records as dicts, for the control API (``meshctl logs``)."""

    def __init__(self, size: int = RECENT_RECORDS) -> None:
        super().__init__()
        self.records: deque[dict[str, Any]] = deque(maxlen=size)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append({
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
            **{k: str(v) for k, v in record_fields(record).items()}})

    def latest(self, lines: int, session: str | None = None) -> list[dict[str, Any]]:
        chosen = [r for r in self.records if session is None or r.get("session") == session]
        return chosen[-lines:] if lines > 0 else []


def configure_logging(level: str, fmt: str, quiet: tuple[str, ...] = (),
                      recent: RecentRecords | None = None) -> ContextFilter:
    """Send every record to stderr in ``fmt`` (and to ``recent``), with the context's ids attached;
    returns the filter, whose ``peer`` names this process's peer once it is known."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")
    context = ContextFilter()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(context)
    handlers: list[logging.Handler] = [handler]
    if recent is not None:
        recent.addFilter(context)
        handlers.append(recent)
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(level.upper())
    for noisy in quiet:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return context
