"""Links between peers: what this peer measured of its own, what cards publish, and what a planner
reads of any pair.

A decode token crosses one link per hop and one back, and what a crossing costs depends on that link,
not on the planner's own round trip to either end. So every peer measures the links it uses and
publishes a few of them in its card, and a planner looks a pair up in either end's card.

Two quantities are measured, each only from traffic that says something about it:

- the round trip, from small peer requests (gossip probes and exchanges; their replies are tiny). A
  large request spends time being read and handled (a push-pull verifies the cards it carries), so
  requests over ``RTT_SAMPLE_MAX_BYTES`` are no sample;
- the rate, from bulk transfers (weight chunks fetched from a peer): bytes over the wall time from the
  first request to the last reply of a run of transfers, once ``RATE_SAMPLE_BYTES`` have arrived.
  Requests overlap, so that is what the link delivered, its handling on the far side included: a
  lower bound on what it could carry. Without such a run a link's rate stays unknown.

A card carries at most ``MAX_PUBLISHED`` of them (the peers serving layers first, those in the card
already before others, then the most recently measured), in whole microseconds and bits per second:
16 cost at most 800 bytes, and jitter alone re-issues no card (:func:`drifted`). Links left out
are unmeasured to planners, who then assume the defaults. A
card may be signed by a peer that lies: values out of range are dropped one by one, never trusted
and never fatal, and where both ends publish a link the planner takes the worse figures, so that
neither end alone can make a link look better than the other measured it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from meshd.limits import remember
from meshd.wire import card_pb2 as cpb

MAX_PUBLISHED = 16
MAX_TRACKED = 4096           # peers whose links this peer remembers; the least recently measured go first
RTT_SAMPLE_MAX_BYTES = 8 * 1024
RATE_SAMPLE_BYTES = 4 * 1024 * 1024
TRANSFER_GAP_S = 1.0         # a transfer starting later than this after the last one ended starts a new run
PUBLISH_MAX_AGE_S = 120.0    # a round trip measured longer ago than this is not published
RATE_MAX_AGE_S = 3600.0      # nor a rate older than this: bulk transfers are rare, links change slowly
MAX_RTT_US = 60_000_000      # a minute: anything longer is no round trip
MIN_RATE_BPS = 1_000         # 1 kbit/s
MAX_RATE_BPS = 10**13        # 10 Tbit/s
MAX_PEER_ID_CHARS = 64
RTT_DRIFT = 0.5              # a published round trip this much off (and RTT_DRIFT_MS) warrants a new card
RTT_DRIFT_MS = 1.0
RATE_DRIFT = 0.5


@dataclass(frozen=True)
class LinkEstimate:
    """What is known of one link; None where it was not measured."""

    rtt_ms: float | None = None
    rate_bps: float | None = None


UNKNOWN = LinkEstimate()


@dataclass
class _Link:
    rtt_ms: float | None = None
    rtt_at: float = 0.0
    rate_bps: float | None = None
    rate_at: float = 0.0
    run_started: float = 0.0     # the current run of bulk transfers
    run_ended: float = 0.0
    run_bytes: int = 0

    def rtt_fresh(self, now: float) -> bool:
        return self.rtt_ms is not None and now - self.rtt_at <= PUBLISH_MAX_AGE_S

    def rate_fresh(self, now: float) -> bool:
        return self.rate_bps is not None and now - self.rate_at <= RATE_MAX_AGE_S

    def measured_at(self, now: float) -> float | None:
        """When the freshest publishable figure was measured; None when none is."""
        times = [t for t, ok in ((self.rtt_at, self.rtt_fresh(now)), (self.rate_at, self.rate_fresh(now))) if ok]
        return max(times) if times else None


def _smooth(previous: float | None, sample: float) -> float:
    return sample if previous is None else 0.8 * previous + 0.2 * sample


@dataclass
class LinkMeter:
    """This peer's measurements of its links to other peers, from timings the daemon hands in.

    Pure: times are passed in (any monotonic clock, the same for every call).
    """

    capacity: int = MAX_TRACKED
    _links: dict[str, _Link] = field(default_factory=dict)

    def _link(self, peer_id: str) -> _Link:
        return remember(self._links, peer_id, self._links.get(peer_id) or _Link(), self.capacity)

    def record_rtt(self, peer_id: str, elapsed_ms: float, now: float, nbytes: int = 0) -> None:
        """One request answered after ``elapsed_ms``; ``nbytes`` it carried (a large one is no sample)."""
        if nbytes > RTT_SAMPLE_MAX_BYTES or not 0.0 <= elapsed_ms < MAX_RTT_US / 1000:
            return
        link = self._link(peer_id)
        link.rtt_ms, link.rtt_at = _smooth(link.rtt_ms, elapsed_ms), now

    def record_transfer(self, peer_id: str, nbytes: int, started: float, ended: float) -> None:
        """A bulk transfer of ``nbytes`` from (or to) ``peer_id`` between ``started`` and ``ended``;
        transfers that overlap or follow closely form one run, and a run of ``RATE_SAMPLE_BYTES`` is
        one rate sample."""
        if nbytes <= 0 or ended < started:
            return
        link = self._link(peer_id)
        if link.run_bytes == 0 or started > link.run_ended + TRANSFER_GAP_S:
            link.run_started, link.run_ended, link.run_bytes = started, ended, 0
        link.run_started = min(link.run_started, started)
        link.run_ended = max(link.run_ended, ended)
        link.run_bytes += nbytes
        took = link.run_ended - link.run_started
        if link.run_bytes >= RATE_SAMPLE_BYTES and took > 0:
            rate = min(link.run_bytes * 8 / took, float(MAX_RATE_BPS))
            link.rate_bps, link.rate_at = _smooth(link.rate_bps, rate), ended
            link.run_bytes = 0

    def estimate(self, peer_id: str) -> LinkEstimate:
        link = self._links.get(peer_id)
        return UNKNOWN if link is None else LinkEstimate(link.rtt_ms, link.rate_bps)

    def rtt_ms(self, peer_id: str) -> float | None:
        return self.estimate(peer_id).rtt_ms

    def published(self, now: float, serving: Callable[[str], bool] = lambda _p: False,
                  held: Collection[str] = (), limit: int = MAX_PUBLISHED) -> list[cpb.LinkMeasure]:
        """The measures for this peer's card: at most ``limit``, those to peers ``serving`` layers first,
        among them those ``held`` in the card already (so that the set does not churn as gossip
        measures one peer after another), then the most recently measured; none older than
        ``PUBLISH_MAX_AGE_S``. Sorted by peer id, so that an unchanged set signs to the same bytes."""
        fresh = [(peer_id, link, at) for peer_id, link in self._links.items()
                 if (at := link.measured_at(now)) is not None]
        fresh.sort(key=lambda item: (not serving(item[0]), item[0] not in held, -item[2], item[0]))
        out = []
        for peer_id, link, _at in fresh[:limit]:
            rtt_us = max(1, min(MAX_RTT_US, round(link.rtt_ms * 1000))) if link.rtt_ms is not None else 0
            rate_bps = max(MIN_RATE_BPS, min(MAX_RATE_BPS, round(link.rate_bps))) if link.rate_bps is not None else 0
            out.append(cpb.LinkMeasure(peer_id=peer_id, rtt_us=rtt_us if link.rtt_fresh(now) else 0,
                                       rate_bps=rate_bps if link.rate_fresh(now) else 0))
        return sorted(out, key=lambda m: m.peer_id)


def links_of(card: cpb.CapabilityCard) -> dict[str, LinkEstimate]:
    """The links a card publishes, by the far end's peer id. Entries past ``MAX_PUBLISHED``, to the
    card's own peer, with no or an over-long peer id, or repeating a peer are skipped; a value out of
    range counts as not measured."""
    out: dict[str, LinkEstimate] = {}
    for m in card.links[:MAX_PUBLISHED]:
        if not m.peer_id or len(m.peer_id) > MAX_PEER_ID_CHARS or m.peer_id == card.peer_id or m.peer_id in out:
            continue
        rtt = m.rtt_us / 1000 if 0 < m.rtt_us <= MAX_RTT_US else None
        rate = float(m.rate_bps) if MIN_RATE_BPS <= m.rate_bps <= MAX_RATE_BPS else None
        if rtt is not None or rate is not None:
            out[m.peer_id] = LinkEstimate(rtt, rate)
    return out


def drifted(held: Iterable[cpb.LinkMeasure], fresh: Iterable[cpb.LinkMeasure]) -> bool:
    """Whether ``fresh`` differs from the published ``held`` enough to issue a card for it: another
    set of peers, a round trip or rate newly measured, or one that moved by more than the drift
    allowances (jitter alone does not re-issue cards; they carry the latest figures anyway)."""
    old = {m.peer_id: m for m in held}
    new = {m.peer_id: m for m in fresh}
    if old.keys() != new.keys():
        return True
    for peer_id, m in new.items():
        was = old[peer_id]
        if bool(was.rtt_us) != bool(m.rtt_us) or bool(was.rate_bps) != bool(m.rate_bps):
            return True
        if abs(m.rtt_us - was.rtt_us) / 1000 > max(RTT_DRIFT_MS, RTT_DRIFT * was.rtt_us / 1000):
            return True
        if abs(m.rate_bps - was.rate_bps) > RATE_DRIFT * was.rate_bps:
            return True
    return False


class LinkTable:
    """Every link a planner knows: its own measurements for links it is an end of, and for any other
    pair what either end's card publishes (the worse figures where both do).

    Called with a peer id, it is the planner's own round trip to that peer, which is all that
    older callers of the routing ask. ``planner`` is "" when the planner's identity is not known:
    then its measurements are the ones of links from the entry it plans for.
    """

    def __init__(self, planner: str, own: Callable[[str], LinkEstimate],
                 card_of: Callable[[str], cpb.CapabilityCard | None] = lambda _p: None) -> None:
        self.planner = planner
        self._own = own
        self._card_of = card_of
        self._published: dict[str, Mapping[str, LinkEstimate]] = {}

    @classmethod
    def of_round_trips(cls, rtt_ms: Callable[[str], float | None]) -> LinkTable:
        """A table knowing only the planner's round trips (an unknown planner: see the class)."""
        return cls("", lambda peer_id: LinkEstimate(rtt_ms(peer_id), None))

    def __call__(self, peer_id: str) -> float | None:
        return 0.0 if peer_id == self.planner else self._own(peer_id).rtt_ms

    def relayed(self, peer_id: str) -> bool:
        """Whether the peer's card offers relay addresses only (unknown peers: no)."""
        card = self._card_of(peer_id)
        return card is not None and not card.addresses and bool(card.relay_addresses)

    def _published_by(self, peer_id: str) -> Mapping[str, LinkEstimate]:
        if peer_id not in self._published:
            card = self._card_of(peer_id)
            self._published[peer_id] = {} if card is None else links_of(card)
        return self._published[peer_id]

    def link(self, a: str, b: str) -> LinkEstimate:
        """What is known of the link between peers ``a`` and ``b`` (either direction)."""
        if a == b:
            return LinkEstimate(0.0, None)
        if self.planner in (a, b):
            own = self._own(b if a == self.planner else a)
            if own.rtt_ms is not None and own.rate_bps is not None:
                return own
        else:
            own = UNKNOWN
        seen = [e for e in (own, self._published_by(a).get(b), self._published_by(b).get(a)) if e is not None]
        rtts = [e.rtt_ms for e in seen if e.rtt_ms is not None]
        rates = [e.rate_bps for e in seen if e.rate_bps is not None]
        # the planner's own figures stand when it has them; otherwise the worse of what the ends say
        rtt = own.rtt_ms if own.rtt_ms is not None else (max(rtts) if rtts else None)
        rate = own.rate_bps if own.rate_bps is not None else (min(rates) if rates else None)
        return LinkEstimate(rtt, rate)
