"""The entry's side of one session on one route, as a state machine.

An attempt opens a results stream to the route's tail and a seam to its head, sends the prompt in
bounded prefill chunks, then one decode bundle per step: the last token, and, when the session
speculates, the tokens a drafter guessed after it (:mod:`meshd.session.drafting`). Tokens come back
from the tail (one per step, or as many as it accepted of the guesses, plus the one after them),
errors from the head's side of the seam. :class:`EntryAttempt` is fed what arrives on those streams (and the
clock, for the step timeout) and returns what to do: bundles to send to the head, tokens to pass on.
Anything that ends the attempt early raises :class:`SessionFailed`, naming the peer at fault when
there is one, so that the repair policy can route around it. The Trio adapter is
:func:`meshd.session.entry.run_attempt`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from meshd.errors import ErrorCode, RemoteError
from meshd.runtime.chain import input_bundles, prefill_bundles
from meshd.session.drafting import Drafter, DraftLength, DraftStats
from meshd.session.prefixes import KnownPrefix, PromptPrefixes, chunk_spans
from meshd.tracker.view import Route
from meshd.wire import session_pb2 as pb
from meshd.wire.bundle import HiddenStateBundle, Sampling


class SessionFailed(RemoteError):
    """One attempt of a session ended early; ``peer_id`` is the peer at fault, "" when none is known."""


class Source(StrEnum):
    RESULTS = "results"  # the tail's stream of tokens
    SEAM = "seam"        # the head's seam: errors from anywhere along the route come back on it


@dataclass
class SessionPlan:
    """Everything one attempt needs: the route and where its peers are, and what to generate."""

    route: Route
    addresses: dict[str, str]   # peer id -> address of its transport
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: Sampling
    stop_token_ids: frozenset[int]   # tokens that end the reply (end of sequence, end of turn)
    session_id: str
    chunk_tokens: int = 512
    step_timeout_s: float = 30.0
    unchanged_prefix: int = 0   # repair: leading hops shared with epoch resume_from_epoch
    resume_from_epoch: int = 0
    speculation: Speculation | None = None  # None: one token per step
    prefixes: PromptPrefixes | None = None  # where the prompt's prefill is cut, and which prefixes hops keep
    known_prefixes: Sequence[KnownPrefix] = ()  # kept prefixes of the prompt to ask the route's hops about
    # per hop: the prefill worker that computed the longest known prefix for its layers, and that
    # worker's upstream peer ("" and "": none); the hop imports the prefix from there when it lacks it
    prefix_sources: Sequence[tuple[str, str]] = ()
    vocab_size: int | None = None  # token ids the model has (None: unknown, only negative ids are refused)


@dataclass
class Speculation:
    """How a session guesses tokens ahead: its drafter, how many to guess, and where to count them
    (kept across the attempts of one generation)."""

    drafter: Drafter
    length: DraftLength = field(default_factory=DraftLength)
    stats: DraftStats = field(default_factory=DraftStats)


# -- what arrives ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    source: Source
    peer_id: str
    message: pb.SeamMessage


@dataclass(frozen=True)
class StreamEnded:
    source: Source
    peer_id: str


@dataclass(frozen=True)
class StreamBroken:
    source: Source
    peer_id: str
    code: ErrorCode
    reason: str


@dataclass(frozen=True)
class HopDead:
    """Gossip declared a hop of the route dead."""

    peer_id: str


AttemptEvent = Received | StreamEnded | StreamBroken | HopDead


# -- what to do ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendToHead:
    bundle: HiddenStateBundle


@dataclass(frozen=True)
class Draft:
    """Ask the plan's drafter for up to ``k`` tokens after ``context``; give them to
    :meth:`EntryAttempt.on_drafted` (a slow drafter runs off the event loop)."""

    context: tuple[int, ...]
    k: int


@dataclass(frozen=True)
class GeneratedToken:
    """A token of the reply, with its log-probabilities when the session asked for them."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Emit:
    """A token of the reply, in order."""

    token: GeneratedToken


EntryAction = SendToHead | Emit | Draft


class EntryAttempt:
    def __init__(self, plan: SessionPlan, entry_peer_id: str, now: float, prefix: KnownPrefix | None = None) -> None:
        """``prefix``: a kept prefix of the prompt that every hop of the route holds; the prefill starts
        after it."""
        if plan.max_new_tokens < 1:
            raise ValueError("an attempt generates at least one token")
        if prefix is not None and not 0 < prefix.position < len(plan.prompt):
            raise ValueError("a kept prefix leaves at least one prompt token to compute")
        self.plan = plan
        self.prefix = prefix
        self.entry_peer_id = entry_peer_id
        self.hops = [pb.HopAddress(peer_id=h.peer_id, address=plan.addresses[h.peer_id], range_start=h.start,
                                   range_end=h.end) for h in plan.route.hops]
        self.position = len(plan.prompt)  # the position of the next token the tail will send
        self.generated = 0
        self.context = list(plan.prompt)  # prompt and tokens so far: what drafts continue
        self.draft: tuple[int, ...] = ()  # the guesses the step in flight verifies
        self.step_tokens = 0  # tokens of the step in flight received so far
        self.step_sent = now
        self.done = False
        self.results_ready = False
        self._last_progress = now
        self._prefill_chunks = 1  # what the first token waits for: every chunk of the prompt's prefill

    @property
    def head(self) -> pb.HopAddress:
        return self.hops[0]

    @property
    def tail(self) -> pb.HopAddress:
        return self.hops[-1]

    @property
    def deadline(self) -> float:
        """When the attempt fails unless something arrives: the step timeout after the last progress, and
        before the first token one step timeout per prefill chunk (a long prompt on a slow route computes
        them all before anything comes back)."""
        return self._last_progress + self.plan.step_timeout_s * self._waits()

    def _waits(self) -> int:
        return self._prefill_chunks if self.generated == 0 else 1

    def open_for(self, index: int) -> pb.SessionOpen:
        """The ``SessionOpen`` for the stream to hop ``index`` (the tail's results stream: the last)."""
        plan, route = self.plan, self.plan.route
        return pb.SessionOpen(
            session_id=plan.session_id, epoch=route.epoch, model_id=route.model_id, compat_key=route.compat_key,
            hops=self.hops, hop_index=index, entry_peer_id=self.entry_peer_id,
            max_tokens=len(plan.prompt) + plan.max_new_tokens, prompt_tokens=len(plan.prompt),
            unchanged_prefix=plan.unchanged_prefix, resume_from_epoch=plan.resume_from_epoch,
        )

    def start(self, now: float) -> list[EntryAction]:
        """The prompt's prefill chunks, once the tail's results stream is ready."""
        if not self.results_ready:
            raise SessionFailed(ErrorCode.PROTOCOL, "the prompt goes out only once the results stream is ready")
        self._last_progress = self.step_sent = now
        chunks = self._prefill()
        self._prefill_chunks = max(1, len(chunks))
        return [SendToHead(b) for b in chunks]

    def on_results_open(self, message: pb.SeamMessage, now: float) -> None:
        """The tail's first answer on the results stream: ready, or why not."""
        self._raise_if_error(message, self.tail.peer_id)
        if message.WhichOneof("kind") != "ready":
            raise SessionFailed(ErrorCode.PROTOCOL, f"the tail answered {message.WhichOneof('kind')!r}, not ready",
                                self.tail.peer_id)
        self.results_ready = True
        self._last_progress = now

    def on_event(self, event: AttemptEvent, now: float) -> list[EntryAction]:
        if isinstance(event, HopDead):
            raise SessionFailed(ErrorCode.PEER_DEAD, "gossip declared the hop dead", event.peer_id)
        if isinstance(event, StreamEnded):
            raise SessionFailed(ErrorCode.SEAM_CLOSED, f"the {event.source} stream ended early", event.peer_id)
        if isinstance(event, StreamBroken):
            raise SessionFailed(event.code, f"the {event.source} stream: {event.reason}", event.peer_id)
        message = event.message
        self._raise_if_error(message, event.peer_id)
        if event.source != Source.RESULTS or message.WhichOneof("kind") != "token":
            raise SessionFailed(ErrorCode.PROTOCOL, f"unexpected {message.WhichOneof('kind')!r} on the "
                                f"{event.source} stream", event.peer_id)
        return self._on_token(message.token, now)

    def on_timeout(self, now: float) -> None:
        if now >= self.deadline:
            raise SessionFailed(ErrorCode.STEP_TIMEOUT, f"no token for {self.plan.step_timeout_s * self._waits():g}s")

    def _on_token(self, result: pb.TokenResult, now: float) -> list[EntryAction]:
        if self.done:
            raise SessionFailed(ErrorCode.PROTOCOL, "a token after the last one", self.tail.peer_id)
        if result.position != self.position:
            raise SessionFailed(ErrorCode.PROTOCOL, f"expected the token for position {self.position}, got "
                                f"{result.position}", self.tail.peer_id)
        self._check_token(result)
        token = int(result.token)
        generated = GeneratedToken(token, result.logprob if result.has_logprob else None,
                                   tuple((int(t.token), float(t.logprob)) for t in result.top))
        self.generated += 1
        self.position += 1
        self.context.append(token)
        self._last_progress = now
        guessed = self.step_tokens < len(self.draft) and token == self.draft[self.step_tokens]
        self.step_tokens += 1
        if token in self.plan.stop_token_ids or self.generated >= self.plan.max_new_tokens:
            self.done = True
            return [Emit(generated)]
        if guessed:  # the tail goes on with the next token of this step
            return [Emit(generated)]
        self._step_ended(now)
        spec = self.plan.speculation
        # guesses are bounded so that a step never passes the reply's length (the last token of a step
        # may be one more than the guesses) and never guesses an end of the reply
        limit = min(self.plan.max_new_tokens - self.generated - 1, self.plan.chunk_tokens - 1)
        k = spec.length.choose(limit) if spec is not None else 0
        if k > 0:
            self.step_sent = now  # the step's time includes its drafting: a guess costs that too
            return [Emit(generated), Draft(tuple(self.context), k)]
        # the token goes back into the route before it goes to the client, so that the client's work
        # on it (detokenizing, streaming) overlaps the next step's compute instead of delaying it
        return [*self._step([], now), Emit(generated)]

    def _check_token(self, result: pb.TokenResult) -> None:
        """A token the tail could not have sampled is the tail's fault: taken, it would go to the client
        and into every later prefill of the session, and the head would be blamed for refusing it."""
        vocab, sampling = self.plan.vocab_size, self.plan.sampling
        ids = [result.token, *(t.token for t in result.top)]
        if any(i < 0 or (vocab is not None and i >= vocab) for i in ids):
            raise SessionFailed(ErrorCode.PROTOCOL, f"the tail sent token id {max(ids, key=abs)}, outside the "
                                f"model's {vocab if vocab is not None else 'non-negative'} ids", self.tail.peer_id)
        if len(result.top) > sampling.top_logprobs or result.has_logprob != sampling.logprobs:
            raise SessionFailed(ErrorCode.PROTOCOL, f"the tail sent {len(result.top)} top log-probabilities "
                                f"(logprob {'with' if result.has_logprob else 'without'} one) where the session "
                                f"asked for {sampling.top_logprobs}", self.tail.peer_id)
        logprobs = [result.logprob, *(t.logprob for t in result.top)] if result.has_logprob else []
        if any(math.isnan(p) or p == math.inf for p in logprobs):
            raise SessionFailed(ErrorCode.PROTOCOL, "the tail sent a log-probability that is not one",
                                self.tail.peer_id)

    def on_drafted(self, tokens: Sequence[int], k: int, now: float) -> list[EntryAction]:
        """The drafter's guesses for the step asked with :class:`Draft`: send the step."""
        guesses: list[int] = []
        for t in list(tokens)[:k]:
            if t in self.plan.stop_token_ids:
                break
            guesses.append(int(t))
        self._last_progress = now
        return self._step(guesses, self.step_sent)

    def _step(self, guesses: list[int], started: float) -> list[EntryAction]:
        """The next decode step: the newest token (at the position before the next), and guesses after it;
        ``started``: when the step was decided on (before any drafting)."""
        self.draft, self.step_tokens, self.step_sent = tuple(guesses), 0, started
        return [SendToHead(b) for b in self._bundles([self.context[-1]], self.position - 1, step=self.generated,
                                                     draft=guesses)]

    def _step_ended(self, now: float) -> None:
        spec = self.plan.speculation
        if spec is None or self.generated <= 1:  # the first token ends the prompt's prefill, not a step
            return
        accepted = self.step_tokens - 1
        spec.length.record(len(self.draft), accepted, 1 + len(self.draft), now - self.step_sent)
        if self.draft:
            spec.stats.steps += 1
            spec.stats.drafted += len(self.draft)
            spec.stats.accepted += accepted

    def _prefill(self) -> list[HiddenStateBundle]:
        """The prompt's prefill chunks, cut where every prefill of it is cut, from the kept prefix on."""
        plan, prefixes = self.plan, self.plan.prefixes
        start = self.prefix.position if self.prefix is not None else 0
        n = len(plan.prompt)
        spans = prefixes.spans(start, n) if prefixes is not None else chunk_spans(start, n, (), plan.chunk_tokens)
        keep = {p: prefixes.names[p] for p in prefixes.keep} if prefixes is not None else {}
        return prefill_bundles(plan.session_id, plan.route.epoch, plan.prompt, spans,
                               (self.head.range_start, self.head.range_end), plan.sampling,
                               prefix=self.prefix.name if self.prefix is not None else b"", keep=keep)

    def _bundles(self, tokens: list[int], position: int, step: int,
                 draft: Sequence[int] = ()) -> list[HiddenStateBundle]:
        head = (self.head.range_start, self.head.range_end)
        return list(input_bundles(self.plan.session_id, self.plan.route.epoch, tokens, position,
                                  self.plan.chunk_tokens, head, self.plan.sampling, step=step, draft=draft))

    def _raise_if_error(self, message: pb.SeamMessage, reporter: str) -> None:
        """An error from a hop names the peer at fault (the hop that failed, or its next hop), relayed up
        the route to the stream ``reporter`` is on. Only a peer of the route from ``reporter`` on can be
        at fault in its report: one naming any other peer is blamed on ``reporter`` itself."""
        if message.WhichOneof("kind") == "error":
            error = message.error
            hops = [h.peer_id for h in self.plan.route.hops]
            named = hops[hops.index(reporter):] if reporter in hops else []
            blamed = error.peer_id if error.peer_id in named else reporter
            raise SessionFailed(ErrorCode.parse(error.code), error.message, blamed)
