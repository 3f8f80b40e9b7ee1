"""Judging an audit: the same greedy replay on routes that differ in the peer at one position.

Without IO. Honest peers of one numerics class compute token-identical replies (a split is exact), so
when three routes differ only in the peer that computes one range, and two of them agree while the
third does not, the third's peer at that position computed wrong. Two routes alone cannot say which
of their two peers lied, so a verdict needs three; with fewer, or when more than one peer differs, or
when no two agree, the audit only says so.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Outcome(enum.StrEnum):
    CONSISTENT = "consistent"    # every route agreed
    GUILTY = "guilty"            # ``culprit`` computed wrong
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Replay:
    peers: frozenset[str]        # the route's peers
    tokens: tuple[int, ...]      # its greedy reply to the audit's prompt


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    culprit: str | None = None
    expected: tuple[int, ...] = ()  # what the agreeing routes produced
    got: tuple[int, ...] = ()       # what the culprit's route produced
    cleared: frozenset[str] = frozenset()  # peers on routes that agreed with the majority


def judge(replays: Sequence[Replay]) -> Verdict:
    """The verdict on replays of one prompt (each a distinct route of the same numerics class)."""
    if len(replays) < 2:
        return Verdict(Outcome.INCONCLUSIVE)
    if len({r.tokens for r in replays}) == 1:
        return Verdict(Outcome.CONSISTENT, cleared=frozenset().union(*(r.peers for r in replays)))
    groups: dict[tuple[int, ...], list[Replay]] = {}
    for replay in replays:
        groups.setdefault(replay.tokens, []).append(replay)
    if len(groups) != 2:
        return Verdict(Outcome.INCONCLUSIVE)
    (big, odd) = sorted(groups.values(), key=len, reverse=True)
    if len(odd) != 1 or len(big) < 2:
        return Verdict(Outcome.INCONCLUSIVE)
    majority = frozenset().union(*(r.peers for r in big))
    # the odd route's own peers: in none of the agreeing routes. Exactly one, or the audit cannot say
    # which; and the agreeing routes must not share a peer the odd one lacks (it could be their liar).
    only_odd = odd[0].peers - majority
    shared = frozenset.intersection(*(r.peers for r in big)) - odd[0].peers
    if len(only_odd) != 1 or shared:
        return Verdict(Outcome.INCONCLUSIVE)
    (culprit,) = only_odd
    return Verdict(Outcome.GUILTY, culprit, big[0].tokens, odd[0].tokens, cleared=majority)
