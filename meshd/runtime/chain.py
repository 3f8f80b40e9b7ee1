"""Run a session through an ordered list of shards in one process.

This is the data path of a route without the network: the same bundles, encoded and decoded by the
same codec, handed from shard to shard. The demo and the parity tests use it; the session plane
sends the very same bundles over HTTP/2 seams.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
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
) -> Iterator[HiddenStateBundle]:
    """The head's input bundles for ``token_ids``: prefill chunks of at most ``chunk_tokens`` tokens
    (the last one asks the tail to sample), or one decode bundle when ``step > 0``."""
    whole = HiddenStateBundle(
        session_id=session_id, epoch=epoch, step=step, phase=Phase.DECODE if step > 0 else Phase.PREFILL,
        start_position=start_position, token_count=len(token_ids),
        tensors={INPUT_IDS: torch.tensor(list(token_ids), dtype=torch.long)},
        range_start=head_range[0], range_end=head_range[1], sample=True,
        sampling=sampling if start_position == 0 else None,
    )
    yield from whole.chunks(chunk_tokens)


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
    ) -> Generation:
        sampling = sampling or Sampling()
        session_id = session_id or uuid.uuid4().hex
        head = (self.shards[0].spec.start, self.shards[0].spec.end)
        out = Generation(tokens=[])
        try:
            pending: list[int] = list(prompt)
            position = 0
            for step in range(max_new_tokens):
                result = None
                for b in input_bundles(session_id, epoch, pending, position, chunk_tokens, head, sampling, step):
                    result = self.step(b)
                position += len(pending)
                assert result is not None and result.token is not None
                out.tokens.append(result.token)
                if result.logits is not None:
                    out.logits.append(result.logits)
                if eos_token_id is not None and result.token == eos_token_id:
                    out.finish_reason = "stop"
                    break
                pending = [result.token]
        finally:
            for shard in self.shards:
                shard.release(session_id, epoch)
        return out
