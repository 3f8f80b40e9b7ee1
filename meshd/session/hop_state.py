"""The hop side of a seam as state machines: admission, KV binding, resume after repair, output cache.

Nothing here touches a stream, a thread or a clock. :class:`HopBook` keeps what a hop knows across
all its sessions (the KV bytes it reserved for each, sessions whose route failed and whose KV it keeps
for a while in case the repaired route keeps this hop, and what it sent downstream for each session).
:class:`HopSession` follows one ``(session, epoch)`` through its seam: fed each bundle that arrives
and each result the shard computes, it returns the actions to perform, in order. The Trio adapter
(:mod:`meshd.session.hop`) reads streams, runs the shard and performs the actions.

Resume. When the entry repairs a route, the hops before the first changed one are told so
(``unchanged_prefix``). Such a hop, holding the previous epoch's KV, moves it to the new epoch
instead of recomputing: it passes the outputs it had sent downstream for those positions on again,
and computes only the rest. The last prompt token is always recomputed, so that the tail has logits
to sample from. A hop that resumed nothing makes every hop after it recompute everything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshd.errors import BundleError, ErrorCode, MeshError, RangeMismatch
from meshd.limits import KeyedRates, remember
from meshd.runtime.kv import SessionKey
from meshd.runtime.prefix_kv import prefix_scope
from meshd.runtime.shard import HIDDEN_STATES, StepResult
from meshd.wire import session_pb2 as pb
from meshd.wire.bundle import HiddenStateBundle, Phase

log = logging.getLogger("meshd.session")

RESUME_GRACE_S = 5.0  # how long a failed session's KV waits for a repaired route that keeps this hop
OUTPUT_CACHE_BYTES = 64 * 1024**2  # per session: what a hop keeps of the hidden states it sent downstream


class Refused(MeshError):
    """This hop does not admit the session now; the entry should route around it."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class NextHopFailed(MeshError):
    """The next hop of the route could not be reached or went away; the entry should avoid it."""

    code = ErrorCode.UNREACHABLE

    def __init__(self, peer_id: str, message: str) -> None:
        super().__init__(message)
        self.peer_id = peer_id


MAX_OPENERS = 10_000  # upstream peers whose rate of opens is tracked
SHARING_WINDOW_S = 60.0  # an upstream peer that opened a session this recently shares the hop


@dataclass(frozen=True)
class AdmissionLimits:
    max_sessions: int = 64
    max_queue: int = 32
    opens_per_s: float = 50.0  # sessions one upstream peer may open here per second (bursts of max_sessions)


@dataclass(frozen=True)
class Holding:
    """What this hop serves: its model, compat key and loaded range, and what a token of KV costs it."""

    peer_id: str
    model_id: str
    compat_key: str
    layers: tuple[int, int]
    kv_bytes_per_token: int
    kv_budget_bytes: int | None


# -- actions ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compute:
    """Run ``bundle`` through this hop's shard; feed the result to :meth:`HopSession.on_computed`."""

    bundle: HiddenStateBundle


@dataclass(frozen=True)
class SendDownstream:
    """Send ``bundle`` (already addressed to the next hop's range) on the downstream seam, then tell
    :meth:`HopSession.on_sent` so the output is kept for a resume."""

    bundle: HiddenStateBundle
    computed: bool  # False for outputs passed on from the previous epoch (already kept)


@dataclass(frozen=True)
class SendToken:
    """Send the sampled token for ``position`` to the entry's results stream (the tail only)."""

    position: int
    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


HopAction = Compute | SendDownstream | SendToken


# -- what a hop sent downstream -------------------------------------------------------------------------


class OutputCache:
    """Hidden states a hop sent downstream for one session, in position order, bounded in size.

    A gap in positions or the size bound ends caching for the session: it then has nothing to resume.
    """

    def __init__(self, max_bytes: int = OUTPUT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.parts: list[torch.Tensor] = []
        self.length = 0
        self.nbytes = 0
        self.broken = False

    def append(self, start: int, hidden: torch.Tensor) -> None:
        size = hidden.numel() * hidden.element_size()
        if self.broken or start != self.length or self.nbytes + size > self.max_bytes:
            self.broken, self.parts, self.length, self.nbytes = True, [], 0, 0
            return
        if hidden.untyped_storage().nbytes() > size:  # a row of a batched step: do not keep the whole batch
            hidden = hidden.clone()
        self.parts.append(hidden)
        self.length += hidden.shape[0]
        self.nbytes += size

    def slice(self, start: int, end: int) -> torch.Tensor:
        return torch.cat(self.parts, dim=0)[start:end]

    def truncate(self, length: int) -> None:
        whole = torch.cat(self.parts, dim=0)[:length]
        self.parts, self.length, self.nbytes = [whole], length, whole.numel() * whole.element_size()


# -- every session on this hop ------------------------------------------------------------------------

ResumeKV = Callable[[SessionKey, SessionKey, int], int]
"""``resume_kv(old, new, limit)``: move up to ``limit`` tokens of ``old``'s KV to ``new``; how many moved."""


@dataclass
class HopBook:
    """What a hop knows across its sessions: reservations, KV kept for repair, outputs sent downstream.

    Methods that end a session's state here return the keys whose KV the adapter must release.
    """

    peer_id: str
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    resume_grace_s: float = RESUME_GRACE_S
    output_cache_bytes: int = OUTPUT_CACHE_BYTES
    leaving: bool = False
    _reserved: dict[SessionKey, int] = field(default_factory=dict)
    _retained: dict[SessionKey, float] = field(default_factory=dict)  # key -> kept until (clock time)
    _outputs: dict[SessionKey, OutputCache] = field(default_factory=dict)
    _opens: KeyedRates | None = None  # by upstream peer, made with the limits
    _opened_by: dict[SessionKey, str] = field(default_factory=dict)  # the upstream peer of each session
    _last_open: dict[str, float] = field(default_factory=dict)  # upstream peer -> when it last asked

    @property
    def active_sessions(self) -> int:
        return len(self._reserved)

    def is_reserved(self, key: SessionKey) -> bool:
        return key in self._reserved

    def is_retained(self, key: SessionKey) -> bool:
        return key in self._retained

    def check_open(self, msg: pb.SeamMessage, holding: Holding | None, *, tail_only: bool = False) -> pb.SessionOpen:
        """The ``SessionOpen`` a stream starts with, once it names this hop, its model and its range."""
        if msg.WhichOneof("kind") != "open":
            raise BundleError("a seam stream starts with SessionOpen")
        open_ = msg.open
        if holding is None:
            raise RangeMismatch("this peer holds no layers")
        if open_.model_id != holding.model_id or open_.compat_key != holding.compat_key:
            raise RangeMismatch(f"route is for {open_.model_id} ({open_.compat_key}); this peer serves "
                                f"{holding.model_id} ({holding.compat_key})")
        if not 0 <= open_.hop_index < len(open_.hops):
            raise BundleError(f"hop index {open_.hop_index} outside a route of {len(open_.hops)} hops")
        if tail_only and open_.hop_index != len(open_.hops) - 1:
            raise BundleError("results streams go to the tail of the route")
        me = open_.hops[open_.hop_index]
        if me.peer_id != holding.peer_id or (me.range_start, me.range_end) != holding.layers:
            raise RangeMismatch(f"route names {me.peer_id[:12]} for [{me.range_start}, {me.range_end}); this is "
                                f"{holding.peer_id[:12]} holding [{holding.layers[0]}, {holding.layers[1]})")
        return open_

    def admit(self, open_: pb.SessionOpen, holding: Holding, queued: int, opener: str = "",
              now: float = 0.0) -> SessionKey:
        """Reserve the session's KV against the session limit, the compute queue and the byte budget,
        or refuse with a reason the entry routes around. ``opener``: the upstream peer, whose rate of
        opens is bounded (at ``now``)."""
        key = (open_.session_id, open_.epoch)
        if key in self._reserved:
            raise BundleError(f"session {open_.session_id[:12]} epoch {open_.epoch} is already open here")
        if self.leaving:
            raise Refused(ErrorCode.LEAVING, "this peer is leaving the mesh and takes no new sessions")
        if opener and self.limits.opens_per_s > 0:
            if self._opens is None:
                self._opens = KeyedRates(self.limits.opens_per_s, max(1.0, float(self.limits.max_sessions)),
                                         MAX_OPENERS)
            if not self._opens.allow(opener, now):
                raise Refused(ErrorCode.RATE_LIMITED, f"{opener[:12]} opens sessions faster than "
                              f"{self.limits.opens_per_s:g} a second")
        if opener:
            remember(self._last_open, opener, now, MAX_OPENERS)
        if len(self._reserved) >= self.limits.max_sessions:
            raise Refused(ErrorCode.OVERLOADED,
                          f"{len(self._reserved)} sessions running (limit {self.limits.max_sessions})")
        if opener and self._crowding(opener, now):
            raise Refused(ErrorCode.OVERLOADED, f"{opener[:12]} holds its share of the sessions here, and few are "
                          "left for other peers")
        if queued >= self.limits.max_queue:
            raise Refused(ErrorCode.OVERLOADED, f"{queued} steps queued for compute (limit {self.limits.max_queue})")
        need = max(1, open_.max_tokens) * holding.kv_bytes_per_token
        budget = holding.kv_budget_bytes
        if budget is not None:
            reserved = sum(self._reserved.values())
            if reserved + need > budget:
                raise Refused(ErrorCode.KV_BUDGET, f"session needs {need} KV bytes; {budget - reserved} of "
                              f"{budget} free")
        self._reserved[key] = need
        if opener:
            self._opened_by[key] = opener
        return key

    def _crowding(self, opener: str, now: float) -> bool:
        """Whether one more session from ``opener`` would crowd others out: while other upstream peers
        use this hop too (they asked within :data:`SHARING_WINDOW_S`) and fewer than a quarter of the
        sessions are free, no upstream peer may hold more than half of them. A peer alone may use all."""
        limit = self.limits.max_sessions
        if limit - len(self._reserved) >= max(1, limit // 4):
            return False
        if not any(who != opener and now - at < SHARING_WINDOW_S for who, at in self._last_open.items()):
            return False
        held = sum(1 for who in self._opened_by.values() if who == opener)
        return held >= max(1, limit // 2)

    def resume(self, open_: pb.SessionOpen, resume_kv: ResumeKV, now: float) -> tuple[int, list[SessionKey]]:
        """Keep the previous epoch's KV when every hop up to this one is unchanged: how many tokens of
        the session need no recomputing here (0: compute everything), and keys to release."""
        released = self.expired(now)
        old = (open_.session_id, open_.resume_from_epoch)
        new = (open_.session_id, open_.epoch)
        if old not in self._retained or old == new:
            return 0, released
        if open_.hop_index >= open_.unchanged_prefix:  # a new epoch that cannot use the old one's KV
            del self._retained[old]
            return 0, released + self.forget(old)
        is_tail = open_.hop_index == len(open_.hops) - 1
        outputs = self._outputs.get(old)
        # the last prompt token is always recomputed, so that the tail has logits to sample from
        limit = max(0, open_.prompt_tokens - 1)
        if not is_tail:
            limit = min(limit, outputs.length if outputs is not None else 0)
        kept = resume_kv(old, new, limit) if limit else 0
        del self._retained[old]
        cache = self._outputs.pop(old, None)
        if kept and cache is not None:
            cache.truncate(kept)
            self._outputs[new] = cache
        if kept:
            log.info("session %s: kept %d tokens of epoch %d's KV for epoch %d", open_.session_id[:12], kept,
                     old[1], new[1])
        else:
            released.append(old)
        return kept, released

    def outputs(self, key: SessionKey) -> OutputCache | None:
        return self._outputs.get(key)

    def keep_output(self, key: SessionKey, start: int, hidden: torch.Tensor) -> None:
        cache = self._outputs.get(key)
        if cache is None:
            cache = self._outputs[key] = OutputCache(self.output_cache_bytes)
        cache.append(start, hidden)

    def finish(self, key: SessionKey, *, failed: bool, kv_held: bool, now: float) -> list[SessionKey]:
        """The seam of ``key`` ended; a failed session whose KV is here is kept for a repair, briefly."""
        self._reserved.pop(key, None)
        self._opened_by.pop(key, None)
        if failed and kv_held:
            self._retained[key] = now + self.resume_grace_s
            return []
        return self.forget(key)

    def results_ended(self, key: SessionKey) -> list[SessionKey]:
        """The entry's results stream for ``key`` ended; release the KV unless a seam still owns it."""
        if key in self._reserved or key in self._retained:
            return []
        return self.forget(key)

    def expired(self, now: float) -> list[SessionKey]:
        """Retained sessions whose grace is over: release them."""
        gone = [key for key, until in self._retained.items() if until <= now]
        released: list[SessionKey] = []
        for key in gone:
            del self._retained[key]
            released += self.forget(key)
        return released

    def forget(self, key: SessionKey) -> list[SessionKey]:
        self._outputs.pop(key, None)
        return [key]


# -- one session's seam -------------------------------------------------------------------------------


class HopSession:
    """One ``(session, epoch)`` on this hop: what to do with each bundle that arrives and each result."""

    def __init__(self, book: HopBook, open_: pb.SessionOpen, resumed: int, upstream_peer_id: str = "") -> None:
        """``upstream_peer_id``: who sends this seam's bundles (the entry, for the head); prefix names
        are scoped by it and the entry (:func:`meshd.runtime.prefix_kv.prefix_scope`)."""
        self.book = book
        self.open = open_
        self.prefix_scope = prefix_scope(open_.entry_peer_id, upstream_peer_id)
        self.key: SessionKey = (open_.session_id, open_.epoch)
        self.resumed = resumed
        self.is_tail = open_.hop_index == len(open_.hops) - 1
        self.next_hop: pb.HopAddress | None = None if self.is_tail else open_.hops[open_.hop_index + 1]

    def downstream_open(self) -> pb.SessionOpen | None:
        """The ``SessionOpen`` for the next hop (None on the tail)."""
        if self.next_hop is None:
            return None
        forwarded = pb.SessionOpen()
        forwarded.CopyFrom(self.open)
        forwarded.hop_index = self.open.hop_index + 1
        if not self.resumed:  # what follows gets recomputed inputs: nothing downstream may resume
            forwarded.unchanged_prefix = min(forwarded.unchanged_prefix, self.open.hop_index)
        return forwarded

    def on_bundle(self, bundle: HiddenStateBundle) -> list[HopAction]:
        """A bundle arrived from upstream: pass on what the previous epoch computed, compute the rest."""
        if (bundle.session_id, bundle.epoch) != self.key:
            raise BundleError("bundle belongs to another session than its stream")
        bundle.prefix_scope = self.prefix_scope
        actions: list[HopAction] = []
        cache = self.book.outputs(self.key)
        if bundle.phase == Phase.DECODE and cache is not None and bundle.start_position < cache.length:
            cache.truncate(bundle.start_position)  # drafted positions the tail did not accept
        if bundle.start_position < self.resumed:
            cut = min(self.resumed, bundle.end_position)
            if self.next_hop is not None:
                cache = self.book.outputs(self.key)
                if cache is None:
                    raise BundleError("resumed session has no kept outputs")
                kept = cache.slice(bundle.start_position, cut)
                actions.append(SendDownstream(self._downstream(bundle.part(bundle.start_position, cut,
                                                                           {HIDDEN_STATES: kept})), computed=False))
            if cut == bundle.end_position:
                return actions
            bundle = bundle.part(cut, bundle.end_position)
        actions.append(Compute(bundle))
        return actions

    def on_computed(self, bundle: HiddenStateBundle, result: StepResult) -> list[HopAction]:
        """The shard ran ``bundle``: hidden states go downstream, a sampled token to the entry."""
        if self.next_hop is not None:
            if result.hidden_states is None:
                raise BundleError("the shard returned no hidden states for the next hop")
            out = bundle.part(bundle.start_position, bundle.end_position, {HIDDEN_STATES: result.hidden_states})
            return [SendDownstream(self._downstream(out), computed=True)]
        if result.token is None:
            return []
        first = bundle.end_position - len(bundle.draft)  # the position after the step's first token
        return [SendToken(first + i, r.token, r.logprob, tuple(r.top_logprobs))
                for i, r in enumerate([result, *result.following]) if r.token is not None]

    def on_sent(self, action: SendDownstream) -> None:
        """A computed output went downstream: keep it for a resume (after sending, so the next hop
        never waits for the copy)."""
        if action.computed:
            self.book.keep_output(self.key, action.bundle.start_position, action.bundle.tensors[HIDDEN_STATES])

    def _downstream(self, bundle: HiddenStateBundle) -> HiddenStateBundle:
        assert self.next_hop is not None
        bundle.range_start, bundle.range_end = self.next_hop.range_start, self.next_hop.range_end
        return bundle
