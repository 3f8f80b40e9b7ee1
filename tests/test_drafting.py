"""Draft sources and the choice of how many tokens a step guesses."""

from __future__ import annotations

from meshd.session.drafting import DraftLength, NgramDrafter


def test_ngram_lookup_follows_the_latest_earlier_occurrence_and_loops():
    drafter = NgramDrafter()
    assert drafter.draft([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    # the context grew by a token: indexed incrementally, and the longest match wins
    assert drafter.draft([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    # a loop is followed around past the end of what was seen
    assert NgramDrafter().draft([5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]
    assert NgramDrafter().draft([1, 2, 3], 4) == []  # nothing repeats: no guess
    assert drafter.draft([7, 8, 7], 1) == [8]  # another context: indexed afresh


def test_many_guesses_where_steps_cost_their_round_trip_few_where_they_cost_compute():
    link_bound = DraftLength(max_draft=8)
    compute_bound = DraftLength(max_draft=8)
    for i in range(60):
        positions = 1 + (i % 9)
        link_bound.record(positions - 1, (positions - 1) // 2, positions, 0.060 + 0.001 * positions)
        compute_bound.record(positions - 1, (positions - 1) // 2, positions, 0.010 * positions)
    assert link_bound.choose(8) >= 3
    assert compute_bound.choose(8) == 0


def test_acceptance_drives_the_guess_count_and_limits_bind():
    good, bad = DraftLength(max_draft=8), DraftLength(max_draft=8)
    for i in range(60):
        positions = 1 + (i % 9)
        good.record(positions - 1, positions - 1, positions, 0.05 + 0.002 * positions)  # every guess right
        bad.record(positions - 1, 0, positions, 0.05 + 0.002 * positions)               # every guess wrong
    assert good.acceptance > 0.9 and bad.acceptance < 0.1
    assert good.choose(8) == 8 and good.choose(3) == 3 and good.choose(0) == 0
    chosen = [bad.choose(8) for _ in range(32)]
    assert max(chosen) <= 1 and chosen.count(1) >= 1  # none, but one guess now and then to notice a change
    assert DraftLength(max_draft=2).choose(8) == 2


def test_guesses_right_in_runs_are_worth_long_drafts():
    """Half the steps' guesses are all right, half wrong from the first: one acceptance rate (50 %)
    would stop at a few guesses; per position, the later ones are right whenever the first was."""
    runs = DraftLength(max_draft=8)
    for i in range(60):
        runs.record(8, 8 if i % 2 else 0, 9, 0.060 + 0.001 * 9 * (i % 3))
    assert 0.3 < runs.acceptance < 0.7
    assert runs.expected_tokens(8) > 4.0
    assert runs.choose(8) == 8


def test_a_vocabulary_fingerprint_belongs_to_its_tokenizer_not_to_a_reused_object_id():
    from meshd.session.drafting import vocab_fingerprint

    class Vocab:
        def __init__(self, words: dict[str, int]) -> None:
            self.words = words

        def get_vocab(self) -> dict[str, int]:
            return self.words

    first = vocab_fingerprint(Vocab({"a": 0, "b": 1}))  # gone at once: its id may be handed out again
    for _ in range(20):
        assert vocab_fingerprint(Vocab({"a": 0, "c": 1})) != first
    assert vocab_fingerprint(Vocab({"a": 0, "b": 1})) == first
