"""Speed claims checked on first use.

A peer's card says how fast it decodes its range, and routes are chosen by it: a peer claiming more
than it has draws traffic it then slows down. The first time this peer's routes use a peer under a
card that claims more than was last measured of it, this peer times it: a speed check of 0 decode
steps and one of :data:`STEPS` (:class:`~meshd.wire.rpc_pb2.SpeedCheck`), both on this peer's clock,
whose difference is ``STEPS`` decode steps of the peer's range with the round trip and the prefill
cancelled out; each is timed :data:`TRIES` times and the fastest kept, since delays only ever add.
A claim more than :data:`TOLERANCE` times the speed measured, allowing for the load the card shows
as routing does, and by :data:`MIN_EXCESS_S` in all, is measured again a moment later; short twice,
the peer is demoted: this peer's routes avoid it wherever others cover its layers (a slow peer is
still better than no route), for as long as its cards claim as much, and it is timed again now and
then in case it was only busy. A card claiming no more than was measured is not timed again; one
claiming more is a new claim. A peer that refuses to be timed for a range its card claims is demoted.

The steps a check asks for are real forwards of the peer's layers on the compute thread its sessions
use, so a slow peer cannot answer quickly by computing them. It could answer without computing, or
be quick for checks and slow for sessions: outputs are compared by audits of real requests, not here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import trio

from meshd.errors import ErrorCode
from meshd.limits import remember
from meshd.rpc import RpcFailed, call
from meshd.tracker.view import MeshView, Route
from meshd.transport.streams import StreamOpener
from meshd.wire import card_pb2 as cpb
from meshd.wire import rpc_pb2 as pb

log = logging.getLogger("meshd.audit")

STEPS = 32
MIN_TIMED_S = 0.1  # the timed steps should take this long at least: quicker ones are timed in more steps
MAX_STEPS = 1024
MAX_CHECK_S = 0.5  # steps beyond STEPS a check may ask for take at most this at the peer's claimed speed
TRIES = 3
MAX_TRIES = 9  # pairs timed while the steps still seem to take no time
TOLERANCE = 4.0
MIN_EXCESS_S = 0.01  # and by this much time in all: below it, scheduling noise could be the cause
CONFIRM_AFTER_S = 2.0
RECHECK_S = 300.0
CHECK_TIMEOUT_S = 30.0
MAX_WAITING = 16  # peers waiting for a check; more are checked at a later use
_NO_VERDICT = (ErrorCode.UNREACHABLE, ErrorCode.RATE_LIMITED, ErrorCode.OVERLOADED, ErrorCode.LEAVING,
               ErrorCode.KV_BUDGET)
MAX_TRACKED = 10_000


def load_factor(card: cpb.CapabilityCard) -> float:
    """The slowdown the card's load accounts for: the factor routing applies to the claim."""
    return 1.0 + card.load.active_sessions * 0.5 + card.load.queued


def check_steps_allowed(decode_tok_s: float) -> int:
    """The most decode steps a speed check may ask of a peer whose card claims ``decode_tok_s``: the
    checking peer asks no more, the checked one refuses more."""
    return min(MAX_STEPS, max(STEPS, int(decode_tok_s * MAX_CHECK_S)))


def claimed_tok_s(card: cpb.CapabilityCard, model_id: str, compat_key: str) -> float:
    for m in card.models:
        if m.model_id == model_id and m.compat_key == compat_key and m.range_end > m.range_start:
            return m.decode_tok_s
    return 0.0


def short_of_claim(claimed: float, measured: float, load: float = 1.0) -> bool:
    """Whether ``measured`` tokens a second fall short of ``claimed`` beyond what tolerance and load allow."""
    return claimed > 0 and measured * TOLERANCE * load < claimed


@dataclass
class SpeedRecord:
    sequence: int     # the card it was checked under (or carried over to)
    model_id: str
    compat_key: str
    claimed: float
    measured: float | None
    demoted: bool
    why: str = ""
    checked_at: float = 0.0  # trio time

    def as_json(self) -> dict:
        return {"claimed_tok_s": round(self.claimed, 2),
                "measured_tok_s": None if self.measured is None else round(self.measured, 2),
                "demoted": self.demoted, "why": self.why or None}


class SpeedChecks:
    """The speed checks of the peers this peer's routes use, one at a time, bounded."""

    def __init__(self, view: MeshView, opener: StreamOpener,
                 on_verdict: Callable[[str], None] = lambda _v: None) -> None:
        self.view = view
        self.opener = opener
        self.on_verdict = on_verdict  # "met", "demoted" or "unanswered", for metrics
        self.records: dict[str, SpeedRecord] = {}
        self._waiting: dict[str, tuple[str, str]] = {}  # peer -> (model, compat key)
        self._wake = trio.Event()

    @property
    def pending(self) -> int:
        """Hops waiting to be timed, or being timed now."""
        return len(self._waiting)

    def of(self, peer_id: str) -> dict | None:
        record = self.records.get(peer_id)
        return record.as_json() if record is not None else None

    def demoted(self) -> dict[str, str]:
        """Peers found short of a claim their current cards still make (no less than the one timed),
        with why: avoided by routes wherever others cover their layers."""
        out = {}
        for peer_id, record in self.records.items():
            if not record.demoted:
                continue
            card = self.view.gossip.live_card(peer_id)
            if card is None or claimed_tok_s(card.card, record.model_id, record.compat_key) < record.claimed:
                continue  # gone, or claiming less: a new claim, timed at its first use
            record.sequence = card.sequence
            out[peer_id] = record.why
        return out

    def avoided(self) -> frozenset[str]:
        """The demoted peers, for a route being planned; a demotion older than :data:`RECHECK_S` is
        timed again now (it stays until the new verdict), and lifted if the peer keeps up by then."""
        demoted = self.demoted()
        now = trio.current_time()
        for peer_id in demoted:
            record = self.records[peer_id]
            if now >= record.checked_at + RECHECK_S:
                self._enqueue(peer_id, record.model_id, record.compat_key)
        return frozenset(demoted)

    def on_route(self, route: Route) -> None:
        """A route is about to be used: check every hop whose card claims more than is known of it."""
        for hop in route.hops:
            if hop.peer_id == self.view.self_id:
                continue
            card = self.view.gossip.live_card(hop.peer_id)
            if card is None:
                continue
            claimed = claimed_tok_s(card.card, route.model_id, route.compat_key)
            held = self.records.get(hop.peer_id)
            if claimed <= 0 or (held is not None and held.sequence == card.sequence):
                continue
            if held is not None and held.measured is not None and claimed <= held.claimed:
                held.sequence = card.sequence  # no more than it claimed when timed: the same verdict
                continue
            self._enqueue(hop.peer_id, route.model_id, route.compat_key)

    def _enqueue(self, peer_id: str, model_id: str, compat_key: str) -> None:
        if peer_id not in self._waiting and len(self._waiting) < MAX_WAITING:
            self._waiting[peer_id] = (model_id, compat_key)
            self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._waiting:
                peer_id, (model_id, compat_key) = next(iter(self._waiting.items()))
                try:
                    await self.check(peer_id, model_id, compat_key)
                finally:
                    self._waiting.pop(peer_id, None)

    async def _time(self, peer_id: str, address: str, model_id: str, compat_key: str, steps: int) -> float:
        request = pb.PeerRequest(speed_check=pb.SpeedCheck(model_id=model_id, compat_key=compat_key, steps=steps))
        started = trio.current_time()
        await call(self.opener, peer_id, address, request, timeout=CHECK_TIMEOUT_S)
        return trio.current_time() - started

    async def _measure(self, peer_id: str, address: str, model_id: str, compat_key: str, most: int,
                       steps: int = STEPS) -> tuple[int, float]:
        """Decode steps timed and their seconds: fastest with, less fastest without (delays only add).

        A delay that met every call without steps and none with them leaves no difference at all,
        which would read as an endless speed; the pairs are then timed again, up to
        :data:`MAX_TRIES` in all. Steps that took less than :data:`MIN_TIMED_S` are timed once more,
        in the number that should take twice that (up to ``most``)."""
        took = await self._measure_steps(peer_id, address, model_id, compat_key, steps)
        if took >= MIN_TIMED_S or steps >= most:
            return steps, took
        steps = min(most, math.ceil(steps * 2 * MIN_TIMED_S / took))
        return steps, await self._measure_steps(peer_id, address, model_id, compat_key, steps)

    async def _measure_steps(self, peer_id: str, address: str, model_id: str, compat_key: str,
                             steps: int) -> float:
        fastest = [float("inf"), float("inf")]
        tries = 0
        while tries < TRIES or (fastest[1] <= fastest[0] and tries < MAX_TRIES):
            fastest[0] = min(fastest[0], await self._time(peer_id, address, model_id, compat_key, 0))
            fastest[1] = min(fastest[1], await self._time(peer_id, address, model_id, compat_key, steps))
            tries += 1
        return max(fastest[1] - fastest[0], 1e-6)

    async def check(self, peer_id: str, model_id: str, compat_key: str) -> SpeedRecord | None:
        """Time ``peer_id`` against its current card; the record, or None when no verdict was reached.
        A measurement short of the claim is taken again after :data:`CONFIRM_AFTER_S`, and the peer is
        demoted only if that one falls short too (a passing burst of load is not a lie)."""
        card = self.view.gossip.live_card(peer_id)
        address = self.view.address_of(peer_id)
        if card is None or address is None:
            return None
        claimed = claimed_tok_s(card.card, model_id, compat_key)
        load = load_factor(card.card)

        def short(steps: int, took: float) -> bool:
            excess = took - steps * TOLERANCE * load / claimed if claimed > 0 else 0.0
            return short_of_claim(claimed, steps / took, load) and excess > MIN_EXCESS_S

        try:
            most = check_steps_allowed(claimed)
            steps, took = await self._measure(peer_id, address, model_id, compat_key, most)
            if short(steps, took):
                await trio.sleep(CONFIRM_AFTER_S)
                again = await self._measure(peer_id, address, model_id, compat_key, most, steps)
                steps, took = min((steps, took), again, key=lambda timed: timed[1] / timed[0])
        except RpcFailed as exc:
            if exc.code in _NO_VERDICT:
                self.on_verdict("unanswered")
                log.info("speed check of %s got no answer: %s", peer_id[:12], exc)
                return None
            why = f"its card claims layers of {model_id} it refused to be timed on ({exc.code}: {exc})"
            return self._record(peer_id, SpeedRecord(card.sequence, model_id, compat_key, claimed, 0.0, True, why))
        measured = steps / took
        demoted = short(steps, took)
        why = (f"its card claims {claimed:.1f} decode tokens/s, {steps} timed steps ran at {measured:.1f}"
               if demoted else "")
        return self._record(peer_id, SpeedRecord(card.sequence, model_id, compat_key, claimed, measured, demoted, why))

    def _record(self, peer_id: str, record: SpeedRecord) -> SpeedRecord:
        record.checked_at = trio.current_time()
        remember(self.records, peer_id, record, MAX_TRACKED)
        self.on_verdict("demoted" if record.demoted else "met")
        if record.demoted:
            log.warning("demoted %s: %s", peer_id[:12], record.why)
        else:
            log.info("speed check of %s: claims %.1f tok/s, measured %.1f", peer_id[:12], record.claimed,
                     record.measured or 0.0)
        return record


__all__ = ["SpeedChecks", "SpeedRecord", "check_steps_allowed", "claimed_tok_s", "load_factor", "short_of_claim"]
