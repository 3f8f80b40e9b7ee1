"""Replay as pure logic: which route a replay runs on, which re-supplied request belongs to which
record, and how a replayed reply compares with the captured one.

A replay runs on exactly one route, without repair (as audits do): a route pinned hop by hop
(``--route``), the best route through given peers (``--peers``, ``--through``), or the best route of
the captured compat key now. The daemon's side (:mod:`meshd.capture.replayer`) does the I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from meshd.capture.records import CapturedRequest
from meshd.tracker.view import Hop, Route, ShardOffer

# how each replay came out; the first two compared replies, the rest could not
IDENTICAL = "identical"
DIFFERS = "differs"
PROMPT_MISMATCH = "prompt_mismatch"    # the request replayed does not tokenize to the captured prompt
REQUEST_MISMATCH = "request_mismatch"  # re-supplied stop settings differ from the captured ones
UNMATCHED = "unmatched"                # a metadata record whose request was not re-supplied
FAILED = "failed"                      # no route, a refusal, a hop failing: the replay did not finish
STATUSES = (IDENTICAL, DIFFERS, PROMPT_MISMATCH, REQUEST_MISMATCH, UNMATCHED, FAILED)

EXIT_IDENTICAL = 0
EXIT_DIFFERS = 1
EXIT_INCOMPLETE = 3  # nothing differs, but not every record could be replayed

_HOP = re.compile(r"^\s*([a-z0-9]+)\s*(?::(\d+):(\d+)|\[(\d+)\s*,\s*(\d+)\)|)\s*$")


class ReplayError(ValueError):
    """A replay that cannot run as asked: the route named does not exist, a peer is unknown..."""


@dataclass(frozen=True)
class HopSpec:
    peer: str                       # a peer id, or enough of its start to name one
    layers: tuple[int, int] | None  # None: whatever the peer holds


def parse_route_spec(text: str) -> list[HopSpec]:
    """``PEER:0:2,PEER:2:4``, ``PEER,PEER`` or what ``Route.describe`` prints (``abcd1234[0,2) ->
    efgh5678[2,4)``): the hops of a route, head first."""
    parts = [p for p in re.split(r"->|,(?![^\[]*\))", text) if p.strip()]  # not the comma of "[0,2)"
    if not parts:
        raise ReplayError("a route names at least one hop (PEER[:START:END], comma-separated, head first)")
    hops = []
    for part in parts:
        match = _HOP.match(part.lower())
        if match is None:
            raise ReplayError(f"not a hop: {part.strip()!r} (expected PEER, PEER:START:END or PEER[START,END))")
        peer, a, b, c, d = match.groups()
        start, end = (a, b) if a is not None else (c, d)
        layers = (int(start), int(end)) if start is not None else None
        if layers is not None and not 0 <= layers[0] < layers[1]:
            raise ReplayError(f"hop {part.strip()!r}: the layer range is empty")
        hops.append(HopSpec(peer, layers))
    return hops


def resolve_peer(prefix: str, candidates: Iterable[str], what: str) -> str:
    """The one candidate peer id starting with ``prefix``."""
    matches = sorted({c for c in candidates if prefix and c.startswith(prefix)})
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ReplayError(f"{prefix!r} names no peer that {what}")
    raise ReplayError(f"{prefix!r} names {len(matches)} peers that {what}; give more of the peer id")


def _offers_of(model_id: str, offers: Iterable[ShardOffer]) -> dict[str, ShardOffer]:
    return {o.peer_id: o for o in offers if o.model_id == model_id}


def pin_route(model_id: str, hops: Sequence[HopSpec], offers: Iterable[ShardOffer], epoch: int,
              entry: str) -> Route:
    """The route ``hops`` name, checked against what each peer serves now: each hop runs exactly the
    layers its peer holds, the hops tile the model, and all of them share one compat key."""
    mine = _offers_of(model_id, offers)
    if not mine:
        raise ReplayError(f"no peer serves {model_id}")
    out: list[Hop] = []
    for spec in hops:
        peer_id = resolve_peer(spec.peer, mine, f"serves {model_id}")
        offer = mine[peer_id]
        if offer.range is None:
            raise ReplayError(f"{peer_id[:12]} has no layers of {model_id} loaded yet")
        if spec.layers is not None and spec.layers != offer.range:
            raise ReplayError(f"{peer_id[:12]} holds layers [{offer.range[0]}, {offer.range[1]}) of {model_id}, not "
                              f"[{spec.layers[0]}, {spec.layers[1]}): a hop runs exactly the layers its peer holds")
        out.append(Hop(peer_id, *offer.range))
    keys = sorted({mine[h.peer_id].compat_key for h in out})
    if len(keys) > 1:
        raise ReplayError(f"the route mixes compat keys {', '.join(k[:12] for k in keys)}: the hops of one route "
                          "must compute alike")
    n_layers = mine[out[0].peer_id].n_layers
    expected = 0
    for hop in out:
        if hop.start != expected:
            raise ReplayError(f"the route does not tile the {n_layers} layers of {model_id}: {hop.peer_id[:12]} "
                              f"starts at layer {hop.start}, the hop before it ends at {expected}")
        expected = hop.end
    if expected != n_layers:
        raise ReplayError(f"the route stops at layer {expected} of {model_id}'s {n_layers}")
    return Route(model_id, keys[0], tuple(out), epoch=epoch, cost_ms=0.0, entry=entry)


def through_constraints(model_id: str, required: Sequence[str], offers: Iterable[ShardOffer],
                        ) -> tuple[str, frozenset[str]]:
    """For a route through every peer of ``required`` (full ids): their compat key, and the peers to
    exclude so that the planner must cover those layers with them (every other peer of that key whose
    range overlaps one of theirs)."""
    mine = _offers_of(model_id, offers)
    ranges: list[tuple[str, tuple[int, int]]] = []
    for peer_id in required:
        offer = mine.get(peer_id)
        if offer is None:
            raise ReplayError(f"{peer_id[:12]} does not serve {model_id}")
        if offer.range is None:
            raise ReplayError(f"{peer_id[:12]} has no layers of {model_id} loaded yet")
        ranges.append((peer_id, offer.range))
    keys = sorted({mine[p].compat_key for p in required})
    if len(keys) != 1:
        raise ReplayError(f"{', '.join(p[:12] for p in required)} compute {model_id} in different compat keys "
                          f"({', '.join(k[:12] for k in keys)}): no route holds them all")
    for i, (a, ra) in enumerate(ranges):
        for b, rb in ranges[i + 1:]:
            if ra[0] < rb[1] and rb[0] < ra[1]:
                raise ReplayError(f"{a[:12]} [{ra[0]}, {ra[1]}) and {b[:12]} [{rb[0]}, {rb[1]}) overlap: no route "
                                  "holds both")
    exclude = frozenset(o.peer_id for o in mine.values()
                        if o.peer_id not in required and o.compat_key == keys[0] and o.range is not None
                        and any(o.range[0] < r[1] and r[0] < o.range[1] for _, r in ranges))
    return keys[0], exclude


# -- comparing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """Where two replies first part: the index, and each side's token there (None: that reply ended)."""

    index: int
    captured: int | None
    replayed: int | None


def first_difference(captured: Sequence[int], replayed: Sequence[int]) -> Difference | None:
    for index, (a, b) in enumerate(zip(captured, replayed, strict=False)):
        if a != b:
            return Difference(index, a, b)
    if len(captured) == len(replayed):
        return None
    index = min(len(captured), len(replayed))
    return Difference(index, captured[index] if index < len(captured) else None,
                      replayed[index] if index < len(replayed) else None)


# -- matching re-supplied requests -----------------------------------------------------------------


class PromptIndex:
    """Metadata records by the keyed hashes of their prompt and stop strings, for matching re-supplied
    requests to them (two requests with one prompt but other stop strings are different requests)."""

    def __init__(self, records: Iterable[CapturedRequest]) -> None:
        self._by: dict[tuple[str, str, str, str, str], list[str]] = {}
        self.keys: dict[tuple[str, str], set[str]] = {}  # (model, kind) -> compat keys to hash with
        for r in records:
            self._by.setdefault((r.model, r.compat_key, r.kind, r.prompt_hash, r.stop_hash), []).append(r.id)
            self.keys.setdefault((r.model, r.kind), set()).add(r.compat_key)

    def compat_keys(self, model: str, kind: str) -> list[str]:
        return sorted(self.keys.get((model, kind), ()))

    def lookup(self, model: str, compat_key: str, kind: str, prompt_hash: str, stop_hash: str) -> list[str]:
        return list(self._by.get((model, compat_key, kind, prompt_hash, stop_hash), ()))


def body_kind(body: object) -> str:
    """``chat`` for a body with messages, ``completion`` for one with a prompt."""
    if not isinstance(body, dict):
        raise ReplayError("a request is a JSON object (an OpenAI request body)")
    if "messages" in body:
        return "chat"
    if "prompt" in body:
        return "completion"
    raise ReplayError("a request body has messages (chat) or a prompt (completion)")


# -- the summary -----------------------------------------------------------------------------------


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts by status and the first difference of each reply that differs."""
    counts = {status: 0 for status in STATUSES}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    compared = counts[IDENTICAL] + counts[DIFFERS]
    return {"records": len(results), "compared": compared, **counts,
            "not_replayed": len(results) - compared,
            "differences": [{"id": r["id"], "first_difference": r.get("first_difference")}
                            for r in results if r["status"] == DIFFERS]}


def exit_code(summary: dict[str, Any]) -> int:
    if summary[DIFFERS]:
        return EXIT_DIFFERS
    return EXIT_INCOMPLETE if summary["not_replayed"] or not summary["records"] else EXIT_IDENTICAL
