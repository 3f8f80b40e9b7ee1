"""Audits on Trio: after a sample of the requests this peer is the entry of, replay a synthetic prompt
on routes that differ in one hop and judge them; check every accusation heard the same way.

The replays are short greedy generations (never a user's text: the prompt is random common words),
run like any other session but without repair, so each route is exactly the one asked for. A hop is
audited against two other peers that serve exactly its range: the route through it, and the same
route with each of them in its place (:func:`~meshd.audit.verdict.judge` needs three). What the
book decides (exclusion after repeated guilt here, never on another peer's word alone) is applied
to every route this peer asks for.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable

import trio

from meshd.audit.book import GUILTY_TO_EXCLUDE, AuditBook
from meshd.audit.records import BadAccusation, check_accusation, sign_accusation
from meshd.audit.verdict import Outcome, Replay, Verdict, judge
from meshd.errors import MeshError
from meshd.identity import Identity
from meshd.limits import remember
from meshd.models.text import TextCodec
from meshd.session.entry import EntrySessions, Generation, PlannedRoute
from meshd.session.routes import RouteClient
from meshd.tracker.routing import NoRouteError
from meshd.tracker.view import Route
from meshd.wire import audit_pb2 as pb
from meshd.wire.bundle import Sampling

log = logging.getLogger("meshd.audit")

AUDIT_WORDS = (
    "river", "stone", "garden", "window", "morning", "letter", "mountain", "music", "winter", "market",
    "bridge", "candle", "forest", "silver", "harbor", "lantern", "orchard", "meadow", "thunder", "pencil",
    "island", "kitchen", "ribbon", "valley", "copper", "journey", "planet", "feather", "basket", "engine",
    "mirror", "shadow", "cotton", "marble", "ladder", "compass",
)
PROMPT_WORDS = 12
MAX_RUNNING = 2  # audits at once; more samples are skipped, more accusations wait
MAX_WAITING = 16  # accusations waiting to be checked; beyond it the oldest is dropped unchecked
REPLAY_TIMEOUT_S = 60.0


class Auditor:
    def __init__(self, identity: Identity, entry: EntrySessions, routes: RouteClient, book: AuditBook,
                 codec_for: Callable[[str, str], Awaitable[TextCodec]], nursery: trio.Nursery, *,
                 rate: float, tokens: int, rng: random.Random | None = None) -> None:
        self.identity = identity
        self.entry = entry  # its repair budget is zero: a replay runs on exactly the route it is given
        self.routes = routes
        self.book = book
        self.codec_for = codec_for
        self.nursery = nursery
        self.rate = rate
        self.tokens = tokens
        self.rng = rng or random.Random()
        self.running = 0
        self._checking: set[str] = set()  # accused peers being checked now
        self._waiting: dict[str, pb.Accusation] = {}  # accused -> the accusation to check, oldest first

    # -- sampling requests -------------------------------------------------------------------------

    def after_request(self, route: Route) -> None:
        """A request finished on ``route``: audit one of its hops, for a sample of requests."""
        if self.rate <= 0 or self.running >= MAX_RUNNING or self.rng.random() >= self.rate:
            return
        hops = [h.peer_id for h in route.hops if h.peer_id != self.identity.peer_id]
        if not hops:
            return
        suspect = self.rng.choice(hops)
        self._start(self._audit, route.model_id, route.compat_key, suspect, None, None)

    def _start(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        self.running += 1

        async def run() -> None:
            try:
                await fn(*args)
            except MeshError as exc:
                log.info("audit not finished: %s", exc)
            finally:
                self.running -= 1
                self._next_accusation()

        self.nursery.start_soon(run)

    # -- accusations -------------------------------------------------------------------------------

    def on_accusation(self, signed: pb.SignedAccusation) -> None:
        """An accusation heard by gossip: kept (to spread on) and checked by an audit of our own."""
        try:
            record = check_accusation(signed)
        except BadAccusation as exc:
            log.warning("accusation ignored: %s", exc)
            return
        if not self.book.heard(record.accuser, record.accused, signed):
            return
        log.warning("%s accuses %s of computing %s wrong; checking it with an audit of our own",
                    record.accuser[:12], record.accused[:12], record.model_id)
        if self.book.is_excluded(record.accused) or record.accused in self._checking:
            return
        if len(self._waiting) >= MAX_WAITING and record.accused not in self._waiting:
            log.warning("too many accusations to check; the oldest, of %s, is dropped unchecked",
                        next(iter(self._waiting))[:12])
        remember(self._waiting, record.accused, record, MAX_WAITING)
        self._next_accusation()

    def _next_accusation(self) -> None:
        """Check the oldest waiting accusation, if an audit may start: each costs three replays, so a
        flood of accusations costs at most MAX_RUNNING audits at a time."""
        while self._waiting and self.running < MAX_RUNNING:
            record = self._waiting.pop(next(iter(self._waiting)))
            if self.book.is_excluded(record.accused) or record.accused in self._checking:
                continue
            self._checking.add(record.accused)
            self._start(self._audit, record.model_id, record.compat_key, record.accused, list(record.prompt), record)

    # -- one audit ---------------------------------------------------------------------------------

    async def _audit(self, model_id: str, compat_key: str, suspect: str, prompt: list[int] | None,
                     accusation: pb.Accusation | None) -> Verdict | None:
        """One audit of ``suspect``; for an accusation, as many as exclusion takes (its own prompt first,
        then fresh ones), stopping at the first that does not find it guilty."""
        try:
            verdict = await self._judge(model_id, compat_key, suspect, prompt)
            if accusation is not None:
                for _ in range(GUILTY_TO_EXCLUDE - 1):
                    if verdict is None or verdict.culprit != suspect or self.book.is_excluded(suspect):
                        break
                    verdict = await self._judge(model_id, compat_key, suspect, None)
        finally:
            self._checking.discard(suspect)
        if accusation is not None and (verdict is None or verdict.culprit != suspect):
            self.book.unconfirmed(suspect)
            log.warning("the accusation of %s by %s was not borne out here (%s)", suspect[:12],
                        accusation.accuser[:12], verdict.outcome.value if verdict else "no routes to compare")
        return verdict

    async def _judge(self, model_id: str, compat_key: str, suspect: str, prompt: list[int] | None) -> Verdict | None:
        found = self._candidates(model_id, compat_key, suspect)
        if found is None:
            log.debug("audit of %s skipped: fewer than three peers of its class serve its range", suspect[:12])
            return None
        # the route through the suspect, then the same route with each rival in its place: every other
        # rival is excluded, so that each route has exactly the peer asked for at that position
        candidates, holders = found
        routes: list[PlannedRoute] = []
        kept: frozenset[str] = frozenset()
        for peer in candidates:
            planned = await self._route(model_id, compat_key, keep=kept | {peer}, exclude=holders - {peer})
            if planned is None or peer not in planned.addresses:
                log.info("audit of %s skipped: no route through %s", suspect[:12], peer[:12])
                return None
            routes.append(planned)
            kept = kept or frozenset(planned.addresses) - {peer}
        if prompt is None:
            codec = await self.codec_for(model_id, compat_key)
            prompt = codec.encode_text(" ".join(self.rng.choice(AUDIT_WORDS) for _ in range(PROMPT_WORDS)))
        replays = []
        for planned in routes:
            tokens = await self._replay(planned, prompt, model_id)
            if tokens is None:
                return None
            replays.append(Replay(frozenset(planned.addresses), tokens))
        verdict = judge(replays)
        newly_excluded = self.book.record(verdict, time.monotonic())
        self._report(verdict, model_id, compat_key, prompt, replays)
        if newly_excluded is not None:
            log.error("excluded %s from this peer's routes: %d audits found it computing %s wrong", newly_excluded[:12],
                      self.book.of(newly_excluded)["guilty"], model_id)  # type: ignore[index]
        return verdict

    def _report(self, verdict: Verdict, model_id: str, compat_key: str, prompt: list[int],
                replays: list[Replay]) -> None:
        if verdict.outcome == Outcome.GUILTY and verdict.culprit is not None:
            log.warning("audit: %s computed %s wrong (its route gave %s where %d others gave %s)",
                        verdict.culprit[:12], model_id, list(verdict.got), len(replays) - 1, list(verdict.expected))
            signed = sign_accusation(self.identity, verdict.culprit, model_id, compat_key, prompt, verdict.expected,
                                     verdict.got, int(time.time() * 1000))
            self.book.heard(self.identity.peer_id, verdict.culprit, signed)
        else:
            log.info("audit of %d routes of %s: %s", len(replays), model_id, verdict.outcome.value)

    def _candidates(self, model_id: str, compat_key: str, suspect: str) -> tuple[list[str], frozenset[str]] | None:
        """The suspect and two rivals (live peers of its numerics class serving exactly its range),
        and every peer serving that range."""
        offers = [o for o in self.routes.view.offers() if o.model_id == model_id and o.compat_key == compat_key]
        held = next((o.range for o in offers if o.peer_id == suspect and o.range is not None), None)
        if held is None:
            return None
        holders = frozenset(o.peer_id for o in offers if o.range == held)
        rivals = sorted(holders - {suspect} - self.book.excluded())
        if len(rivals) < 2:
            return None
        return [suspect, *self.rng.sample(rivals, 2)], holders

    async def _route(self, model_id: str, compat_key: str, keep: frozenset[str],
                     exclude: frozenset[str] = frozenset()) -> PlannedRoute | None:
        try:
            return await self.routes.route_for(model_id, exclude=exclude, keep=keep, compat_key=compat_key)
        except NoRouteError:
            return None

    async def _replay(self, planned: PlannedRoute, prompt: list[int], model_id: str) -> tuple[int, ...] | None:
        gen = Generation(session_id=f"audit-{secrets.token_hex(8)}", model_id=model_id, prompt=prompt,
                         max_new_tokens=self.tokens, sampling=Sampling(temperature=0.0), stop_token_ids=frozenset())
        tokens: list[int] = []
        try:
            with trio.fail_after(REPLAY_TIMEOUT_S):
                async for token in self.entry.generate(gen, planned):
                    tokens.append(token.token)
        except (MeshError, trio.TooSlowError) as exc:
            log.info("audit replay on %s failed: %s", [p[:8] for p in planned.addresses], exc)
            return None
        return tuple(tokens)
