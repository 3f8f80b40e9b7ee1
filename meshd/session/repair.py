"""Repair as a state machine: whom to blame when an attempt fails, when to re-route, how long to wait.

The entry keeps the whole token history of a generation, so a failed attempt costs only a re-prefill:
the entry asks for a new route (epoch + 1) without the peer at fault, re-sends prompt + tokens so
far, and goes on. Hops before the first changed one keep their KV (``unchanged_prefix``).

- Blame. A failure names the peer at fault. A refusal (overloaded, KV budget, leaving) keeps that
  peer out of this generation's routes for ``blame_s``; a peer that failed (unreachable, a closed
  seam, declared dead) is also reported unreachable, so other generations avoid it too. A cache miss
  or position mismatch is no fault of the peer that reports it: nobody is blamed.
- Stalls. A step timeout names nobody: every peer of the stalled route is avoided for ``blame_s``,
  so the next route replaces as many of them as the mesh can (the stalled peer among them, when
  another peer holds its layers).
- Re-route. Each failure starts a new attempt at once, on the best route without the blamed peers,
  while attempts (``attempts``) and time (``budget_s`` since the first failure) remain.
- Coverage. When no complete route exists, a generation that has started waits for the missing
  range to come back (a peer restarting, a relay coming back, gossip catching up), asking again with
  exponential backoff until its repair budget is spent. Only a request that has not started yet is
  answered "no route" at once, so the client can retry elsewhere.

:class:`RepairPolicy` holds that state for one generation. It is fed failures, empty plans, new
routes and tokens, with the current time, and answers with what to do next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshd.errors import ErrorCode, MeshError
from meshd.session.attempt import SessionFailed
from meshd.tracker.view import Route

REFUSALS = frozenset({ErrorCode.OVERLOADED, ErrorCode.KV_BUDGET, ErrorCode.LEAVING, ErrorCode.RATE_LIMITED})
NOBODYS_FAULT = frozenset({ErrorCode.CACHE_MISS, ErrorCode.POSITION_MISMATCH})


@dataclass(frozen=True)
class RepairConfig:
    attempts: int = 5            # routes tried after the first, for one generation
    budget_s: float = 60.0       # time a generation may spend repairing, from its first failure
    blame_s: float = 5.0         # how long a blamed peer stays out of this generation's routes
    backoff_s: float = 0.25      # first wait before asking again for a route that covers the model
    backoff_max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.budget_s < 0 or self.blame_s < 0:
            raise ValueError("repair attempts, budget and blame time cannot be negative")
        if not 0 < self.backoff_s <= self.backoff_max_s:
            raise ValueError("repair backoff must be positive and at most its maximum")


class NoCompleteRoute(MeshError):
    """No live peers cover every layer of the model; ``missing`` lists the ranges nobody holds."""

    code = ErrorCode.NO_ROUTE

    def __init__(self, model_id: str, missing: Sequence[tuple[int, int]]) -> None:
        gaps = ", ".join(f"[{s}, {e})" for s, e in missing) or "none (peers excluded or incompatible)"
        super().__init__(f"no complete route for {model_id}: layers not covered: {gaps}")
        self.model_id = model_id
        self.missing = list(missing)


class AllRefused(MeshError):
    """Every route's peers refused the session (at capacity, or leaving)."""

    code = ErrorCode.OVERLOADED


class RepairFailed(MeshError):
    """The generation failed and its attempts or repair time ran out; names the last cause."""

    code = ErrorCode.ROUTE_FAILED


@dataclass(frozen=True)
class RouteChoice:
    """What the next route must and should be: without ``exclude``, with as few of ``avoid`` as it
    can, favouring ``keep`` (the peers that hold the session's KV)."""

    exclude: frozenset[str]
    keep: frozenset[str]
    avoid: frozenset[str]


@dataclass(frozen=True)
class Wait:
    """No route covers the model now: ask again at ``until``."""

    until: float
    cause: str


@dataclass
class RepairPolicy:
    config: RepairConfig = field(default_factory=RepairConfig)
    attempt: int = 0                       # the epoch of the attempt that runs (or ran) last
    ran_epoch: int = 0                     # the epoch the last attempt actually ran under: hops keep KV by it
    repairing_since: float | None = None   # the first failure
    cause: str = ""
    refusals: list[str] = field(default_factory=list)
    _blamed: dict[str, float] = field(default_factory=dict)  # peer -> excluded until
    _suspected: dict[str, float] = field(default_factory=dict)  # peer -> avoided until
    _previous: Route | None = None
    _started_any: bool = False
    _waits: int = 0
    _pending_repair: tuple[float, str] | None = None  # (failed at, position of the lost hop)

    # -- starting attempts ----------------------------------------------------------------------------

    def choice(self, now: float) -> RouteChoice:
        """The next plan: without the peers blamed recently, avoiding the suspected ones, keeping the
        last route's others."""
        excluded = frozenset(p for p, until in self._blamed.items() if until > now)
        avoid = frozenset(p for p, until in self._suspected.items() if until > now) - excluded
        keep = frozenset(h.peer_id for h in self._previous.hops) - excluded if self._previous else frozenset()
        return RouteChoice(exclude=excluded, keep=keep, avoid=avoid)

    def begin(self, route: Route) -> tuple[int, int, int]:
        """An attempt starts on ``route``: its epoch, the epoch it may resume from, and how many leading
        hops it shares with the last route that ran."""
        if self._started_any:
            self.attempt += 1
        unchanged = 0
        if self._previous is not None:
            for old_hop, new_hop in zip(self._previous.hops, route.hops, strict=False):
                if old_hop != new_hop:
                    break
                unchanged += 1
        resume_from = self.ran_epoch
        self._previous = route
        self._started_any = True
        self.ran_epoch = self.attempt
        self._waits = 0
        return self.attempt, resume_from, unchanged

    # -- outcomes -----------------------------------------------------------------------------------

    def on_failure(self, failure: SessionFailed, generated: int, route: Route, now: float) -> str | None:
        """An attempt failed after ``generated`` tokens in all: blame, so that the next plan routes
        around the fault (or raise when the repair is out of attempts or time). Returns the peer to
        report unreachable to the rest of this peer, if any."""
        self.cause = f"{failure.code}: {failure.message}"
        if self.repairing_since is None:
            self.repairing_since = now
        blamed = failure.peer_id
        if generated and self._pending_repair is None:
            self._pending_repair = (now, route.position_of(blamed))
        unreachable = None
        if failure.code in REFUSALS:
            self.refusals.append(f"{blamed[:12]}: {failure.code}")
        if blamed and failure.code not in NOBODYS_FAULT:
            self._blamed[blamed] = now + self.config.blame_s
            if failure.code not in REFUSALS:
                unreachable = blamed
        elif failure.code == ErrorCode.STEP_TIMEOUT:
            # a stalled route names nobody: avoid all of its peers, so that the next route replaces
            # as many of them as the mesh allows, and one stall cannot repeat on the same peers
            for hop in route.hops:
                self._suspected[hop.peer_id] = now + self.config.blame_s
        self._check_budget(generated, now)
        return unreachable

    def on_no_route(self, model_id: str, missing: Sequence[tuple[int, int]], generated: int, now: float) -> Wait:
        """The planner found no complete route: wait for coverage to come back (or raise)."""
        if not self._started_any:
            raise NoCompleteRoute(model_id, missing)
        if not generated and self.refusals:
            raise AllRefused("; ".join(self.refusals))
        gap = NoCompleteRoute(model_id, missing)
        self.cause = str(gap)
        if self.repairing_since is None:
            self.repairing_since = now
        if now - self.repairing_since >= self.config.budget_s:
            raise RepairFailed(f"{gap} (waited {now - self.repairing_since:.1f}s for it to come back)")
        delay = min(self.config.backoff_max_s, self.config.backoff_s * 2**self._waits)
        self._waits += 1
        until = min(now + delay, self.repairing_since + self.config.budget_s)
        # a peer blamed earlier may be back by then: its exclusion ends no later than the wait
        return Wait(until=until, cause=str(gap))

    def on_token(self, now: float) -> tuple[float, str] | None:
        """A token arrived: the repair that brought it, as (milliseconds it took, the lost hop's position)."""
        if self._pending_repair is None:
            return None
        failed_at, position = self._pending_repair
        self._pending_repair = None
        return (now - failed_at) * 1000, position

    def _check_budget(self, generated: int, now: float) -> None:
        assert self.repairing_since is not None
        out_of_attempts = self.attempt >= self.config.attempts
        out_of_time = now - self.repairing_since > self.config.budget_s
        if not (out_of_attempts or out_of_time):
            return
        if not generated and self.refusals:
            raise AllRefused("; ".join(self.refusals))
        limit = (f"{self.config.attempts} repairs" if out_of_attempts
                 else f"{self.config.budget_s:g}s of repair")
        raise RepairFailed(f"{self.cause} (after {limit})")
