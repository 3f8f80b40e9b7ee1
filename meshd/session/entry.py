"""The entry side of sessions on Trio: run attempts on routes, repair them, hand out tokens.

:func:`run_attempt` drives one :class:`~meshd.session.attempt.EntryAttempt` over real streams: it
dials the tail's results stream and the head's seam, reads both (and gossip's verdict on the hops)
into one queue of events, and performs what the attempt returns. :class:`EntrySessions` runs whole
generations: one attempt after another on the routes a :class:`RouteSource` plans, as
:class:`~meshd.session.repair.RepairPolicy` decides, until the reply is complete. Every hop releases
the session when the entry closes it or goes away.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import trio

from meshd.errors import ErrorCode, MeshError
from meshd.logs import bind_log_context, route_id
from meshd.metrics import PeerMetrics
from meshd.rpc import RpcFailed, call
from meshd.runtime.prefix_kv import MAX_PROBED_PREFIXES
from meshd.session import messages as m
from meshd.session.attempt import (
    AttemptEvent,
    Draft,
    Emit,
    EntryAttempt,
    GeneratedToken,
    HopDead,
    Received,
    SendToHead,
    SessionFailed,
    SessionPlan,
    Source,
    Speculation,
    StreamBroken,
    StreamEnded,
)
from meshd.session.drafting import Drafter, DraftLength, DraftModel, DraftStats, LookupThenModel, NgramDrafter
from meshd.session.prefill_workers import WorkerPlan, plan_prefill_workers
from meshd.session.prefixes import KnownPrefix, PrefixMap, PromptPrefixes, entry_key, plan_prefixes
from meshd.session.repair import RepairConfig, RepairPolicy
from meshd.tracker.links import LinkTable
from meshd.tracker.routing import NoRouteError
from meshd.tracker.view import Route, ShardOffer
from meshd.transport.errors import TransportError
from meshd.transport.streams import MessageStream, StreamOpener
from meshd.wire import bundle as wire
from meshd.wire import rpc_pb2 as rpb
from meshd.wire import session_pb2 as pb
from meshd.wire.bundle import Sampling

log = logging.getLogger("meshd.session")

WorkerView = Callable[[], tuple[list[ShardOffer], LinkTable, dict[str, str]]]
"""What prefill workers are chosen from: the live offers, the links, and every live peer's address."""

HEALTH_INTERVAL_S = 0.2  # how often an attempt checks gossip's verdict on its hops
PREFIX_PROBE_TIMEOUT_S = 10.0  # a hop may import a prefix from the KV tier before it answers
STATS_WINDOW = 20000


class DeadlinePassed(MeshError):
    """The request ran past its deadline; its session was released everywhere."""

    code = ErrorCode.DEADLINE_EXCEEDED


@dataclass(frozen=True)
class PlannedRoute:
    route: Route
    addresses: dict[str, str]  # peer id -> address to dial
    source: str                # who planned it: the tracker, or this peer


class RouteSource(Protocol):
    """Where an entry's routes come from, and what it learns about peers while using them."""

    async def route_for(self, model_id: str, exclude: frozenset[str] = frozenset(),
                        keep: frozenset[str] = frozenset(), avoid: frozenset[str] = frozenset(),
                        compat_key: str = "") -> PlannedRoute:
        """The best route now without ``exclude``, with as few of ``avoid`` as it can, favouring ``keep``,
        through peers of ``compat_key`` when given; :class:`~meshd.tracker.routing.NoRouteError` when none
        covers the model."""
        ...

    def is_alive(self, peer_id: str) -> bool: ...

    def mark_unreachable(self, peer_id: str) -> None: ...

    def demote(self, peer_id: str, why: str) -> None:
        """``peer_id``'s card claimed what the peer does not serve."""
        ...


# -- one attempt -------------------------------------------------------------------------------------


async def run_attempt(opener: StreamOpener, entry_peer_id: str, plan: SessionPlan,
                      alive: Callable[[str], bool] | None, out: trio.MemorySendChannel[GeneratedToken],
                      on_prefix: Callable[[KnownPrefix | None], None] | None = None) -> None:
    """Drive one attempt; send each token to ``out``, then close it. Raises ``SessionFailed``.
    ``on_prefix`` is told which kept prefix the prefill starts after, when the plan knows any."""
    prefix = await held_prefix(opener, entry_peer_id, plan) if plan.known_prefixes else None
    if on_prefix is not None and plan.known_prefixes:
        on_prefix(prefix)
    attempt = EntryAttempt(plan, entry_peer_id, trio.current_time(), prefix)
    results: MessageStream | None = None
    head: MessageStream | None = None
    async with out:
        try:
            results = await _dial(opener, attempt.tail.peer_id, attempt.tail.address, m.RESULTS_PATH)
            await _send(results, m.open_msg(attempt.open_for(len(attempt.hops) - 1)), attempt.tail.peer_id)
            with trio.move_on_at(attempt.deadline) as waited:
                first = await results.receive_message()
            if waited.cancelled_caught:
                attempt.on_timeout(trio.current_time())
            if first is None:
                raise SessionFailed(ErrorCode.SEAM_CLOSED, "the results stream ended before it opened",
                                    attempt.tail.peer_id)
            attempt.on_results_open(_parse(first, attempt.tail.peer_id), trio.current_time())
            head = await _dial(opener, attempt.head.peer_id, attempt.head.address, m.SEAM_PATH)
            await _send(head, m.open_msg(attempt.open_for(0)), attempt.head.peer_id)
            events_in, events = trio.open_memory_channel[AttemptEvent](math.inf)
            failure: SessionFailed | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_into, results, events_in.clone(), Source.RESULTS, attempt.tail.peer_id)
                nursery.start_soon(_read_into, head, events_in.clone(), Source.SEAM, attempt.head.peer_id)
                if alive is not None:
                    nursery.start_soon(_watch_hops, alive, [h.peer_id for h in attempt.hops], events_in.clone())
                events_in.close()
                try:
                    await _perform(attempt, attempt.start(trio.current_time()), head, out)
                    while not attempt.done:
                        with trio.move_on_at(attempt.deadline) as waited:
                            event = await events.receive()
                        if waited.cancelled_caught:
                            attempt.on_timeout(trio.current_time())
                            continue
                        await _perform(attempt, attempt.on_event(event, trio.current_time()), head, out)
                except SessionFailed as exc:
                    failure = exc
                nursery.cancel_scope.cancel()
            if failure is not None:
                raise failure
        finally:
            if head is not None:
                await m.finish_stream(head, m.CLOSE)
            if results is not None:
                await m.finish_stream(results)


async def held_prefix(opener: StreamOpener, entry_peer_id: str, plan: SessionPlan) -> KnownPrefix | None:
    """The longest of the plan's known prefixes that every hop of its route still holds, asked of all
    hops at once; None when any hop holds none of them, or does not answer in time (the session then
    prefills everything: a prefix only ever saves work)."""
    hops = plan.route.hops
    held: list[set[bytes]] = [set() for _ in hops]
    candidates = list(plan.known_prefixes)[:MAX_PROBED_PREFIXES]

    async def ask(i: int) -> None:
        upstream = hops[i - 1].peer_id if i else entry_peer_id
        source, source_upstream = plan.prefix_sources[i] if plan.prefix_sources else ("", "")
        request = rpb.PeerRequest(prefix_probe=rpb.PrefixProbe(
            model_id=plan.route.model_id, compat_key=plan.route.compat_key, upstream_peer_id=upstream,
            names=[k.name for k in candidates], lengths=[k.position for k in candidates],
            source_peer_id=source, source_upstream_peer_id=source_upstream))
        try:
            reply = await call(opener, hops[i].peer_id, plan.addresses[hops[i].peer_id], request,
                               timeout=PREFIX_PROBE_TIMEOUT_S)
        except RpcFailed as exc:
            log.info("session %s: %s did not say which prefixes it holds (%s)", plan.session_id[:12],
                     hops[i].peer_id[:12], exc)
            return
        if reply.WhichOneof("body") == "prefix_held":
            held[i] = set(reply.prefix_held.names)

    async with trio.open_nursery() as nursery:
        for i in range(len(hops)):
            nursery.start_soon(ask, i)
    return next((k for k in candidates if all(k.name in names for names in held)), None)


async def _perform(attempt: EntryAttempt, actions: Sequence[SendToHead | Emit | Draft], head: MessageStream,
                   out: trio.MemorySendChannel[GeneratedToken]) -> None:
    """Send bundles to the head and tokens to ``out``, in order; a token is passed on even when the
    route failed right after it (the token itself is good). Drafts are asked for here: on the event
    loop when the drafter is cheap, else in a worker thread."""
    failure: SessionFailed | None = None
    for action in actions:
        if isinstance(action, Emit):
            await out.send(action.token)
        elif isinstance(action, Draft):
            tokens = await _drafted(attempt, action)
            await _perform(attempt, attempt.on_drafted(tokens, action.k, trio.current_time()), head, out)
        elif failure is None:
            action.bundle.sent_at_ns = time.time_ns()
            try:
                await head.send_message(m.bundle_msg(wire.encode(action.bundle)))
            except (TransportError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                failure = SessionFailed(ErrorCode.UNREACHABLE, f"the seam to the head: {exc}", attempt.head.peer_id)
    if failure is not None:
        raise failure


async def _drafted(attempt: EntryAttempt, action: Draft) -> list[int]:
    """The drafter's guesses; none when it fails (the step then goes without: a guess is never needed)."""
    spec = attempt.plan.speculation
    assert spec is not None
    try:
        if spec.drafter.inline:
            return spec.drafter.draft(action.context, action.k)
        return await trio.to_thread.run_sync(spec.drafter.draft, action.context, action.k)
    except Exception:
        log.exception("session %s: the %s drafter failed; this step guesses nothing", attempt.plan.session_id,
                      spec.drafter.source)
        return []


async def _watch_hops(alive: Callable[[str], bool], peer_ids: list[str],
                      sink: trio.MemorySendChannel[AttemptEvent]) -> None:
    """Tell the attempt as soon as gossip declares a hop of the route dead."""
    async with sink:
        while True:
            for peer_id in peer_ids:
                if not alive(peer_id):
                    await sink.send(HopDead(peer_id))
                    return
            await trio.sleep(HEALTH_INTERVAL_S)


async def _dial(opener: StreamOpener, peer_id: str, address: str, path: str) -> MessageStream:
    try:
        return await opener.open_stream(peer_id, address, path)
    except Exception as exc:
        raise SessionFailed(ErrorCode.UNREACHABLE, f"cannot reach {address}: {exc}", peer_id) from exc


async def _send(stream: MessageStream, data: bytes, peer_id: str) -> None:
    try:
        await stream.send_message(data)
    except Exception as exc:
        raise SessionFailed(ErrorCode.UNREACHABLE, f"the stream went away: {exc}", peer_id) from exc


def _parse(raw: bytes, peer_id: str) -> pb.SeamMessage:
    try:
        return m.parse(raw)
    except MeshError as exc:
        raise SessionFailed(exc.code, str(exc), peer_id) from None


async def _read_into(stream: MessageStream, sink: trio.MemorySendChannel[AttemptEvent], source: Source,
                     peer_id: str) -> None:
    async with sink:
        try:
            while True:
                raw = await stream.receive_message()
                if raw is None:
                    await sink.send(StreamEnded(source, peer_id))
                    return
                await sink.send(Received(source, peer_id, m.parse(raw)))
        except (TransportError, OSError, trio.BrokenResourceError) as exc:
            await sink.send(StreamBroken(source, peer_id, ErrorCode.UNREACHABLE, str(exc)))
        except MeshError as exc:
            await sink.send(StreamBroken(source, peer_id, exc.code, str(exc)))


# -- whole generations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    """What one request asks of the mesh, once tokenized."""

    session_id: str
    model_id: str
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: Sampling
    stop_token_ids: frozenset[int]  # tokens that end the reply
    speculation: Speculation | None = None  # how the entry guesses ahead; None: a token per step
    prefixes: PromptPrefixes | None = None  # the prompt's prefill cuts and kept prefixes (None: no reuse)
    vocab_size: int | None = None  # token ids the model has: the tail's tokens are checked against it


@dataclass
class EntryConfig:
    chunk_tokens: int = 512
    step_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    repair: RepairConfig = field(default_factory=RepairConfig)
    speculative: str = "off"  # one of meshd.session.drafting.SPECULATIVE_MODES
    max_draft_tokens: int = 8
    draft_model: DraftModel | None = None
    prefix_reuse: bool = True   # prompts start from prefixes the route's hops kept of earlier ones
    prefix_secret: bytes = b""  # what this entry's prefix names are keyed with (empty: a fresh one per run)
    prefill_workers: int = 1024  # prompts this long or longer may be prefilled by idle replicas; 0: never


@dataclass
class WorkerStats:
    """Prompts prefilled on workers: planned, failed there, started after the workers' prefix (and its
    tokens); prompts whose estimate kept them on the route; and the last estimate, chosen or not."""

    planned: int = 0
    declined: int = 0
    failed: int = 0
    used: int = 0
    tokens: int = 0
    last: dict[str, object] | None = None

    def summary(self) -> dict[str, object]:
        return {"planned": self.planned, "declined": self.declined, "failed": self.failed, "used": self.used,
                "tokens": self.tokens, "last": self.last}


@dataclass
class LiveGeneration:
    """A running generation as ``meshctl sessions`` shows it."""

    session_id: str
    model_id: str
    prompt_tokens: int
    started: float  # monotonic
    generated: int = 0
    epoch: int = 0
    route: list[str] = field(default_factory=list)  # peer ids, head first
    repairs: int = 0

    def as_json(self, now: float) -> dict:
        elapsed = max(now - self.started, 1e-9)
        return {"session_id": self.session_id, "role": "entry", "model": self.model_id,
                "prompt_tokens": self.prompt_tokens, "tokens": self.generated,
                "tok_s": round(self.generated / elapsed, 2), "age_s": round(elapsed, 2), "epoch": self.epoch,
                "hops": len(self.route), "route": self.route, "repairs": self.repairs}


def _ids(session_id: str, route: Route) -> dict:
    """Log ``extra`` naming a session and its route, for records logged outside the session's tasks."""
    return {"fields": {"session": session_id, "route": route_id(route.epoch, [h.peer_id for h in route.hops])}}


class EntrySessions:
    """The generations this peer is the entry of; attempts run in ``nursery`` (the daemon's sessions
    nursery), so that each is owned by the daemon while the API streams its tokens."""

    def __init__(self, peer_id: str, opener: StreamOpener, routes: RouteSource, config: EntryConfig,
                 nursery: trio.Nursery, metrics: PeerMetrics | None = None,
                 workers: WorkerView | None = None) -> None:
        """``workers``: where prefill workers come from (None: every prompt prefills on its route)."""
        self.peer_id = peer_id
        self.workers = workers
        self.metrics = metrics or PeerMetrics()
        self.opener = opener
        self.routes = routes
        self.config = config
        self.nursery = nursery
        self.running = 0
        self.live: dict[str, LiveGeneration] = {}
        self.repair_ms: dict[str, deque[float]] = {}  # by the lost hop's position in the route
        self.drafts: dict[str, DraftStats] = {}  # by draft source, over every generation here
        self._mismatched: set[str] = set()  # models whose tokenizer the draft model does not share
        self.prefix_map = PrefixMap()
        self._prefix_secret = config.prefix_secret or secrets.token_bytes(32)
        self.prefix_stats = {"asked": 0, "reused": 0, "reused_tokens": 0}  # over every attempt that knew a prefix
        self.worker_stats = WorkerStats()

    def prompt_prefixes(self, prompt: Sequence[int], boundaries: Sequence[int], compat_key: str,
                        chat: bool) -> PromptPrefixes:
        """How ``prompt`` is prefilled (message ends ``boundaries``): its cuts and prefixes, keyed for the
        model of ``compat_key``. The cuts are the same whether this entry reuses prefixes or not, so that
        a reply is bit for bit the same either way; without reuse no hop is asked to keep any."""
        cfg = self.config
        plan = plan_prefixes(prompt, boundaries, cfg.chunk_tokens, entry_key(self._prefix_secret, compat_key),
                             messages=chat)
        return plan if cfg.prefix_reuse else replace(plan, keep=frozenset())

    async def route_for_prefix(self, gen: Generation, first: PlannedRoute) -> PlannedRoute:
        """The route for ``gen``: ``first``, or, when the hops asked to keep the prompt's longest known
        prefix are not all on it, the best route favouring them (the planner weighs their discount
        against the rest of the route's cost)."""
        known = self.prefix_map.known(gen.prefixes) if gen.prefixes is not None and self.config.prefix_reuse else []
        if not known:
            return first
        holders = frozenset(peer for peer, _s, _e in known[0].holders)
        if holders <= {h.peer_id for h in first.route.hops}:
            return first
        try:
            return await self.routes.route_for(gen.model_id, keep=holders, compat_key=first.route.compat_key)
        except NoRouteError:
            return first

    def speculation(self, model_id: str, tokenizer: object) -> Speculation | None:
        """How a generation of ``model_id`` (whose tokenizer is ``tokenizer``) guesses ahead, as the
        configuration says: the draft model when it shares the tokenizer, else n-gram lookup."""
        mode, model = self.config.speculative, self.config.draft_model
        if mode == "off" or self.config.max_draft_tokens < 1:
            return None
        drafter: Drafter = NgramDrafter()
        if mode in ("auto", "model") and model is not None:
            if model.matches(tokenizer):
                drafter = model.session() if mode == "model" else LookupThenModel(model)
            elif model_id not in self._mismatched:
                self._mismatched.add(model_id)
                log.warning("the draft model %s does not share %s's tokenizer; its sessions guess by n-gram lookup",
                            model.directory.name, model_id)
        return Speculation(drafter, DraftLength(self.config.max_draft_tokens),
                           self.drafts.setdefault(drafter.source, DraftStats()))

    def draft_summary(self) -> dict[str, object]:
        return {"mode": self.config.speculative, "max_draft_tokens": self.config.max_draft_tokens,
                "sources": {source: stats.summary() for source, stats in sorted(self.drafts.items())}}

    async def generate(self, gen: Generation, first: PlannedRoute) -> AsyncIterator[GeneratedToken]:
        """Yield the generation's tokens, repairing the route as needed; raises the repair policy's
        errors (``NoCompleteRoute``, ``AllRefused``, ``RepairFailed``) or ``DeadlinePassed``."""
        self.running += 1
        live = self.live[gen.session_id] = LiveGeneration(gen.session_id, gen.model_id, len(gen.prompt),
                                                          time.monotonic())
        log.info("session %s started: %s, %d prompt tokens, up to %d new", gen.session_id, gen.model_id,
                 len(gen.prompt), gen.max_new_tokens, extra=_ids(gen.session_id, first.route))
        try:
            async for token in self._generate(gen, first, live):
                live.generated += 1
                yield token
        finally:
            self.running -= 1
            self.live.pop(gen.session_id, None)
            log.info("session %s ended after %d tokens, %d repairs", gen.session_id, live.generated, live.repairs,
                     extra={"fields": {"session": gen.session_id}})

    async def _generate(self, gen: Generation, first: PlannedRoute, live: LiveGeneration,
                        ) -> AsyncIterator[GeneratedToken]:
        cfg = self.config
        policy = RepairPolicy(cfg.repair)
        deadline = trio.current_time() + cfg.request_timeout_s
        generated: list[int] = []  # the reply's token ids so far: a repaired route re-prefills them
        planned: PlannedRoute | None = first
        numerics_class = first.route.compat_key  # repairs stay with peers that compute alike
        worked = await self._prefill_on_workers(gen, first, deadline)  # the first attempt only
        while len(generated) < gen.max_new_tokens:
            if planned is None:
                planned = await self._plan(gen, policy, len(generated), deadline, numerics_class)
            epoch, resume_from, unchanged = policy.begin(planned.route)
            route = replace(planned.route, epoch=epoch)
            live.epoch, live.route = epoch, [h.peer_id for h in route.hops]
            plan = SessionPlan(
                route=route, addresses=planned.addresses, prompt=[*gen.prompt, *generated],
                max_new_tokens=gen.max_new_tokens - len(generated), sampling=gen.sampling,
                stop_token_ids=gen.stop_token_ids, session_id=gen.session_id, chunk_tokens=cfg.chunk_tokens,
                step_timeout_s=cfg.step_timeout_s, unchanged_prefix=unchanged, resume_from_epoch=resume_from,
                # a route of this peer alone crosses no link: guesses there only cost compute
                speculation=None if all(h.peer_id == self.peer_id for h in route.hops) else gen.speculation,
                prefixes=gen.prefixes, vocab_size=gen.vocab_size,
                # a resumed route passes its kept KV on from position 0; it does not start from a prefix
                known_prefixes=self.prefix_map.known(gen.prefixes)
                if gen.prefixes is not None and cfg.prefix_reuse and not unchanged else (),
            )
            if worked is not None:  # the workers' prefix first, each hop told where its part of it is
                plan = replace(plan, known_prefixes=[worked[0], *plan.known_prefixes], prefix_sources=worked[1])
                worked = None
            send, receive = trio.open_memory_channel[GeneratedToken](math.inf)
            outcome = _Outcome()
            scope = await self.nursery.start(self._attempt_task, plan, send, outcome, deadline)
            prefilled = False
            try:
                async with receive:
                    async for token in receive:
                        if not prefilled:  # the route's hops have kept the prompt's prefixes by now
                            prefilled = True
                            self._kept_prefixes(plan)
                        repaired = policy.on_token(trio.current_time())
                        if repaired is not None:
                            took_ms, position = repaired
                            self.repair_ms.setdefault(position, deque(maxlen=STATS_WINDOW)).append(took_ms)
                            self.metrics.event("repaired", session=gen.session_id, lost=position,
                                               took_ms=round(took_ms, 1), route=route.describe())
                            log.info("session %s repaired (%s hop lost) in %.0f ms: epoch %d on %s",
                                     gen.session_id, position, took_ms, epoch, route.describe(),
                                     extra=_ids(gen.session_id, route))
                        generated.append(token.token)
                        yield token
                await outcome.done.wait()  # the attempt's outcome is recorded only once its task has ended
            finally:
                scope.cancel()
            if outcome.deadline_passed:
                raise DeadlinePassed(f"the request did not finish within {cfg.request_timeout_s:g}s")
            if outcome.failure is None:
                return
            failure = outcome.failure
            if generated and generated[-1] in gen.stop_token_ids:
                return
            self.metrics.repairs.labels(str(failure.code)).inc()
            self.metrics.event("route failed", session=gen.session_id, cause=str(failure.code),
                               after_tokens=len(generated), message=failure.message)
            live.repairs += 1
            if failure.code == ErrorCode.RANGE_MISMATCH and failure.peer_id:
                self.routes.demote(failure.peer_id, failure.message)  # caught on first use
            unreachable = policy.on_failure(failure, len(generated), route, trio.current_time())
            if unreachable is not None:
                self.routes.mark_unreachable(unreachable)
            log.info("session %s epoch %d on %s failed after %d tokens (%s); repairing", gen.session_id, epoch,
                     route.describe(), len(generated), policy.cause, extra=_ids(gen.session_id, route))
            planned = None

    def _count_prefix(self, prefix: KnownPrefix | None) -> None:
        self.prefix_stats["asked"] += 1
        if prefix is not None:
            self.prefix_stats["reused"] += 1
            self.prefix_stats["reused_tokens"] += prefix.position
            if prefix.from_workers:
                self.worker_stats.used += 1
                self.worker_stats.tokens += prefix.position

    def worker_plan(self, gen: Generation, route: Route) -> tuple[WorkerPlan, dict[str, str]] | None:
        """Whether ``gen``'s prompt is prefilled on workers before it decodes on ``route``, and on which
        (with their addresses): a long prompt, a cut to stop at, and the estimate in favour."""
        cfg = self.config
        if self.workers is None or not cfg.prefill_workers or gen.prefixes is None:
            return None
        cut = max((p for p in gen.prefixes.names if p < len(gen.prompt)), default=0)  # one token is left to the route
        if cut < cfg.prefill_workers:
            return None
        offers, links, addresses = self.workers()
        sessions: dict[str, int] = {}
        for live in self.live.values():
            if live.session_id != gen.session_id:
                for peer in live.route:
                    sessions[peer] = sessions.get(peer, 0) + 1
        alive = [o for o in offers if o.peer_id in addresses and self.routes.is_alive(o.peer_id)]
        chosen = plan_prefill_workers(route, alive, links, self.peer_id, cut, cfg.chunk_tokens, sessions)
        if chosen is None:
            return None
        self.worker_stats.last = chosen.as_json()
        if not chosen.pays:
            self.worker_stats.declined += 1
            log.info("session %s: the prompt's prefill stays on the route (estimated %.0f ms there and %.0f ms of "
                     "other sessions' steps delayed, %.0f ms and %.0f ms on idle replicas)", gen.session_id,
                     chosen.route_ms, chosen.route_stall_ms, chosen.workers_ms, chosen.workers_stall_ms)
            return None
        return chosen, {h.peer_id: addresses[h.peer_id] for h in chosen.hops}

    async def _prefill_on_workers(self, gen: Generation, first: PlannedRoute, deadline: float,
                                  ) -> tuple[KnownPrefix, list[tuple[str, str]]] | None:
        """Prefill ``gen``'s prompt up to its last cut on idle replicas of ``first``'s busy hops, when the
        cost model says that is faster: the prefix the decode route then starts from, and where each of its
        hops imports its part; None when not worth it, or when the workers failed (the route prefills it all)."""
        chosen = self.worker_plan(gen, first.route)
        if chosen is None:
            return None
        plan, addresses = chosen
        assert gen.prefixes is not None
        self.worker_stats.planned += 1
        prefixes = gen.prefixes
        names = {p: name for p, name in prefixes.names.items() if p <= plan.cut}
        work = SessionPlan(
            route=replace(first.route, hops=plan.hops, epoch=0, terms=(), cost_ms=0.0), addresses=addresses,
            prompt=list(gen.prompt[:plan.cut]), max_new_tokens=1, sampling=Sampling(), stop_token_ids=frozenset(),
            session_id=f"{gen.session_id}-prefill", chunk_tokens=self.config.chunk_tokens,
            step_timeout_s=self.config.step_timeout_s,
            prefixes=PromptPrefixes(plan.cut, prefixes.chunk_tokens, names, frozenset({plan.cut})))
        log.info("session %s: prefilling %d of %d prompt tokens on %s (estimated %.0f ms there, %.0f ms on the "
                 "route)", gen.session_id, plan.cut, len(gen.prompt), work.route.describe(), plan.workers_ms,
                 plan.route_ms, extra=_ids(gen.session_id, first.route))
        send, receive = trio.open_memory_channel[GeneratedToken](math.inf)
        try:
            with trio.move_on_at(deadline):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run_attempt, self.opener, self.peer_id, work, self.routes.is_alive, send)
                    async with receive:
                        async for _token in receive:  # the one token only says the prefill is done
                            pass
        except Exception as exc:  # SessionFailed, or a fault here: either way the route prefills it all
            self.worker_stats.failed += 1
            log.warning("session %s: the prefill workers failed (%s); the route prefills the whole prompt",
                     gen.session_id, exc)
            return None
        upstreams = [self.peer_id, *(h.peer_id for h in plan.hops[:-1])]
        sources = [(w.peer_id, up) for w, up in zip(plan.hops, upstreams, strict=True)]
        return KnownPrefix(plan.cut, names[plan.cut], (), from_workers=True), sources

    def _kept_prefixes(self, plan: SessionPlan) -> None:
        if plan.prefixes is None:
            return
        holders = tuple((h.peer_id, h.start, h.end) for h in plan.route.hops)
        self.prefix_map.kept([plan.prefixes.names[p] for p in plan.prefixes.keep], holders)

    async def _plan(self, gen: Generation, policy: RepairPolicy, generated: int, deadline: float,
                    compat_key: str) -> PlannedRoute:
        """The next route of ``compat_key``, waiting (with the policy's backoff) while none covers the model."""
        while True:
            choice = policy.choice(trio.current_time())
            try:
                return await self.routes.route_for(gen.model_id, exclude=choice.exclude, keep=choice.keep,
                                                   avoid=choice.avoid, compat_key=compat_key)
            except NoRouteError as exc:
                wait = policy.on_no_route(gen.model_id, exc.missing, generated, trio.current_time())
            if wait.until >= deadline:
                raise DeadlinePassed(f"the request did not finish within {self.config.request_timeout_s:g}s "
                                     f"({wait.cause})")
            log.info("session %s: %s; asking again in %.2fs", gen.session_id, wait.cause,
                     wait.until - trio.current_time())
            await trio.sleep_until(wait.until)

    async def _attempt_task(self, plan: SessionPlan, send: trio.MemorySendChannel[GeneratedToken], outcome: _Outcome,
                            deadline: float, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        """One attempt under the daemon's sessions nursery; its outcome is recorded, never raised."""
        bind_log_context(session=plan.session_id,
                         route=route_id(plan.route.epoch, [h.peer_id for h in plan.route.hops]))
        try:
            with trio.CancelScope(deadline=deadline) as scope:
                task_status.started(scope)
                try:
                    await run_attempt(self.opener, self.peer_id, plan, self.routes.is_alive, send, self._count_prefix)
                except SessionFailed as exc:
                    log.warning("session %s failed: %s", plan.session_id, exc)
                    outcome.failure = exc
                except Exception as exc:  # a fault of this peer: the attempt fails, the daemon goes on
                    log.exception("session %s failed on this peer", plan.session_id)
                    outcome.failure = SessionFailed(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
            if scope.cancelled_caught and trio.current_time() >= deadline:
                outcome.deadline_passed = True
        finally:
            send.close()
            outcome.done.set()


@dataclass
class _Outcome:
    failure: SessionFailed | None = None
    deadline_passed: bool = False
    done: trio.Event = field(default_factory=trio.Event)
