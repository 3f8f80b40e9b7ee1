"""A shard whose layers llama.cpp computes: the fast path for GGUF models.

Everything a hop sees of a shard stays as :class:`meshd.runtime.shard.Shard` has it: the checks on
every bundle, sessions keyed by ``(session_id, epoch)`` with their KV accounting and eviction, the
rule that a failed step leaves its session as it was, sampling on the tail seeded by position. Only
the compute differs: the range runs in a :class:`RangeEngine` over the range's own GGUF, each
session one llama.cpp sequence. Hidden states cross seams in float32, as ggml computes them.
Decode steps run one session at a time: ggml's matrix kernels choose their blocking by the number
of rows, so a batched step would not be guaranteed to give what each session gets alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshd.errors import ModelFormatError
from meshd.runtime.gguf_checkpoint import GgufIndex, checked_tensor
from meshd.runtime.kv import SessionKey, SessionKV
from meshd.runtime.llamacpp.engine import EngineOptions, RangeEngine
from meshd.runtime.llamacpp.range_file import range_file
from meshd.runtime.loader import Checkpoint
from meshd.runtime.shard import PrefillCompute, PrefillPart, Shard, StepResult, WholePrefill
from meshd.wire.bundle import HiddenStateBundle, Sampling

RANGES_DIR = "llamacpp-ranges"  # range files, beside the GGUF model's link
KV_BYTES_PER_ELEMENT = 2  # llama.cpp keeps K and V in f16 by default
MAX_CELLS = 65536


@dataclass
class SequenceKV(SessionKV):
    """A session whose KV lives in a llama.cpp sequence; ``length`` is the shard's count of its tokens."""

    seq: int = -1
    engine: RangeEngine | None = None
    bytes_per_token: int = 0

    def truncate(self, length: int) -> None:
        if self.engine is not None:  # positions past ``length`` may exist there even if not counted here
            self.engine.truncate(self.seq, length)
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.length * self.bytes_per_token


class LlamaCppShard(Shard):
    def __init__(self, model_dir: Path, start: int, end: int, *, threads: int = 0, **options: Any) -> None:
        """``threads``: ggml's compute threads; 0 takes torch's count, which the peer's ``torch_threads``
        sets (llama.cpp's own default can exceed the cores a process may use, and oversubscribed ggml
        threads spin against each other: a decode step of the tiny model took 3.5 ms instead of 0.15)."""
        threads = threads or torch.get_num_threads()
        super().__init__(model_dir, start, end, **options)
        self.batch_invariant = False
        budget = self.kv.budget_bytes
        cells = MAX_CELLS if budget is None else max(self.max_chunk_tokens * 2,
                                                     min(MAX_CELLS, budget // self.kv_bytes_per_token()))
        self.engine = RangeEngine(self._range_path, end - start, self.spec.is_tail,
                                  EngineOptions(n_ctx=int(cells), n_batch=self.max_chunk_tokens, threads=threads,
                                                gpu_layers=999 if self.numerics.device_kind != "cpu" else 0))
        self.kv = self.kv.with_sessions(self._new_session, self._forget_session)

    def _new_session(self, key: SessionKey, sampling: Sampling, now: float) -> SessionKV:
        return SequenceKV(key=key, sampling=sampling, last_used=now, seq=self.engine.new_sequence(),
                          engine=self.engine, bytes_per_token=self.kv_bytes_per_token())

    def _forget_session(self, session: SessionKV) -> None:
        if isinstance(session, SequenceKV) and session.engine is not None:
            session.engine.release(session.seq)
            session.engine = None

    # -- loading -----------------------------------------------------------------------------------

    def _load(self, index: Checkpoint) -> None:
        if not isinstance(index, GgufIndex):
            raise ModelFormatError("the llama.cpp backend computes GGUF models only")
        self.index = index
        self.embed = self.layers = self.norm = self.lm_head = None
        a, spec = self.adapter, self.spec
        self._embedding = index.tensors.get(a.embed_tensor) if spec.is_head else None
        if spec.is_head and self._embedding is None:
            raise ModelFormatError(f"the GGUF file has no {a.embed_tensor!r} (token_embd) tensor")
        if self._embedding is not None:  # read here, not from the range file: checked here
            checked_tensor(self._embedding, index.manifest)
        self._range_path = range_file(index.path.resolve(), spec.start, spec.end, self.model_dir / RANGES_DIR,
                                      index.manifest)
        self._range_names = [n for n in index.tensors if self._owns(n)]

    def _owns(self, name: str) -> bool:
        a, spec = self.adapter, self.spec
        if name.startswith("model.layers."):
            return spec.start <= int(name.split(".")[2]) < spec.end
        if name == a.embed_tensor:
            return spec.is_head or (spec.is_tail and a.lm_head_tensor not in self.index)
        return spec.is_tail

    def parameter_bytes(self) -> int:
        """Bytes of the range's tensors as stored (quantized), which llama.cpp maps and computes on."""
        return sum(int(self.index.entry(n)["nbytes"]) for n in self._range_names)  # type: ignore[call-overload]

    def kv_bytes_per_token(self) -> int:
        kv_heads, head_dim = self.adapter.kv_heads_and_dim(self.config)
        return (self.spec.end - self.spec.start) * 2 * kv_heads * head_dim * KV_BYTES_PER_ELEMENT

    def weight_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in sorted(self._range_names):
            yield name, self.index.load([name], torch.float32)[name]

    # -- compute -----------------------------------------------------------------------------------

    def _inputs(self, x: torch.Tensor) -> np.ndarray:
        if self._embedding is None:
            return x.detach().cpu().numpy()
        from gguf import quants

        ids = x.cpu().numpy()
        return np.asarray(quants.dequantize(self._embedding.data[ids], self._embedding.tensor_type), np.float32)

    @property
    def prefills_share_rows(self) -> bool:
        return False  # ggml's kernels choose by the batch (see _compute_decode)

    def _prefill_compute(self, parts: Sequence[PrefillPart]) -> PrefillCompute:
        (part,) = parts  # one chunk at a time: prefills_share_rows
        # llama.cpp runs a chunk's layers in one call
        return WholePrefill(lambda: self._step(part.x, part.session, part.bundle))

    def _compute_decode(self, xs: list[torch.Tensor], sessions: list[SessionKV],
                        bundles: list[HiddenStateBundle]) -> list[torch.Tensor | None]:
        # one session and one position at a time (ggml's kernels choose by the batch: a position computed
        # among others would differ); on an error the caller truncates every session, which undoes them
        # in llama.cpp too
        outs: list[torch.Tensor | None] = []
        for x, session, bundle in zip(xs, sessions, bundles, strict=True):
            assert isinstance(session, SequenceKV)
            inputs = self._inputs(x.reshape(-1)).reshape(bundle.token_count, -1)
            want = self.spec.is_tail and bundle.sample
            rows = [self.engine.run(session.seq, inputs[r : r + 1], bundle.start_position + r, want_logits=want)
                    for r in range(bundle.token_count)]
            outs.append(None if self.spec.is_tail and not want
                        else torch.from_numpy(np.concatenate([row.reshape(1, -1) for row in rows])))
        return outs

    def _step(self, x: torch.Tensor, session: SessionKV, bundle: HiddenStateBundle) -> StepResult:
        assert isinstance(session, SequenceKV)
        start, n = bundle.start_position, bundle.token_count
        out = self.engine.run(session.seq, self._inputs(x).reshape(n, -1), start,
                              want_logits=self.spec.is_tail and bundle.sample)
        if not self.spec.is_tail:
            return StepResult(hidden_states=torch.from_numpy(out.copy()))
        if not bundle.sample:
            return StepResult()
        return self._sampled(torch.from_numpy(out), session.sampling, start + n)

    def close(self) -> None:
        self.engine.close()
