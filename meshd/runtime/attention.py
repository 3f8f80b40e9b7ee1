"""Attention for shards: each session attends over exactly its own keys, batched or not.

A batched decode step computes several sessions' projections together, but attention must not mix
them: a session's result would then depend on the other sessions' lengths (padding changes the
reduction the kernel does). So the step's cache (:class:`DecodeRows`) hands each session's own keys
and values to this attention function, which runs the family's attention once per session with
that session's exact key length, the same call whether the session is alone or one of many. Prefill
chunks of several sessions computed as one (:class:`PrefillSegments`) are split the same way: each
session's queries attend over its own keys in the call its chunk alone would make. A lone prefill
chunk goes straight through.

The function is registered with transformers' ``AttentionInterface`` as ``meshd``; a shard's config
names it, and ``config.meshd_attention`` says which kernel runs underneath: ``sdpa``, or the family's
own ``eager`` function where the model soft-caps attention logits (sdpa would skip the cap).
"""

from __future__ import annotations

import contextvars
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION_NAME = "meshd"

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class DecodeRows:
    """The cache of a decode step over rows of ``sessions`` (row ``r`` the token at ``positions[r]``
    of ``sessions[r]``; a session with drafted tokens has several consecutive rows): it appends each
    session's new keys and values to that session's own cache and keeps, for the layer being
    computed, each row's history up to its own position and its attention mask, for
    :func:`attention` to use. A row whose session is None only pads the step up to the numerics'
    band of GEMM rows: it touches no cache and attends to nothing (its output is zeros)."""

    def __init__(self, sessions: list[Any | None], masks: dict[int | None, list[torch.Tensor | None]],
                 positions: list[int]) -> None:
        self.sessions = sessions
        self.positions = positions
        self.masks = masks  # by sliding window: one boolean mask (or None) per row
        self.window: int | None = None  # set by the shard before each layer
        self.current: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_args: object,
               **_kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        self._append(key_states, value_states, layer_idx)
        return key_states, value_states  # placeholders: attention reads ``current``

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        self.current = []
        start = 0
        while start < len(self.sessions):
            end = start + 1
            while end < len(self.sessions) and self.sessions[end] is self.sessions[start]:
                end += 1
            session = self.sessions[start]
            if session is None:  # padding rows
                self.current += [None] * (end - start)
                start = end
                continue
            # the rows' [n, heads, 1, dim] states as one session's [1, heads, n, dim] keys, in position order
            keys, values = session.update(key_states[start:end].transpose(0, 2),
                                          value_states[start:end].transpose(0, 2), layer_idx)
            for r in range(start, end):
                seen = self.positions[r] + 1
                if seen == keys.shape[-2]:  # the session's last row sees all of it
                    self.current.append((keys, values))
                else:
                    self.current.append((keys[..., :seen, :], values[..., :seen, :]))
            start = end


class PrefillSegments:
    """The cache of prefill chunks of several sessions computed as one sequence: segment ``i`` is rows
    ``bounds[i]`` to ``bounds[i + 1]``, the chunk of ``sessions[i]``. It appends each segment's keys and
    values to its own session's cache and keeps, for the layer being computed, each session's whole
    history, for :func:`attention` to run each segment as its chunk alone would."""

    def __init__(self, sessions: list[Any], bounds: list[int],
                 masks: dict[int | None, list[torch.Tensor | None]]) -> None:
        self.sessions = sessions
        self.bounds = bounds
        self.masks = masks  # by sliding window: each segment's mask as its chunk alone has it (or None)
        self.window: int | None = None  # set by the shard before each layer
        self.current: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_args: object,
               **_kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        self.current = []
        for i, session in enumerate(self.sessions):
            start, end = self.bounds[i], self.bounds[i + 1]
            # copies: a session keeps a first chunk's tensors as they are, and a view would hold every
            # session's keys of the chunk for as long as any one of them (or a prefix kept of it) lives
            self.current.append(session.update(key_states[..., start:end, :].clone(),
                                               value_states[..., start:end, :].clone(), layer_idx))
        return key_states, value_states  # placeholders: attention reads ``current``


StepRows = DecodeRows | PrefillSegments
_ROWS: contextvars.ContextVar[StepRows | None] = contextvars.ContextVar("meshd_step_rows", default=None)


def step_rows() -> contextvars.ContextVar[StepRows | None]:
    """The context variable a shard sets around a step whose rows belong to several sessions."""
    return _ROWS


def _kernel(module: nn.Module) -> AttentionFn:
    if getattr(module.config, "meshd_attention", "sdpa") == "eager":
        fn: AttentionFn = importlib.import_module(type(module).__module__).eager_attention_forward
        return fn
    return sdpa_attention_forward


def _for_kernel(kernel: AttentionFn, mask: torch.Tensor | None, q_len: int, k_len: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor | None:
    """A boolean mask (True = attend) as the kernel takes it: sdpa takes booleans (None: causal),
    eager adds a float mask, and needs one for causality."""
    if kernel is sdpa_attention_forward:
        return mask
    if mask is None:
        if q_len == 1:
            return None
        past = k_len - q_len
        q = torch.arange(past, k_len, device=device).unsqueeze(1)
        mask = (torch.arange(k_len, device=device).unsqueeze(0) <= q).view(1, 1, q_len, k_len)
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill(~mask, torch.finfo(dtype).min)


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    kernel = _kernel(module)
    rows = _ROWS.get()
    if rows is None:  # one session (a prefill chunk): its own cache already returned its whole history
        mask = _for_kernel(kernel, attention_mask, query.shape[2], key.shape[2], query.dtype, query.device)
        return kernel(module, query, key, value, mask, **kwargs)
    if isinstance(rows, PrefillSegments):
        parts: list[torch.Tensor] = []
        for i, (k, v) in enumerate(rows.current):
            start, end = rows.bounds[i], rows.bounds[i + 1]
            mask = _for_kernel(kernel, rows.masks[rows.window][i], end - start, k.shape[2], query.dtype,
                               query.device)
            out, _weights = kernel(module, query[:, :, start:end, :], k, v, mask, **kwargs)
            parts.append(out)  # [1, rows, heads, dim]
        return torch.cat(parts, dim=1), None
    outputs: list[torch.Tensor] = []
    masks = rows.masks[rows.window]
    for b, current in enumerate(rows.current):
        if current is None:  # a padding row (they come after the real ones)
            outputs.append(torch.zeros_like(outputs[-1]))
            continue
        k, v = current
        mask = _for_kernel(kernel, masks[b], 1, k.shape[2], query.dtype, query.device)
        out, _weights = kernel(module, query[b : b + 1].contiguous(), k, v, mask, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=0), None


ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, attention)
