"""The machine's CPU turn: one holder at a time, handed on when the holder ends or dies."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading

from meshd.runtime.cpu_turn import CpuTurn


def test_one_holder_at_a_time(tmp_path):
    path = tmp_path / "turn.lock"
    first, second = CpuTurn(path), CpuTurn(path)
    order: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    def hold_first() -> None:
        with first.held():
            order.append("first in")
            inside.set()
            release.wait(10)
            order.append("first out")

    def take_second() -> None:
        inside.wait(10)
        with second.held():
            order.append("second in")

    threads = [threading.Thread(target=hold_first), threading.Thread(target=take_second)]
    for t in threads:
        t.start()
    inside.wait(10)
    waiting = threads[1].is_alive()
    release.set()
    for t in threads:
        t.join(10)
    assert waiting and order == ["first in", "first out", "second in"]
    first.close()
    second.close()


def test_a_holder_that_dies_hands_the_turn_on(tmp_path):
    path = tmp_path / "turn.lock"
    code = ("import os, sys; from pathlib import Path; from meshd.runtime.cpu_turn import CpuTurn; "
            "t = CpuTurn(Path(sys.argv[1])); cm = t.held(); cm.__enter__(); print('held', flush=True); "
            "os._exit(0)")
    child = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "held"
    with path.open("rb") as f:  # free again: a non-blocking take succeeds
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def test_a_peer_times_its_numerics_holding_the_turn(tmp_path, tiny_model, monkeypatch):
    """Peers starting together on one machine time their ways one after another, so they choose alike."""
    from meshd.runtime import model_info
    from meshd.runtime.numerics import Choice

    path = tmp_path / "turn.lock"
    held_while_timing: list[bool] = []

    def timing(base, *args, **kwargs):
        with path.open("rb") as f:  # another open file: its take fails while the turn is held
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held_while_timing.append(True)
            else:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                held_while_timing.append(False)
        return Choice(base, {})

    monkeypatch.setattr(model_info, "calibrate", timing)
    turn = CpuTurn(path)
    model_info.choose_numerics(tiny_model, turn=turn)
    path.touch()
    model_info.choose_numerics(tiny_model)
    assert held_while_timing == [True, False]
    with path.open("rb") as f:  # and handed back after
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    turn.close()
