"""A shard: the layers ``[start, end)`` of one model, ready to run sessions through them.

The head shard (``start == 0``) also owns the token embedding; the tail shard (``end == n_layers``)
also owns the final norm, the LM head and sampling. A shard loads only its own tensors, keeps KV
state per ``(session_id, epoch)`` for its own layers, and checks every incoming bundle against what it
holds before computing: the layer range, the input tensor's dtype and shape, and the position.

Prefill chunks run one at a time; decode steps run through one code path whether one session or
many take part, so that a session's tokens never depend on the others (:mod:`meshd.runtime.numerics`).

A decode step may carry drafted tokens after its first (speculative decoding): each of its positions
is computed as a row of a decode step of its own, attending over exactly the positions before it, so
its logits are those one-token steps would give. The tail samples each row at its position and stops
at the first sample that differs from the draft; the next step of the session starts right after the
last accepted token, and every shard drops the KV of the positions past it then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from transformers import PretrainedConfig

from meshd.errors import BundleError, CacheMiss, ModelFormatError, PositionMismatch, RangeMismatch, ShapeMismatch
from meshd.progress import progress
from meshd.runtime.adapters import ArchitectureAdapter, adapter_for
from meshd.runtime.attention import ATTENTION_NAME, DecodeRows, PrefillSegments, StepRows, step_rows
from meshd.runtime.int8 import int8_bytes, quantize_linears, release_freed_memory
from meshd.runtime.kv import KVManager, SessionKey, SessionKV
from meshd.runtime.loader import Checkpoint, SafetensorsIndex, checkpoint_dtype, load_config, open_checkpoint
from meshd.runtime.manifest import Manifest
from meshd.runtime.numerics import DTYPES, INT8, Numerics, default_numerics, route_linears, routed
from meshd.runtime.prefix_kv import DEFAULT_PREFIX_BYTES, PrefixSnapshot, scoped_name
from meshd.runtime.sampling import sample_token
from meshd.wire.bundle import HiddenStateBundle, Phase, Sampling

log = logging.getLogger("meshd.runtime")

INPUT_IDS = "input_ids"
HIDDEN_STATES = "hidden_states"


@dataclass(frozen=True)
class ShardSpec:
    model_type: str
    n_layers: int
    start: int
    end: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.n_layers


@dataclass
class StepResult:
    """What one shard produced for one bundle: hidden states for the next hop, or a token (and, for a
    step with drafted tokens, the tokens the tail accepted after it).

    ``queue_ms`` and ``compute_ms`` are filled in by the host that ran the step: the time the step
    waited for the compute thread (other steps, handing over to the thread and back) and the time its
    forward took there (shared with the other steps of its batch).
    """

    hidden_states: torch.Tensor | None = None
    token: int | None = None
    logits: torch.Tensor | None = None
    logprob: float | None = None                  # the token's, when the session asked for them
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    following: list[StepResult] = field(default_factory=list)  # a verified step: tokens accepted after ``token``


def resolve_dtype(requested: str | torch.dtype, model_dir: Path) -> torch.dtype:
    """The held dtype: ``auto`` -> the checkpoint's own (never larger than it, never lossier), ``int8``
    -> float32 (the activations around int8 linears), else the named one."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested == "auto":
        return checkpoint_dtype(model_dir)
    if requested == INT8:
        return torch.float32
    if requested not in DTYPES:
        raise ValueError(f"dtype {requested!r} is not one of auto, {', '.join(DTYPES)}, {INT8}")
    return DTYPES[requested]


def range_tensors(adapter: ArchitectureAdapter, config: PretrainedConfig, names: Iterable[str], start: int,
                  end: int) -> list[str]:
    """The tensors of a checkpoint (``names``) that a shard of ``[start, end)`` reads: its layers', the
    embedding at the head, the final norm and the LM head (or the tied embedding) at the tail."""
    names = sorted(names)
    prefixes = tuple(adapter.layer_tensor_prefix(i) for i in range(start, end))
    wanted = [n for n in names if n.startswith(prefixes)]
    if start == 0:
        wanted.append(adapter.embed_tensor)
    if end == config.num_hidden_layers:
        wanted.append(adapter.norm_tensor)
        tied = getattr(config, "tie_word_embeddings", False) or adapter.lm_head_tensor not in names
        wanted.append(adapter.embed_tensor if tied else adapter.lm_head_tensor)
    return sorted(set(wanted))


def _shaped(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensor``, once it has the shape config.json gives it (else a model format error naming it)."""
    if tuple(tensor.shape) != shape:
        raise ModelFormatError(f"{name} has shape {list(tensor.shape)}; config.json makes it {list(shape)}")
    return tensor


class Shard:
    def __init__(
        self,
        model_dir: Path,
        start: int,
        end: int,
        *,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        numerics: Numerics | None = None,
        manifest: Manifest | None = None,
        max_chunk_tokens: int = 512,
        kv_budget_bytes: int | None = None,
        prefix_kv_bytes: int = DEFAULT_PREFIX_BYTES,
        session_ttl_s: float = 600.0,
        keep_logits: bool = False,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] | None = None,
    ) -> None:
        """``say``: where loading reports its progress (a bar on a terminal); default: log lines."""
        self.model_dir = Path(model_dir)
        self._say = say
        self.config = load_config(self.model_dir)
        self.adapter: ArchitectureAdapter = adapter_for(self.config)
        self.config._attn_implementation = ATTENTION_NAME
        self.config.meshd_attention = self.adapter.attention_implementation(self.config)
        # experts as a loop of plain linears: what the numerics' row tiles apply to (a grouped GEMM's
        # rows would depend on which other tokens chose the same expert)
        self.config._experts_implementation = "eager"
        n_layers = self.config.num_hidden_layers
        if not 0 <= start < end <= n_layers:
            raise RangeMismatch(f"layer range [{start}, {end}) is not inside [0, {n_layers})")
        held = numerics.dtype if numerics is not None else resolve_dtype(dtype, self.model_dir)
        self.numerics = numerics or replace(default_numerics(held, device), weights=INT8 if dtype == INT8 else "")
        if self.numerics.int8 and (self.numerics.device != "cpu" or held != torch.float32):
            raise ModelFormatError(f"int8 compute runs on the CPU over float32 activations, not on "
                                   f"{self.numerics.device} in {held}")
        self.device = torch.device(self.numerics.device)
        self.spec = ShardSpec(
            model_type=self.config.model_type, n_layers=n_layers, start=start, end=end,
            hidden_size=self.config.hidden_size, vocab_size=self.config.vocab_size, dtype=held,
        )
        self.batch_invariant = rows_align(self.config)
        # experts see only the rows routed to them, so their GEMMs' row counts are not the step's
        self._linears_see_the_step = not any(getattr(self.config, name, None) for name in EXPERT_COUNTS)
        self.max_chunk_tokens = max_chunk_tokens
        self.keep_logits = keep_logits
        self.kv = KVManager(budget_bytes=kv_budget_bytes, ttl_s=session_ttl_s, clock=clock,
                            prefix_bytes=prefix_kv_bytes)
        self._load(open_checkpoint(self.model_dir, manifest))

    # -- loading ---------------------------------------------------------------------------------

    def _load(self, index: Checkpoint) -> None:
        a, cfg, spec = self.adapter, self.config, self.spec
        dtype, device = spec.dtype, self.device
        self.embed: nn.Module | None = None
        self.norm: nn.Module | None = None
        self.lm_head: nn.Module | None = None
        if index.names_with_prefix(a.layer_tensor_prefix(cfg.num_hidden_layers)):
            raise ModelFormatError(f"the checkpoint holds layers from {cfg.num_hidden_layers} on, past the "
                                   f"{cfg.num_hidden_layers} config.json names: config and weights disagree")
        vocab_by_hidden = (cfg.vocab_size, cfg.hidden_size)
        if spec.is_head:
            weight = _shaped(a.embed_tensor, index.load([a.embed_tensor], dtype, device)[a.embed_tensor],
                             vocab_by_hidden)
            self.embed = a.embedding(cfg, weight).to(device)
        layers = []
        with progress(f"loading layers [{spec.start}, {spec.end})", spec.end - spec.start, "layers", say=self._say,
                      logger=log, draw=None if self._say is not None else False) as bar:
            for i in range(spec.start, spec.end):
                prefix = a.layer_tensor_prefix(i)
                names = index.names_with_prefix(prefix)
                if not names:
                    raise ModelFormatError(f"checkpoint has no tensors for layer {i}")
                state = a.layer_state({n[len(prefix):]: t for n, t in index.load(names, dtype, device).items()},
                                      cfg)
                with torch.device("meta"):
                    layer = a.decoder_layer(cfg, layer_idx=i)
                try:
                    layer.load_state_dict(state, strict=True, assign=True)
                except RuntimeError as exc:
                    raise ModelFormatError(f"layer {i} does not match the config: {exc}") from None
                # int8: each layer as soon as it is read, so that no more than one is ever held in fp32
                layers.append(quantize_linears(layer.eval()) if self.numerics.int8 else layer.eval())
                bar.advance()
        self.layers = nn.ModuleList(layers)
        self.windows = [a.sliding_window_of(cfg, i) for i in range(spec.start, spec.end)]
        self.layer_types = [a.layer_type_of(cfg, i) for i in range(spec.start, spec.end)]
        self.rotary = a.rotary_embedding(cfg).to(device)
        if spec.is_tail:
            norm = a.norm(cfg)
            norm.weight = nn.Parameter(_shaped(a.norm_tensor, index.load([a.norm_tensor], dtype, device)[a.norm_tensor],
                                               (cfg.hidden_size,)), requires_grad=False)
            self.norm = norm.to(device).eval()
            head_name = a.lm_head_tensor
            tied = getattr(cfg, "tie_word_embeddings", False)
            if not tied and head_name not in index and isinstance(index, SafetensorsIndex):
                raise ModelFormatError(f"the checkpoint has no {head_name}, and config.json does not tie the head "
                                       "to the embedding (tie_word_embeddings)")
            if tied or head_name not in index:  # a GGUF file leaves a tied head out without saying so
                head_name = a.embed_tensor
            head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
            if head_name == a.embed_tensor and self.embed is not None:  # tied, and held here already: share it
                head.weight = self.embed.weight
            else:
                head.weight = nn.Parameter(_shaped(head_name, index.load([head_name], dtype, device)[head_name],
                                                   vocab_by_hidden), requires_grad=False)
            # int8: the embedding stays a float lookup (a tied head gets an int8 copy)
            self.lm_head = quantize_linears(head) if self.numerics.int8 else head
        if self.numerics.int8:
            release_freed_memory()
        for module in (self.embed, *self.layers, self.norm, self.lm_head):
            if module is not None:
                route_linears(module)  # each step computes them its numerics' way (``routed``)

    def parameter_bytes(self) -> int:
        """Bytes of every weight this shard holds (embedding, layers, norm, head), int8 ones as int8."""
        floats = sum(p.numel() * p.element_size() for _name, p in self.weight_tensors())
        return floats + sum(int8_bytes(m) for m in (self.layers, self.lm_head) if m is not None)

    def weight_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight this shard computes with, by name, each once (a tied head is the embedding's)."""
        seen: set[int] = set()
        for prefix, module in (("embed", self.embed), ("layers", self.layers), ("norm", self.norm),
                               ("lm_head", self.lm_head)):
            if module is not None:
                for name, p in module.named_parameters(remove_duplicate=False):
                    if id(p) not in seen:
                        seen.add(id(p))
                        yield f"{prefix}.{name}", p

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token of a session takes on this shard: keys and values of every owned layer."""
        kv_heads, head_dim = self.adapter.kv_heads_and_dim(self.config)
        itemsize = torch.empty((), dtype=self.spec.dtype).element_size()
        return (self.spec.end - self.spec.start) * 2 * kv_heads * head_dim * itemsize

    # -- sessions --------------------------------------------------------------------------------

    def release(self, session_id: str, epoch: int) -> bool:
        return self.kv.release((session_id, epoch))

    def forward(self, bundle: HiddenStateBundle) -> StepResult:
        """Run one bundle through this shard's layers; on any error the session is left as it was."""
        if bundle.phase == Phase.DECODE and bundle.start_position > 0:
            result = self.forward_batch([bundle])[0]
            if isinstance(result, Exception):
                raise result
            return result
        run = self.start_prefill([bundle])
        run.advance(lambda: False)
        outcome = run.finish()[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def start_prefill(self, bundles: Sequence[HiddenStateBundle]) -> PrefillRun:
        """Prefill chunks (or sessions' first bundles) ready to compute a few layers at a time, several
        sessions' as one where :attr:`prefills_share_rows`; decode steps of other sessions may run
        between its slices (see :class:`PrefillRun`)."""
        if len(bundles) > 1 and not self.prefills_share_rows:
            raise BundleError("this shard computes one prefill chunk at a time")
        return PrefillRun(self, bundles)

    def prefill_each(self, bundles: Sequence[HiddenStateBundle]) -> list[StepResult | Exception]:
        """Each prefill chunk on its own and whole: where chunks computed as one failed, the error stays
        with the chunk causing it."""
        return [self._forward_or_error(bundle) for bundle in bundles]

    @property
    def prefills_share_rows(self) -> bool:
        """Whether prefill chunks of several sessions may compute as one sequence: their linears as one
        GEMM of all their rows, each session's attention over its own keys. Only where a GEMM computes
        each row alike at any row count (oneDNN, :mod:`meshd.runtime.numerics`), rows are whole vector
        blocks (:func:`rows_align`) and no expert routing picks a GEMM's rows, so that a chunk's
        result is bit for bit what it computes alone."""
        n = self.numerics
        return (n.backend == "torch" and n.prefill_onednn and not n.int8 and self.batch_invariant
                and self._linears_see_the_step)

    def _prefill_compute(self, parts: Sequence[PrefillPart]) -> PrefillCompute:
        return LayerwisePrefill(self, parts)

    def _kept_prefix(self, bundle: HiddenStateBundle) -> PrefixSnapshot:
        """The kept prefix the first chunk of a session continues; a cache miss when it is not kept here."""
        if bundle.phase != Phase.PREFILL:
            raise PositionMismatch("only a prefill chunk continues a kept prefix")
        snapshot = self.kv.prefixes.get(scoped_name(bundle.prefix_scope, bundle.prefix), bundle.start_position)
        if snapshot is None:
            raise CacheMiss(bundle.session_id, bundle.epoch,
                            f"the prefix of {bundle.start_position} tokens it continues is not kept here")
        return snapshot

    def forward_batch(self, bundles: Sequence[HiddenStateBundle]) -> list[StepResult | Exception]:
        """Run decode steps of one or more sessions as one decode step.

        Every bundle is checked on its own first; one that fails (wrong range, shape or position,
        an unknown session, a prefill, a second step of a session already in the batch) gets its
        error in its slot and the rest run without it. The sessions' positions and KV lengths may
        all differ: each session's keys and values stay in its own cache, and each session attends
        over exactly its own. A step with drafted tokens adds one row per position. If the compute
        itself fails, every session is rolled back and each step is run again on its own, so an
        error stays with the step causing it.
        """
        results: list[StepResult | Exception | None] = [None] * len(bundles)
        ready: list[tuple[int, torch.Tensor, SessionKV]] = []
        seen: set[SessionKey] = set()
        for i, bundle in enumerate(bundles):
            try:
                x = self._check(bundle)
                if bundle.phase != Phase.DECODE or bundle.start_position == 0:
                    raise BundleError("only decode steps of running sessions are batched")
                if bundle.token_count != 1 + len(bundle.draft) or (bundle.draft and not bundle.sample):
                    raise BundleError("a decode step carries one token and the drafted ones the tail verifies")
                key = (bundle.session_id, bundle.epoch)
                if key in seen:
                    raise BundleError(f"session {bundle.session_id!r} has two steps in one batch")
                session = self._session_at(bundle)
            except Exception as exc:
                results[i] = exc
                continue
            seen.add(key)
            ready.append((i, x, session))
        if not ready:
            return results  # type: ignore[return-value]
        if len(ready) > 1 and not self.batch_invariant:  # one at a time: see rows_align
            for i, _, _ in ready:
                results[i] = self._forward_or_error(bundles[i])
            return results  # type: ignore[return-value]
        sessions = [s for _, _, s in ready]
        steps = [bundles[i] for i, _, _ in ready]
        before = [s.length for s in sessions]
        try:
            outs = self._compute_decode([x for _, x, _ in ready], sessions, steps)
            finished = [self._decode_result(out, session, bundle)
                        for out, session, bundle in zip(outs, sessions, steps, strict=True)]
        except Exception as exc:
            for session, length in zip(sessions, before, strict=True):
                session.truncate(length)
            if len(ready) == 1:
                results[ready[0][0]] = exc
            else:
                for i, _, _ in ready:
                    results[i] = self._forward_or_error(bundles[i])
            return results  # type: ignore[return-value]
        for (i, _, session), bundle, result in zip(ready, steps, finished, strict=True):
            session.length = bundle.end_position
            session.confirmed = bundle.start_position + 1  # the drafted positions stay open until the next step
            try:
                self.kv.commit(session.key)
            except Exception as exc:
                results[i] = exc
            else:
                results[i] = result
        return results  # type: ignore[return-value]

    def _decode_result(self, out: torch.Tensor | None, session: SessionKV, bundle: HiddenStateBundle) -> StepResult:
        """What a decode step gives: its rows' hidden states, or (the tail) the tokens it accepts."""
        if not self.spec.is_tail:
            return StepResult(hidden_states=out)
        if out is None:
            return StepResult()
        return self._verified(out, session.sampling, bundle)

    def _verified(self, logits: torch.Tensor, sampling: Sampling, bundle: HiddenStateBundle) -> StepResult:
        """The tokens of a decode step, one per row of ``logits``, sampled at their positions, for as
        long as each equals the drafted token that the next row was computed on."""
        first: StepResult | None = None
        for row in range(bundle.token_count):
            result = self._sampled(logits[row], sampling, bundle.start_position + 1 + row)
            if first is None:
                first = result
            else:
                first.following.append(result)
            if row >= len(bundle.draft) or result.token != bundle.draft[row]:
                break
        assert first is not None
        return first

    def _forward_or_error(self, bundle: HiddenStateBundle) -> StepResult | Exception:
        try:
            return self.forward(bundle)
        except Exception as exc:
            return exc

    def _check(self, bundle: HiddenStateBundle) -> torch.Tensor:
        """The bundle's input tensor, once its range, size and tensors fit this shard."""
        spec = self.spec
        if (bundle.range_start, bundle.range_end) != (spec.start, spec.end):
            raise RangeMismatch(
                f"bundle is for layers [{bundle.range_start}, {bundle.range_end}), "
                f"this shard holds [{spec.start}, {spec.end})"
            )
        if bundle.token_count > self.max_chunk_tokens:
            raise BundleError(f"bundle carries {bundle.token_count} tokens; the chunk limit is {self.max_chunk_tokens}")
        return self._input(bundle)

    def _session_at(self, bundle: HiddenStateBundle) -> SessionKV:
        """The running session a bundle continues, checked to hold exactly the tokens before it."""
        session = self.kv.get((bundle.session_id, bundle.epoch))
        if bundle.phase == Phase.DECODE and session.confirmed <= bundle.start_position < session.length:
            session.truncate(bundle.start_position)  # drafted positions the tail did not accept
        if bundle.start_position != session.length:
            raise PositionMismatch(
                f"bundle starts at position {bundle.start_position}, "
                f"session {bundle.session_id!r} holds {session.length} tokens"
            )
        return session

    def _input(self, bundle: HiddenStateBundle) -> torch.Tensor:
        spec, n = self.spec, bundle.token_count
        if spec.is_head:
            ids = bundle.tensors.get(INPUT_IDS)
            if ids is None:
                raise ShapeMismatch(f"the head shard needs an {INPUT_IDS!r} tensor")
            if ids.dtype != torch.int64:
                raise ShapeMismatch(f"{INPUT_IDS!r} must be int64, got {ids.dtype}")
            if tuple(ids.shape) != (n,):
                raise ShapeMismatch(f"{INPUT_IDS!r} has shape {list(ids.shape)}, expected [{n}]")
            if int(ids.min()) < 0 or int(ids.max()) >= spec.vocab_size:
                raise ShapeMismatch(f"token ids must lie in [0, {spec.vocab_size})")
            return ids.to(self.device)
        hidden = bundle.tensors.get(HIDDEN_STATES)
        if hidden is None:
            raise ShapeMismatch(f"shard [{spec.start}, {spec.end}) needs a {HIDDEN_STATES!r} tensor")
        if hidden.dtype != spec.dtype:
            raise ShapeMismatch(f"{HIDDEN_STATES!r} must be {spec.dtype}, got {hidden.dtype}")
        if tuple(hidden.shape) != (n, spec.hidden_size):
            raise ShapeMismatch(
                f"{HIDDEN_STATES!r} has shape {list(hidden.shape)}, expected [{n}, {spec.hidden_size}]"
            )
        return hidden.to(self.device)

    # -- compute ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def _compute_decode(self, xs: list[torch.Tensor], sessions: list[SessionKV],
                        bundles: list[HiddenStateBundle]) -> list[torch.Tensor | None]:
        """One decode step over every position of ``bundles`` (one row each): per bundle its rows'
        hidden states ``[n, hidden]``, or on the tail their logits ``[n, vocab]`` (None unsampled).

        A shard whose rows are not batch-invariant (:func:`rows_align`) computes a step's rows one
        after another, each as a step of its own."""
        rows = [(b, offset) for b, bundle in enumerate(bundles) for offset in range(bundle.token_count)]
        inputs = [xs[b][offset : offset + 1] for b, offset in rows]
        positions = [bundles[b].start_position + offset for b, offset in rows]
        if len(rows) > 1 and not self.batch_invariant:
            outs = [out for r, (b, _) in enumerate(rows)
                    for out in self._decode_rows([inputs[r]], [sessions[b]], [positions[r]])]
        else:
            outs = self._decode_rows(inputs, [sessions[b] for b, _ in rows], positions)
        grouped: list[torch.Tensor | None] = []
        at = 0
        for bundle in bundles:
            part = torch.cat(outs[at : at + bundle.token_count])
            grouped.append(part if not self.spec.is_tail or bundle.sample else None)
            at += bundle.token_count
        return grouped

    def _decode_rows(self, xs: list[torch.Tensor], sessions: list[SessionKV], positions: list[int],
                     ) -> list[torch.Tensor]:
        """One decode step of ``len(xs)`` rows, row ``r`` the token at ``positions[r]`` of
        ``sessions[r]`` (a session's rows consecutive, in order): each row's hidden state ``[1, hidden]``,
        or on the tail its logits ``[1, vocab]``."""
        real = len(xs)
        padding = max(0, self.numerics.decode_band[0] - real)  # up to the band's bottom: see numerics
        xs = xs + [xs[-1]] * padding
        positions = positions + [positions[-1]] * padding
        masks = {w: [_decode_mask(p, w, self.device) for p in positions] for w in set(self.windows)}
        rows = DecodeRows([*sessions, *[None] * padding], masks, positions)
        token = step_rows().set(rows)
        try:
            with routed(self.numerics.decode(rows=len(xs) if self._linears_see_the_step else None)):
                stacked = torch.stack(xs)  # [R, 1] token ids on the head, else [R, 1, hidden]
                hidden = self.embed(stacked) if self.embed is not None else stacked
                position_ids = torch.tensor(positions, dtype=torch.long, device=self.device).unsqueeze(1)
                hidden = self._run_layers(hidden, position_ids, rows, {w: None for w in masks})
                if self.lm_head is None:
                    return [hidden[r] for r in range(real)]
                logits = self._logits(hidden)
        finally:
            step_rows().reset(token)
        return [logits[r : r + 1] for r in range(real)]

    def _sampled(self, logits: torch.Tensor, sampling: Sampling, position: int) -> StepResult:
        """The token for ``position`` from one row of logits, with its log-probabilities if asked."""
        token = sample_token(logits, sampling, position=position)
        result = StepResult(token=token, logits=logits.clone() if self.keep_logits else None)
        if sampling.logprobs:
            logprobs = torch.log_softmax(logits.double(), dim=-1)
            result.logprob = float(logprobs[token])
            if sampling.top_logprobs:
                top = torch.topk(logprobs, min(sampling.top_logprobs, logprobs.numel()))
                result.top_logprobs = [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)]
        return result

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """``[B, 1, hidden]`` last positions -> ``[B, vocab]`` float32 logits, as the family's CausalLM gives."""
        assert self.norm is not None and self.lm_head is not None
        logits = self.adapter.logits(self.config, self.lm_head(self.norm(last)))
        return logits[:, -1].float().cpu()

    def _run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: SessionKV | StepRows,
                    masks: dict[int | None, torch.Tensor | None]) -> torch.Tensor:
        """This shard's decoder layers over ``hidden``, with rotary tables per layer type and one
        attention mask per sliding-window size."""
        position_embeddings = self._position_embeddings(hidden, position_ids)
        for index in range(len(self.layers)):
            hidden = self._run_layer(index, hidden, position_ids, cache, masks, position_embeddings)
        return hidden

    def _position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        return {t: self.adapter.position_embeddings(self.rotary, hidden, position_ids, t)
                for t in set(self.layer_types)}

    def _run_layer(self, index: int, hidden: torch.Tensor, position_ids: torch.Tensor, cache: SessionKV | StepRows,
                   masks: dict[int | None, torch.Tensor | None], position_embeddings: dict[str, Any]) -> torch.Tensor:
        window = self.windows[index]
        if isinstance(cache, (DecodeRows, PrefillSegments)):
            cache.window = window
        return self.layers[index](
            hidden,
            attention_mask=masks[window],
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            position_embeddings=position_embeddings[self.layer_types[index]],
        )


@dataclass
class PrefillPart:
    """One session's chunk in a prefill: its input (ids on the head, else hidden states), its session
    and its bundle."""

    x: torch.Tensor
    session: SessionKV
    bundle: HiddenStateBundle


class PrefillCompute(Protocol):
    """A prefill's compute, done in slices: each :meth:`advance` runs at least one piece, then more
    while ``stop()`` is false; it returns each part's result once the last piece ran, else None."""

    def advance(self, stop: Callable[[], bool]) -> list[StepResult] | None: ...


class LayerwisePrefill:
    """Prefill chunks through a shard's layers, one layer a piece. Nothing is held across slices but
    tensors: every slice enters the numerics' mode itself, so a decode step run between two slices
    computes exactly as it would alone, and the chunks' layers compute exactly as in one call.

    Several sessions' chunks run as one sequence of all their rows, each session's attention over its
    own keys (:class:`meshd.runtime.attention.PrefillSegments`); a lone chunk runs on its own cache."""

    def __init__(self, shard: Shard, parts: Sequence[PrefillPart]) -> None:
        self.shard, self.parts = shard, list(parts)
        bounds = [0]
        for part in self.parts:
            bounds.append(bounds[-1] + part.bundle.token_count)
        self.bounds = bounds
        windows = set(shard.windows)
        with torch.inference_mode(), routed(shard.numerics.prefill()):
            x = torch.cat([part.x for part in self.parts]) if len(self.parts) > 1 else self.parts[0].x
            hidden = shard.embed(x) if shard.embed is not None else x
            self.hidden = hidden.unsqueeze(0)
            self.position_ids = torch.cat([
                torch.arange(p.bundle.start_position, p.bundle.start_position + p.bundle.token_count,
                             dtype=torch.long, device=shard.device) for p in self.parts]).unsqueeze(0)
            masks = {w: [_attention_mask(p.bundle.start_position, p.bundle.token_count, w, shard.device)
                         for p in self.parts] for w in windows}
            self.position_embeddings = shard._position_embeddings(self.hidden, self.position_ids)
        self.segments: PrefillSegments | None = None
        if len(self.parts) > 1:  # each segment's mask goes to attention through the cache, not the layer
            self.segments = PrefillSegments([p.session for p in self.parts], bounds, masks)
            self.masks: dict[int | None, torch.Tensor | None] = {w: None for w in windows}
        else:
            self.masks = {w: m[0] for w, m in masks.items()}
        self.next_layer = 0

    def advance(self, stop: Callable[[], bool]) -> list[StepResult] | None:
        shard = self.shard
        cache: SessionKV | PrefillSegments = self.segments if self.segments is not None else self.parts[0].session
        token = step_rows().set(self.segments)
        try:
            with torch.inference_mode(), routed(shard.numerics.prefill()):
                while self.next_layer < len(shard.layers):
                    self.hidden = shard._run_layer(self.next_layer, self.hidden, self.position_ids, cache,
                                                   self.masks, self.position_embeddings)
                    self.next_layer += 1
                    if self.next_layer < len(shard.layers) and stop():
                        return None
        finally:
            step_rows().reset(token)
        return [self._result(i) for i in range(len(self.parts))]

    @torch.inference_mode()
    def _result(self, i: int) -> StepResult:
        shard, part = self.shard, self.parts[i]
        start, end = self.bounds[i], self.bounds[i + 1]
        if shard.lm_head is None:
            return StepResult(hidden_states=self.hidden[0, start:end])
        if not part.bundle.sample:
            return StepResult()
        with routed(shard.numerics.decode(rows=1)):  # one row, as in a decode step: no upcast of the whole head
            logits = shard._logits(self.hidden[:, end - 1 : end, :])[0]
        return shard._sampled(logits, part.session.sampling, part.bundle.start_position + part.bundle.token_count)


class WholePrefill:
    """A prefill computed in one piece (a backend that cannot stop between layers)."""

    def __init__(self, compute: Callable[[], StepResult]) -> None:
        self._compute = compute

    def advance(self, stop: Callable[[], bool]) -> list[StepResult] | None:
        return [self._compute()]


@dataclass
class _Chunk:
    """A bundle of a prefill run and what undoes it: the session's length before it, and whether the
    run opened the session."""

    slot: int
    bundle: HiddenStateBundle
    session: SessionKV
    before: int
    opened: bool

    @property
    def key(self) -> SessionKey:
        return self.bundle.session_id, self.bundle.epoch


class PrefillRun:
    """Prefill bundles of one or more sessions, from their checks to their committed KV, computed as
    one in slices.

    Opening it checks each bundle and opens (or finds) its session; a bundle that fails its checks
    has its error as its outcome and the others run without it. :meth:`advance` computes until
    ``stop()`` says to pause (at least one piece each time) and says whether the compute is done;
    :meth:`finish` commits each session's KV and gives each bundle's outcome. Any error in a slice,
    or :meth:`abort`, leaves every session as it was before the run, as a failed
    :meth:`Shard.forward` does. Between slices the shard may run other sessions' decode steps:
    nothing of these sessions changes but the KV of their layers already computed, which are past
    their lengths until :meth:`finish`."""

    def __init__(self, shard: Shard, bundles: Sequence[HiddenStateBundle]) -> None:
        self.shard = shard
        self.outcomes: list[StepResult | Exception | None] = [None] * len(bundles)
        self._chunks: list[_Chunk] = []
        self._results: list[StepResult] | None = None
        self._closed = False
        parts: list[PrefillPart] = []
        for slot, bundle in enumerate(bundles):
            try:
                if any(c.key == (bundle.session_id, bundle.epoch) for c in self._chunks):
                    raise BundleError(f"session {bundle.session_id!r} has two chunks in one prefill")
                x = shard._check(bundle)
                chunk = self._open(slot, bundle)
            except Exception as exc:
                self.outcomes[slot] = exc
                continue
            self._chunks.append(chunk)
            parts.append(PrefillPart(x, chunk.session, bundle))
        self._compute: PrefillCompute | None = None
        if parts:
            try:
                self._compute = shard._prefill_compute(parts)
            except BaseException:
                self.abort()
                raise

    def _open(self, slot: int, bundle: HiddenStateBundle) -> _Chunk:
        shard, key = self.shard, (bundle.session_id, bundle.epoch)
        opened = bundle.start_position == 0 or bool(bundle.prefix)
        if bundle.prefix:
            session = shard.kv.open(key, bundle.sampling or Sampling(), shard._kept_prefix(bundle))
        elif bundle.start_position == 0:
            if bundle.phase != Phase.PREFILL:
                raise PositionMismatch("a session starts with a prefill bundle at position 0")
            session = shard.kv.open(key, bundle.sampling or Sampling())
        else:
            session = shard._session_at(bundle)
        return _Chunk(slot, bundle, session, session.length, opened)

    @property
    def done(self) -> bool:
        return self._compute is None or self._results is not None

    def advance(self, stop: Callable[[], bool]) -> bool:
        """Compute until ``stop()`` (checked after each piece) or the end; True once the compute is done."""
        if self._closed:
            raise RuntimeError("this prefill has ended")
        if self._compute is None:
            return True
        try:
            self._results = self._compute.advance(stop)
        except BaseException:
            self.abort()
            raise
        return self._results is not None

    def finish(self) -> list[StepResult | Exception]:
        """Commit each chunk's KV to its session and give every bundle's outcome, in order."""
        if not self.done:
            raise RuntimeError("the prefill has not finished computing")
        shard = self.shard
        self._closed = True
        for chunk, result in zip(self._chunks, self._results or [], strict=True):
            bundle, key = chunk.bundle, chunk.key
            chunk.session.length = chunk.session.confirmed = chunk.before + bundle.token_count
            try:
                if key not in shard.kv:  # released (client gone, hop leaving) while this step ran
                    raise CacheMiss(bundle.session_id, bundle.epoch, "released during the step")
                shard.kv.commit(key)
                if bundle.keep_prefix:
                    shard.kv.keep_prefix(scoped_name(bundle.prefix_scope, bundle.keep_prefix), key)
            except Exception as exc:
                self.outcomes[chunk.slot] = exc
            else:
                self.outcomes[chunk.slot] = result
        return self.outcomes  # type: ignore[return-value]

    def abort(self) -> None:
        """Undo the chunks: each session holds what it held before (a session the run opened is released)."""
        if self._closed:
            return
        self._closed = True
        for chunk in self._chunks:
            chunk.session.truncate(chunk.before)
            if chunk.opened:
                self.shard.kv.release(chunk.key)


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")  # config fields of mixture-of-experts models
ROW_ALIGN = 32  # elements: CPU kernels run their vector loops over this many at a time, then a tail


def rows_align(config: PretrainedConfig) -> bool:
    """Whether a row of every activation of a decode step is a whole number of ``ROW_ALIGN`` elements.

    Elementwise kernels (activations, norms, rotary) handle the tail of a tensor past its last full
    vector block with scalar code, whose rounding differs; in a batch, the elements at a row's end are
    in the middle of the tensor. When every row width is a multiple of the block, each row is computed
    the same way wherever it sits, and decode steps may share a batch; every released model's widths
    are (hidden, MLP and head sizes are multiples of 64). Otherwise a shard runs its decode steps one
    session at a time, so that a reply still never depends on the batch.
    """
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    widths = [config.hidden_size, heads * head_dim, kv_heads * head_dim]
    widths += [int(w) for w in (getattr(config, "intermediate_size", None),
                                getattr(config, "moe_intermediate_size", None)) if w]
    return all(w % ROW_ALIGN == 0 for w in widths) and head_dim % (ROW_ALIGN // 2) == 0


def _attention_mask(past: int, n: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean mask (True = attend) for ``n`` new tokens after ``past`` cached ones, or None when
    plain causal attention (or, for one token, full attention) already gives the right result."""
    total = past + n
    windowed = window is not None and total > window
    if not windowed and (n == 1 or past == 0):
        return None
    q = torch.arange(past, total, device=device).unsqueeze(1)
    k = torch.arange(total, device=device).unsqueeze(0)
    allowed = k <= q
    if windowed:
        assert window is not None
        allowed &= (q - k) < window
    return allowed.view(1, 1, n, total)


def _decode_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """The mask of one decode token after ``length`` cached ones: None when it sees them all."""
    return _attention_mask(length, 1, window, device)
