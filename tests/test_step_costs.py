"""The step-cost table: measured figures by size, estimates between and beyond them."""

from __future__ import annotations

import pytest

from meshd.runtime.step_costs import StepCosts, chunk_class


def test_figures_are_smoothed_per_size_and_estimated_between_sizes():
    costs = StepCosts()
    assert costs.decode_s(1) is None
    costs.observe_decode(1, 0.030)
    costs.observe_decode(1, 0.040)  # a fifth of the way to the new figure
    costs.observe_decode(4, 0.060)
    assert costs.decode_s(1) == pytest.approx(0.032)
    assert costs.decode_s(2) == pytest.approx(0.032 + (0.060 - 0.032) / 3)
    assert costs.decode_s(8) == pytest.approx(0.060)  # never tried: taken as free once, then measured
    costs.observe_decode(8, 0.120)
    assert costs.decode_s(8) == pytest.approx(0.120)
    assert costs.summary()["decode_samples"] == {"1": 2, "4": 1, "8": 1}


def test_the_rows_within_a_bound_follow_the_table():
    costs = StepCosts()
    for rows, seconds in ((1, 0.03), (3, 0.035), (4, 0.07), (8, 0.09)):
        costs.observe_decode(rows, seconds)
    assert costs.rows_within(0.05, 16) == 3
    assert costs.rows_within(0.2, 16) == 16
    assert costs.rows_within(0.001, 16) == 1  # a lone step always runs


def test_prefill_chunks_are_kept_by_size_class():
    assert [chunk_class(n) for n in (1, 2, 3, 64, 65, 512)] == [1, 2, 4, 64, 128, 512]
    costs = StepCosts()
    costs.observe_prefill(500, 0.3)
    assert costs.prefill_s(400) == pytest.approx(0.3) and costs.prefill_s(512) == pytest.approx(0.3)
    assert costs.summary()["prefill_ms_by_chunk"] == {"512": 300.0}
    costs.observe_decode(0, 1.0)
    costs.observe_prefill(8, -1.0)  # nonsense is not learned
    assert costs.summary()["decode_ms"] == {} and list(costs.summary()["prefill_ms_by_chunk"]) == ["512"]
