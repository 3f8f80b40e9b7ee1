"""Progress of long work as plain lines where there is no terminal (logs, pipes)."""

from __future__ import annotations

from meshd.progress import progress


def test_off_a_terminal_progress_is_a_line_at_the_start_every_tenth_and_the_end() -> None:
    lines: list[str] = []
    with progress("loading layers [0, 40)", 40, "layers", say=lines.append, draw=False) as bar:
        for _ in range(40):
            bar.advance()
    assert lines[0] == "loading layers [0, 40): 40 layers"
    assert lines[-1].startswith("loading layers [0, 40): 40/40 layers in ")
    middle = lines[1:-1]
    assert len(middle) == 9 and middle[0] == "loading layers [0, 40): 4/40 layers", middle


def test_a_bar_draws_on_the_terminal_and_says_nothing_in_lines(capsys) -> None:
    lines: list[str] = []
    with progress("generating weights", 3, "tensors", say=lines.append, draw=True) as bar:
        for _ in range(3):
            bar.advance()
    assert lines == []
