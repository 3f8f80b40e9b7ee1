"""A shard: the layers ``[start, end)`` of one model, ready to run sessions through them.

The head shard (``start == 0``) also owns the token embedding; the tail shard (``end == n_layers``)
also owns the final norm, the LM head and sampling. A shard loads only its own tensors, keeps KV
state per ``(session_id, epoch)`` for its own layers, and checks every incoming bundle against what it
holds before computing: the layer range, the input tensor's dtype and shape, and the position.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from meshd.errors import BundleError, CacheMiss, ModelFormatError, PositionMismatch, RangeMismatch, ShapeMismatch
from meshd.runtime.adapters import ArchitectureAdapter, adapter_for
from meshd.runtime.kv import KVManager, SessionKey, SessionKV
from meshd.runtime.loader import CheckpointIndex, load_config
from meshd.runtime.sampling import sample_token
from meshd.wire.bundle import HiddenStateBundle, Phase, Sampling

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
    """What one shard produced for one bundle: hidden states for the next hop, or a token.

    ``queue_ms`` and ``compute_ms`` are filled in by the host that ran the step: the time the step
    waited for the compute thread (other steps, handing over to the thread and back) and the time its
    forward took there (shared with the other steps of its batch).
    """

    hidden_states: torch.Tensor | None = None
    token: int | None = None
    logits: torch.Tensor | None = None
    queue_ms: float = 0.0
    compute_ms: float = 0.0


class Shard:
    def __init__(
        self,
        model_dir: Path,
        start: int,
        end: int,
        *,
        max_chunk_tokens: int = 512,
        kv_budget_bytes: int | None = None,
        session_ttl_s: float = 600.0,
        keep_logits: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = load_config(self.model_dir)
        self.adapter: ArchitectureAdapter = adapter_for(self.config)
        n_layers = self.config.num_hidden_layers
        if not 0 <= start < end <= n_layers:
            raise RangeMismatch(f"layer range [{start}, {end}) is not inside [0, {n_layers})")
        dtype = torch.float32
        self.spec = ShardSpec(
            model_type=self.config.model_type, n_layers=n_layers, start=start, end=end,
            hidden_size=self.config.hidden_size, vocab_size=self.config.vocab_size, dtype=dtype,
        )
        self.max_chunk_tokens = max_chunk_tokens
        self.keep_logits = keep_logits
        self.kv = KVManager(budget_bytes=kv_budget_bytes, ttl_s=session_ttl_s, clock=clock)
        self._load(CheckpointIndex(self.model_dir), dtype)

    # -- loading ---------------------------------------------------------------------------------

    def _load(self, index: CheckpointIndex, dtype: torch.dtype) -> None:
        a, cfg, spec = self.adapter, self.config, self.spec
        self.embed: nn.Embedding | None = None
        self.norm: nn.Module | None = None
        self.lm_head: nn.Linear | None = None
        if spec.is_head:
            weight = index.load([a.embed_tensor], dtype)[a.embed_tensor]
            self.embed = nn.Embedding.from_pretrained(weight, freeze=True)
        layers = []
        for i in range(spec.start, spec.end):
            prefix = a.layer_tensor_prefix(i)
            names = index.names_with_prefix(prefix)
            if not names:
                raise ModelFormatError(f"checkpoint has no tensors for layer {i}")
            state = {n[len(prefix):]: t for n, t in index.load(names, dtype).items()}
            with torch.device("meta"):
                layer = a.decoder_layer(cfg, layer_idx=i)
            layer.load_state_dict(state, strict=True, assign=True)
            layers.append(layer.eval())
        self.layers = nn.ModuleList(layers)
        self.windows = [a.sliding_window_of(cfg, i) for i in range(spec.start, spec.end)]
        self.rotary = a.rotary_embedding(config=cfg)
        if spec.is_tail:
            norm = a.norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            norm.weight = nn.Parameter(index.load([a.norm_tensor], dtype)[a.norm_tensor], requires_grad=False)
            self.norm = norm.eval()
            head_name = a.lm_head_tensor
            if getattr(cfg, "tie_word_embeddings", False) or head_name not in index:
                head_name = a.embed_tensor
            head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
            head.weight = nn.Parameter(index.load([head_name], dtype)[head_name], requires_grad=False)
            self.lm_head = head

    def parameter_bytes(self) -> int:
        """Bytes of every weight this shard holds (embedding, layers, norm, head)."""
        seen: set[int] = set()
        total = 0
        for module in (self.embed, self.layers, self.norm, self.lm_head):
            if module is None:
                continue
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
        return total

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
        x = self._check(bundle)
        key: SessionKey = (bundle.session_id, bundle.epoch)
        if bundle.start_position == 0:
            if bundle.phase != Phase.PREFILL:
                raise PositionMismatch("a session starts with a prefill bundle at position 0")
            session = self.kv.open(key, bundle.sampling or Sampling())
        else:
            session = self._session_at(bundle)
        before = session.length
        try:
            result = self._compute(x, session, bundle)
        except BaseException:
            session.truncate(before)
            if before == 0:
                self.kv.release(key)
            raise
        session.length = before + bundle.token_count
        if key not in self.kv:  # released (client gone, hop leaving) while this step ran
            raise CacheMiss(bundle.session_id, bundle.epoch, "released during the step")
        self.kv.commit(key)
        return result

    def forward_batch(self, bundles: Sequence[HiddenStateBundle]) -> list[StepResult | Exception]:
        """Run decode steps of different sessions as one batched forward.

        Every bundle is checked on its own first; one that fails (wrong range, shape or position,
        an unknown session, a prefill, a second step of a session already in the batch) gets its
        error in its slot and the rest run without it. The sessions' positions and KV lengths may
        all differ: each session's keys and values stay in its own cache, and the batch attends to
        them padded to the longest with a mask. If the batched compute itself fails, every session
        is rolled back and the steps are run one by one, so an error stays with the step causing it.
        """
        results: list[StepResult | Exception | None] = [None] * len(bundles)
        ready: list[tuple[int, torch.Tensor, SessionKV]] = []
        seen: set[SessionKey] = set()
        for i, bundle in enumerate(bundles):
            try:
                x = self._check(bundle)
                if bundle.phase != Phase.DECODE or bundle.token_count != 1 or bundle.start_position == 0:
                    raise BundleError("only single-token decode steps of running sessions are batched")
                key = (bundle.session_id, bundle.epoch)
                if key in seen:
                    raise BundleError(f"session {bundle.session_id!r} has two steps in one batch")
                session = self._session_at(bundle)
            except Exception as exc:
                results[i] = exc
                continue
            seen.add(key)
            ready.append((i, x, session))
        if len(ready) == 1:
            i = ready[0][0]
            results[i] = self._forward_or_error(bundles[i])
        elif ready:
            sessions = [s for _, _, s in ready]
            before = [s.length for s in sessions]
            try:
                outs = self._compute_batch([x for _, x, _ in ready], sessions, [bundles[i] for i, _, _ in ready])
            except Exception:
                for session, length in zip(sessions, before, strict=True):
                    session.truncate(length)
                for i, _, _ in ready:
                    results[i] = self._forward_or_error(bundles[i])
            else:
                for (i, _, session), out in zip(ready, outs, strict=True):
                    session.length += 1
                    try:
                        self.kv.commit(session.key)
                    except Exception as exc:
                        results[i] = exc
                    else:
                        results[i] = out
        return results  # type: ignore[return-value]

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
            return ids
        hidden = bundle.tensors.get(HIDDEN_STATES)
        if hidden is None:
            raise ShapeMismatch(f"shard [{spec.start}, {spec.end}) needs a {HIDDEN_STATES!r} tensor")
        if hidden.dtype != spec.dtype:
            raise ShapeMismatch(f"{HIDDEN_STATES!r} must be {spec.dtype}, got {hidden.dtype}")
        if tuple(hidden.shape) != (n, spec.hidden_size):
            raise ShapeMismatch(
                f"{HIDDEN_STATES!r} has shape {list(hidden.shape)}, expected [{n}, {spec.hidden_size}]"
            )
        return hidden

    @torch.inference_mode()
    def _compute(self, x: torch.Tensor, session: SessionKV, bundle: HiddenStateBundle) -> StepResult:
        start, n = bundle.start_position, bundle.token_count
        hidden = self.embed(x) if self.embed is not None else x
        hidden = hidden.unsqueeze(0)
        position_ids = torch.arange(start, start + n, dtype=torch.long).unsqueeze(0)
        hidden = self._run_layers(hidden, position_ids, session, lambda window: _attention_mask(start, n, window))
        if self.lm_head is None:
            return StepResult(hidden_states=hidden[0])
        if not bundle.sample:
            return StepResult()
        assert self.norm is not None
        last = self.norm(hidden[:, -1:, :])
        logits = self.lm_head(last)[0, -1]
        token = sample_token(logits, session.sampling, position=start + n)
        return StepResult(token=token, logits=logits.clone() if self.keep_logits else None)

    def _run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: SessionKV | BatchCache,
                    mask_for: Callable[[int | None], torch.Tensor | None]) -> torch.Tensor:
        """This shard's decoder layers over ``hidden``; one attention mask per sliding-window size."""
        position_embeddings = self.rotary(hidden, position_ids)
        masks: dict[int | None, torch.Tensor | None] = {}
        for layer, window in zip(self.layers, self.windows, strict=True):
            if window not in masks:
                masks[window] = mask_for(window)
            hidden = layer(
                hidden,
                attention_mask=masks[window],
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                position_embeddings=position_embeddings,
            )
        return hidden

    @torch.inference_mode()
    def _compute_batch(self, xs: list[torch.Tensor], sessions: list[SessionKV],
                       bundles: list[HiddenStateBundle]) -> list[StepResult]:
        """One decode token for each of ``len(sessions)`` sessions, as a ``[B, 1, hidden]`` batch."""
        stacked = torch.stack(xs)  # [B, 1] token ids on the head, else [B, 1, hidden]
        hidden = self.embed(stacked) if self.embed is not None else stacked
        lengths = [s.length for s in sessions]
        position_ids = torch.tensor(lengths, dtype=torch.long).unsqueeze(1)
        hidden = self._run_layers(hidden, position_ids, BatchCache(sessions),
                                  lambda window: _batch_decode_mask(lengths, window))
        if self.lm_head is None:
            return [StepResult(hidden_states=hidden[b]) for b in range(len(sessions))]
        wanted = [b for b, bundle in enumerate(bundles) if bundle.sample]
        results = [StepResult() for _ in bundles]
        if wanted:
            assert self.norm is not None
            logits = self.lm_head(self.norm(hidden[wanted, -1:, :]))[:, -1]
            for row, b in enumerate(wanted):
                token = sample_token(logits[row], sessions[b].sampling, position=lengths[b] + 1)
                results[b] = StepResult(token=token, logits=logits[row].clone() if self.keep_logits else None)
        return results


def _attention_mask(past: int, n: int, window: int | None) -> torch.Tensor | None:
    """Boolean mask (True = attend) for ``n`` new tokens after ``past`` cached ones, or None when
    plain causal attention (or, for one token, full attention) already gives the right result."""
    total = past + n
    windowed = window is not None and total > window
    if not windowed and (n == 1 or past == 0):
        return None
    q = torch.arange(past, total).unsqueeze(1)
    k = torch.arange(total).unsqueeze(0)
    allowed = k <= q
    if windowed:
        allowed &= (q - k) < window
    return allowed.view(1, 1, n, total)


def _batch_decode_mask(lengths: list[int], window: int | None) -> torch.Tensor:
    """Boolean mask ``[B, 1, 1, max(lengths) + 1]`` for one new token per session: session ``b``
    attends to its own ``lengths[b] + 1`` keys (the rest is padding), within its window if any."""
    total = torch.tensor(lengths).unsqueeze(1) + 1  # keys each session holds after this step
    k = torch.arange(max(lengths) + 1).unsqueeze(0)
    allowed = k < total
    if window is not None:
        allowed &= (total - 1 - k) < window
    return allowed.view(len(lengths), 1, 1, -1)


class BatchCache:
    """The cache the attention modules see during a batched decode step.

    ``update`` appends each session's new keys and values to that session's own cache, then returns
    the batch's history padded to the longest session, ``[B, kv_heads, max_len, head_dim]``; the
    padding is masked out by :func:`_batch_decode_mask`.
    """

    def __init__(self, sessions: list[SessionKV]) -> None:
        self.sessions = sessions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_args: object,
               **_kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = [], []
        for b, session in enumerate(self.sessions):
            k, v = session.update(key_states[b : b + 1], value_states[b : b + 1], layer_idx)
            keys.append(k[0])
            values.append(v[0])
        return _pad_stack(keys), _pad_stack(values)


def _pad_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[kv_heads, L_b, head_dim]`` tensors -> ``[B, kv_heads, max L_b, head_dim]``, zero-padded."""
    longest = max(t.shape[-2] for t in tensors)
    heads, dim = tensors[0].shape[0], tensors[0].shape[-1]
    out = tensors[0].new_zeros(len(tensors), heads, longest, dim)
    for b, t in enumerate(tensors):
        out[b, :, : t.shape[-2]] = t
    return out
