"""Prefill workers, sans-IO: when a long prompt's prefill should run on idle replicas of the decode
route's ranges instead of on the route itself, and on which.

A decode route whose hops run other sessions computes a new prompt's prefill between their decode
steps: the prompt waits for them and they wait for its chunks. When another peer serves exactly a
busy hop's layers (same compat key) and runs nothing, it can compute that part of the prefill
instead, keep the KV as a prefix, and the decode hop imports it before the session's first decode
step (:mod:`meshd.runtime.served_model`'s prefix probe): decode never waits on a remote call, and a
hop that cannot import prefills the prefix itself, as without workers.

The estimate, in milliseconds, from what cards say (:class:`~meshd.tracker.view.ShardOffer`), has
two parts on each side: how long the prompt waits for its first token, and how long the steps of the
sessions already running on the hops that prefill it are held up (each such session waits about as
long as the hop computes the prompt's chunks).

* On the route: every hop's prefill of the prefix (its measured prefill time per token, or its
  decode time per token over ``UNMEASURED_PREFILL_GAIN`` while unmeasured) times the load factor its
  sessions put on it (as routes are planned: 1 + 0.5 per session); held up: every hop's prefill
  once per session on it.
* On workers: every worker's prefill of it (an idle replica unloaded; a busy hop without one stays
  its own worker, loaded and holding up its sessions as on the route), every chunk crossing each
  seam of the worker route, and then the slowest hop's import: its KV bytes over the link's rate, a
  round trip per transfer chunk, and encoding and checking at ``SNAPSHOT_CODEC_BYTES_PER_S``.

Workers run when the sum of both parts is smaller. The sums count hops one after another; chunks
overlap across hops on both sides, so both are upper bounds of the same kind.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from meshd.kvtier.snapshots import CHUNK_BYTES
from meshd.tracker.links import LinkTable
from meshd.tracker.routing import UNMEASURED_RATE_BPS, link_rtt_ms
from meshd.tracker.view import Hop, Route, ShardOffer

UNMEASURED_PREFILL_GAIN = 8.0  # a token of a long prefill costs about an eighth of a decode step, until measured
SNAPSHOT_CODEC_BYTES_PER_S = 150e6  # encoding on the worker plus checking and decoding on the hop, per byte
LOAD_PER_SESSION = 0.5  # the load factor routes are planned with


@dataclass(frozen=True)
class WorkerPlan:
    """Who prefills the first ``cut`` tokens of a prompt for each hop of the decode route, and why."""

    hops: tuple[Hop, ...]   # the worker route: one per decode hop, the same layers; a hop may be its own worker
    cut: int
    route_ms: float         # the prompt's wait on the decode route
    route_stall_ms: float   # what the route's running sessions are held up meanwhile, together
    workers_ms: float       # the prompt's wait on the workers, imports included
    workers_stall_ms: float  # what running sessions are held up then (on busy hops that are their own workers)

    @property
    def pays(self) -> bool:
        return self.workers_ms + self.workers_stall_ms < self.route_ms + self.route_stall_ms

    def as_json(self) -> dict[str, object]:
        return {"cut": self.cut, "workers": [h.peer_id for h in self.hops], "route_ms": round(self.route_ms, 1),
                "route_stall_ms": round(self.route_stall_ms, 1), "workers_ms": round(self.workers_ms, 1),
                "workers_stall_ms": round(self.workers_stall_ms, 1), "chosen": self.pays}


def prefill_ms(offer: ShardOffer, tokens: int) -> float:
    """What ``offer``'s peer takes to prefill ``tokens`` tokens through its range, unloaded."""
    if offer.prefill_ms_per_token > 0:
        return tokens * offer.prefill_ms_per_token
    assert offer.range is not None
    layers = offer.range[1] - offer.range[0]
    return tokens * layers * offer.ms_per_layer / UNMEASURED_PREFILL_GAIN


def plan_prefill_workers(route: Route, offers: Iterable[ShardOffer], links: LinkTable, entry: str, cut: int,
                         chunk_tokens: int, sessions: Mapping[str, int] | None = None,
                         exclude: frozenset[str] = frozenset()) -> WorkerPlan | None:
    """The workers for prefilling the first ``cut`` tokens of a prompt that will decode on ``route``, with
    both estimates (:attr:`WorkerPlan.pays` says whether to use them), or None when there is nothing to
    weigh (the route runs nothing, or no idle replica serves a busy hop's layers). ``sessions`` adds
    what the entry knows of its own sessions on each peer to what the cards say; ``exclude``: peers
    not to ask."""
    if cut < 1 or not route.hops:
        return None
    sessions = sessions or {}
    by_peer = {o.peer_id: o for o in offers if o.model_id == route.model_id and o.compat_key == route.compat_key
               and o.range is not None}
    if any(h.peer_id not in by_peer for h in route.hops):
        return None

    def running(peer: str) -> int:
        o = by_peer[peer]
        return max(o.active_sessions + o.queued, sessions.get(peer, 0))

    if not any(running(h.peer_id) for h in route.hops):
        return None
    on_route = {h.peer_id for h in route.hops}
    workers: list[Hop] = []
    for hop in route.hops:
        worker = hop
        if running(hop.peer_id):
            idle = [o for o in by_peer.values() if o.range == (hop.start, hop.end) and o.peer_id not in on_route
                    and o.peer_id not in exclude and not running(o.peer_id)
                    and o.peer_id not in {w.peer_id for w in workers} and o.kv_token_bytes > 0]
            if idle:
                best = min(idle, key=lambda o: (prefill_ms(o, cut) + _import_ms(links, o, hop.peer_id, cut), o.peer_id))
                worker = Hop(best.peer_id, hop.start, hop.end)
        workers.append(worker)
    if all(w == h for w, h in zip(workers, route.hops, strict=True)):
        return None
    def waits(hops: Iterable[Hop]) -> tuple[float, float]:
        """The prompt's wait for ``hops``' prefills, and what their running sessions are held up."""
        own = [(prefill_ms(by_peer[h.peer_id], cut), running(h.peer_id)) for h in hops]
        return sum(ms * (1 + LOAD_PER_SESSION * n) for ms, n in own), sum(ms * n for ms, n in own)

    route_ms, route_stall_ms = waits(route.hops)
    chunks = -(-cut // max(1, chunk_tokens))
    seams = [entry, *(w.peer_id for w in workers)]
    crossings = sum(_latency_ms(links, a, b) for a, b in itertools.pairwise(seams) if a != b)
    imports = max((_import_ms(links, by_peer[w.peer_id], h.peer_id, cut)
                   for w, h in zip(workers, route.hops, strict=True) if w != h), default=0.0)
    prefills_ms, workers_stall_ms = waits(workers)
    return WorkerPlan(tuple(workers), cut, route_ms, route_stall_ms, prefills_ms + chunks * crossings + imports,
                      workers_stall_ms)


def _latency_ms(links: LinkTable, a: str, b: str) -> float:
    known = links.link(a, b)
    return link_rtt_ms(known.rtt_ms, links.relayed(a) or links.relayed(b)) / 2


def _import_ms(links: LinkTable, worker: ShardOffer, hop: str, cut: int) -> float:
    """What the decode hop ``hop`` takes to import ``cut`` tokens of KV from ``worker``: a chunk per
    request, each a round trip, at the link's rate, encoded and checked."""
    nbytes = cut * worker.kv_token_bytes
    known = links.link(hop, worker.peer_id)
    rate = known.rate_bps if known.rate_bps is not None else UNMEASURED_RATE_BPS
    rtt = link_rtt_ms(known.rtt_ms, links.relayed(hop) or links.relayed(worker.peer_id))
    requests = max(1, -(-nbytes // CHUNK_BYTES))
    return requests * rtt + nbytes * 8 / rate * 1000 + nbytes / SNAPSHOT_CODEC_BYTES_PER_S * 1000
