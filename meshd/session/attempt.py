"""The entry's side of one session on one route, as a state machine.

An attempt opens a results stream to the route's tail and a seam to its head, sends the prompt in
bounded prefill chunks, then one decode bundle per token. Tokens come back from the tail, errors
from the head's side of the seam. :class:`EntryAttempt` is fed what arrives on those streams (and the
clock, for the step timeout) and returns what to do: bundles to send to the head, tokens to pass on.
Anything that ends the attempt early raises :class:`SessionFailed`, naming the peer at fault when
there is one, so that the repair policy can route around it. The Trio adapter is
:func:`meshd.session.entry.run_attempt`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from meshd.errors import ErrorCode, RemoteError
from meshd.runtime.chain import input_bundles
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
class GeneratedToken:
    """A token of the reply, with its log-probabilities when the session asked for them."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Emit:
    """A token of the reply, in order."""

    token: GeneratedToken


EntryAction = SendToHead | Emit


class EntryAttempt:
    def __init__(self, plan: SessionPlan, entry_peer_id: str, now: float) -> None:
        if plan.max_new_tokens < 1:
            raise ValueError("an attempt generates at least one token")
        self.plan = plan
        self.entry_peer_id = entry_peer_id
        self.hops = [pb.HopAddress(peer_id=h.peer_id, address=plan.addresses[h.peer_id], range_start=h.start,
                                   range_end=h.end) for h in plan.route.hops]
        self.position = len(plan.prompt)  # the position of the next token the tail will send
        self.generated = 0
        self.done = False
        self.results_ready = False
        self._last_progress = now

    @property
    def head(self) -> pb.HopAddress:
        return self.hops[0]

    @property
    def tail(self) -> pb.HopAddress:
        return self.hops[-1]

    @property
    def deadline(self) -> float:
        """When the attempt fails unless something arrives: the step timeout after the last progress."""
        return self._last_progress + self.plan.step_timeout_s

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
        self._last_progress = now
        return [SendToHead(b) for b in self._bundles(list(self.plan.prompt), 0, step=0)]

    def on_results_open(self, message: pb.SeamMessage, now: float) -> None:
        """The tail's first answer on the results stream: ready, or why not."""
        self._raise_if_error(message)
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
        self._raise_if_error(message)
        if event.source != Source.RESULTS or message.WhichOneof("kind") != "token":
            raise SessionFailed(ErrorCode.PROTOCOL, f"unexpected {message.WhichOneof('kind')!r} on the "
                                f"{event.source} stream", event.peer_id)
        return self._on_token(message.token, now)

    def on_timeout(self, now: float) -> None:
        if now >= self.deadline:
            raise SessionFailed(ErrorCode.STEP_TIMEOUT, f"no token for {self.plan.step_timeout_s:g}s")

    def _on_token(self, result: pb.TokenResult, now: float) -> list[EntryAction]:
        if self.done:
            raise SessionFailed(ErrorCode.PROTOCOL, "a token after the last one", self.tail.peer_id)
        if result.position != self.position:
            raise SessionFailed(ErrorCode.PROTOCOL, f"expected the token for position {self.position}, got "
                                f"{result.position}", self.tail.peer_id)
        token = int(result.token)
        generated = GeneratedToken(token, result.logprob if result.has_logprob else None,
                                   tuple((int(t.token), float(t.logprob)) for t in result.top))
        self.generated += 1
        self._last_progress = now
        if token in self.plan.stop_token_ids or self.generated >= self.plan.max_new_tokens:
            self.done = True
            return [Emit(generated)]
        # the token goes back into the route before it goes to the client, so that the client's work
        # on it (detokenizing, streaming) overlaps the next step's compute instead of delaying it
        actions: list[EntryAction] = [SendToHead(b) for b in self._bundles([token], self.position,
                                                                           step=self.generated)]
        self.position += 1
        return [*actions, Emit(generated)]

    def _bundles(self, tokens: list[int], position: int, step: int) -> list[HiddenStateBundle]:
        head = (self.head.range_start, self.head.range_end)
        return list(input_bundles(self.plan.session_id, self.plan.route.epoch, tokens, position,
                                  self.plan.chunk_tokens, head, self.plan.sampling, step=step))

    @staticmethod
    def _raise_if_error(message: pb.SeamMessage) -> None:
        """An error from a hop names the peer at fault (the hop that failed, or its next hop)."""
        if message.WhichOneof("kind") == "error":
            error = message.error
            raise SessionFailed(ErrorCode.parse(error.code), error.message, error.peer_id)
