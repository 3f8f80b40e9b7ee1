"""Run a session through an ordered list of shards in one process.

This is the data path of a route without the network: the same bundles, encoded and decoded by the
same codec, handed from shard to shard. The demo and the parity tests use it; the session plane
sends the very same bundles over HTTP/2 seams.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from meshd.errors import RangeMismatch
from meshd.runtime.shard import HIDDEN_STATES, INPUT_IDS, Shard, StepResult
from meshd.wire import bundle as wire
from meshd.wire.bundle import HiddenStateBundle, Phase, Sampling


@dataclass
class Generation:
    tokens: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str = "length"


def input_bundles(
    session_id: str,
    epoch: int,
    token_ids: Sequence[int],
    start_position: int,
    chunk_tokens: int,
    head_range: tuple[int, int],
    sampling: Sampling,
    step: int = 0,
    draft: Sequence[int] = (),
) -> Iterator[HiddenStateBundle]:
    """The head's input bundles for ``token_ids``: prefill chunks of at most ``chunk_tokens`` tokens
    (the last one asks the tail to sample), or one decode bundle when ``step > 0``: its token, and
    the ``draft`` tokens after it for the route to verify."""
    if draft and (step == 0 or len(token_ids) != 1):
        raise ValueError("drafted tokens follow the one token of a decode step")
    whole = HiddenStateBundle(
        session_id=session_id, epoch=epoch, step=step, phase=Phase.DECODE if step > 0 else Phase.PREFILL,
        start_position=start_position, token_count=len(token_ids) + len(draft),
        tensors={INPUT_IDS: torch.tensor([*token_ids, *draft], dtype=torch.long)},
        range_start=head_range[0], range_end=head_range[1], sample=True,
        sampling=sampling if start_position == 0 else None, draft=tuple(draft),
    )
    yield from (whole.chunks(chunk_tokens) if not draft else [whole])


def prefill_bundles(
    session_id: str,
    epoch: int,
    token_ids: Sequence[int],
    spans: Sequence[tuple[int, int]],
    head_range: tuple[int, int],
    sampling: Sampling,
    prefix: bytes = b"",
    keep: Mapping[int, bytes] | None = None,
) -> list[HiddenStateBundle]:
    """The head's prefill chunks of a session: positions ``spans`` (consecutive, the first starting where
    the session does) of ``token_ids`` (the whole sequence). The first chunk carries the sampling
    settings and, when the session starts after a kept prefix, its name ``prefix``; a chunk ending at a
    position of ``keep`` asks every hop to keep the KV there under that name; the last asks to sample."""
    if not spans:
        raise ValueError("a prefill has at least one chunk")
    keep = keep or {}
    end = spans[-1][1]
    return [HiddenStateBundle(
        session_id=session_id, epoch=epoch, phase=Phase.PREFILL, start_position=a, token_count=b - a,
        tensors={INPUT_IDS: torch.tensor(list(token_ids[a:b]), dtype=torch.long)},
        range_start=head_range[0], range_end=head_range[1], sample=b == end,
        sampling=sampling if i == 0 else None, prefix=prefix if i == 0 else b"", keep_prefix=keep.get(b, b""),
    ) for i, (a, b) in enumerate(spans)]


class LocalChain:
    """Shards that tile a model, run in order in this process."""

    def __init__(self, shards: Sequence[Shard]) -> None:
        if not shards:
            raise ValueError("a chain needs at least one shard")
        n_layers = shards[0].spec.n_layers
        expected = 0
        for shard in shards:
            if shard.spec.start != expected or shard.spec.n_layers != n_layers:
                raise RangeMismatch(
                    "shards must tile [0, n_layers) in order: "
                    + ", ".join(f"[{s.spec.start}, {s.spec.end})" for s in shards)
                )
            expected = shard.spec.end
        if expected != n_layers:
            raise RangeMismatch(f"shards stop at layer {expected} of {n_layers}")
        self.shards = list(shards)

    def step(self, head_bundle: HiddenStateBundle) -> StepResult:
        """Carry one bundle through every shard (over the wire codec); return the tail's result."""
        bundle = wire.decode(wire.encode(head_bundle))
        result = self.shards[0].forward(bundle)
        for shard in self.shards[1:]:
            passed = bundle.part(bundle.start_position, bundle.end_position, {HIDDEN_STATES: result.hidden_states})
            passed.range_start, passed.range_end = shard.spec.start, shard.spec.end
            bundle = wire.decode(wire.encode(passed))
            result = shard.forward(bundle)
        return result

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        chunk_tokens: int = 64,
        eos_token_id: int | None = None,
        session_id: str | None = None,
        epoch: int = 0,
        draft: Callable[[Sequence[int], int], Sequence[int]] | None = None,
        draft_tokens: int = 4,
    ) -> Generation:
        """Generate up to ``max_new_tokens``; with ``draft`` (``draft(context, k)`` -> guesses), each decode
        step also carries up to ``draft_tokens`` guessed tokens for the shards to verify."""
        sampling = sampling or Sampling()
        session_id = session_id or uuid.uuid4().hex
        head = (self.shards[0].spec.start, self.shards[0].spec.end)
        out = Generation(tokens=[])
        try:
            pending: list[int] = list(prompt)
            position, step = 0, 0
            while len(out.tokens) < max_new_tokens:
                guesses: list[int] = []
                room = min(draft_tokens, max_new_tokens - len(out.tokens) - 1)
                if step > 0 and draft is not None and room > 0:
                    guesses = [int(t) for t in draft([*prompt, *out.tokens], room)][:room]
                result = None
                for b in input_bundles(session_id, epoch, pending, position, chunk_tokens, head, sampling, step,
                                       guesses):
                    result = self.step(b)
                assert result is not None and result.token is not None
                for sampled in (result, *result.following):
                    if len(out.tokens) >= max_new_tokens or out.finish_reason == "stop":
                        break
                    assert sampled.token is not None
                    out.tokens.append(sampled.token)
                    if sampled.logits is not None:
                        out.logits.append(sampled.logits)
                    if eos_token_id is not None and sampled.token == eos_token_id:
                        out.finish_reason = "stop"
                if out.finish_reason == "stop":
                    break
                step += 1
                pending, position = [out.tokens[-1]], len(prompt) + len(out.tokens) - 1
        finally:
            for shard in self.shards:
                shard.release(session_id, epoch)
        return out
