"""Progress of long work (creating a model, loading a range, the doctor's checks): a bar on a terminal,
plain lines in a log.

A bar is drawn only when stderr is a terminal; elsewhere (a service's journal, a test, a pipe) the
work reports a line at its start, about every tenth of the way and at its end, through the logger or
the ``say`` function it was given, so that logs stay readable and complete.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Say = Callable[[str], None]
LINE_EVERY = 0.1  # of the total, between plain lines


class Progress:
    """``advance()`` as the work goes; the bar or the lines follow."""

    def __init__(self, what: str, total: int, unit: str, say: Say, bar: Any | None) -> None:
        self.what, self.total, self.unit, self.say = what, max(total, 0), unit, say
        self.done = 0
        self.started = time.monotonic()
        self._bar = bar
        self._task = bar.add_task(what, total=self.total or None) if bar is not None else None
        self._next_line = LINE_EVERY

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=f"{self.what} {note}".strip())
            return
        if self.total and self.done / self.total >= self._next_line and self.done < self.total:
            while self._next_line <= self.done / self.total:
                self._next_line += LINE_EVERY
            self.say(f"{self.what}: {self.done}/{self.total} {self.unit}" + (f" ({note})" if note else ""))

    def _finish(self) -> None:
        if self._bar is None:
            took = time.monotonic() - self.started
            self.say(f"{self.what}: {self.done}/{self.total} {self.unit} in {took:.1f}s")


def on_terminal() -> bool:
    return sys.stderr.isatty()


@contextmanager
def progress(what: str, total: int, unit: str = "steps", say: Say | None = None,
             logger: logging.Logger | None = None, draw: bool | None = None) -> Iterator[Progress]:
    """Report the progress of ``total`` units of work named ``what``: a bar when ``draw`` (default: when
    stderr is a terminal), else lines through ``say`` or ``logger``. A daemon passes ``draw=False``:
    its stderr is its log."""
    emit: Say = say or (logger.info if logger is not None else (lambda _m: None))
    if not (on_terminal() if draw is None else draw):
        emit(f"{what}: {total} {unit}")
        p = Progress(what, total, unit, emit, None)
        yield p
        p._finish()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
             TimeElapsedColumn(), transient=False) as bar:
        yield Progress(what, total, unit, emit, bar)
