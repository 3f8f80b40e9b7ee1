"""A shard: the layers ``[start, end)`` of one model, ready to run sessions through them.

The head shard (``start == 0``) also owns the token embedding; the tail shard (``end == n_layers``)
also owns the final norm, the LM head and sampling. A shard loads only its own tensors, keeps KV
state per ``(session_id, epoch)`` for its own layers, and checks every incoming bundle against what it
holds before computing: the layer range, the input tensor's dtype and shape, and the position.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from meshd.errors import BundleError, ModelFormatError, PositionMismatch, RangeMismatch, ShapeMismatch
from meshd.runtime.adapters import ArchitectureAdapter, adapter_for
from meshd.runtime.kv import KVManager, SessionKey
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
    """What one shard produced for one bundle: hidden states for the next hop, or a token."""

    hidden_states: torch.Tensor | None = None
    token: int | None = None
    logits: torch.Tensor | None = None


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

    # -- sessions --------------------------------------------------------------------------------

    def release(self, session_id: str, epoch: int) -> bool:
        return self.kv.release((session_id, epoch))

    def forward(self, bundle: HiddenStateBundle) -> StepResult:
        """Run one bundle through this shard's layers; on any error the session is left as it was."""
        spec = self.spec
        if (bundle.range_start, bundle.range_end) != (spec.start, spec.end):
            raise RangeMismatch(
                f"bundle is for layers [{bundle.range_start}, {bundle.range_end}), "
                f"this shard holds [{spec.start}, {spec.end})"
            )
        if bundle.token_count > self.max_chunk_tokens:
            raise BundleError(f"bundle carries {bundle.token_count} tokens; the chunk limit is {self.max_chunk_tokens}")
        x = self._input(bundle)
        key: SessionKey = (bundle.session_id, bundle.epoch)
        if bundle.start_position == 0:
            if bundle.phase != Phase.PREFILL:
                raise PositionMismatch("a session starts with a prefill bundle at position 0")
            session = self.kv.open(key, bundle.sampling or Sampling())
        else:
            session = self.kv.get(key)
            if bundle.start_position != session.length:
                raise PositionMismatch(
                    f"bundle starts at position {bundle.start_position}, "
                    f"session {bundle.session_id!r} holds {session.length} tokens"
                )
        before = session.length
        try:
            result = self._compute(x, session, bundle)
        except BaseException:
            session.truncate(before)
            if before == 0:
                self.kv.release(key)
            raise
        session.length = before + bundle.token_count
        self.kv.commit(key)
        return result

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
    def _compute(self, x: torch.Tensor, session, bundle: HiddenStateBundle) -> StepResult:
        start, n = bundle.start_position, bundle.token_count
        hidden = self.embed(x) if self.embed is not None else x
        hidden = hidden.unsqueeze(0)
        position_ids = torch.arange(start, start + n, dtype=torch.long).unsqueeze(0)
        position_embeddings = self.rotary(hidden, position_ids)
        masks: dict[int | None, torch.Tensor | None] = {}
        for layer, window in zip(self.layers, self.windows, strict=True):
            if window not in masks:
                masks[window] = _attention_mask(start, n, window)
            hidden = layer(
                hidden,
                attention_mask=masks[window],
                position_ids=position_ids,
                cache=session,
                use_cache=True,
                position_embeddings=position_embeddings,
            )
        if self.lm_head is None:
            return StepResult(hidden_states=hidden[0])
        if not bundle.sample:
            return StepResult()
        last = self.norm(hidden[:, -1:, :])
        logits = self.lm_head(last)[0, -1]
        token = sample_token(logits, session.sampling, position=start + n)
        return StepResult(token=token, logits=logits.clone() if self.keep_logits else None)


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
