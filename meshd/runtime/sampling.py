"""Token sampling on the tail: greedy, temperature, top-k, top-p.

Reproducible by construction: the random draw for the token at position ``p`` of a session comes
from a generator seeded with ``(seed, p)`` alone, so the same seed gives the same tokens whatever the
split of the model, and a session re-run after a repair draws exactly what it drew before.
"""

from __future__ import annotations

import hashlib

import torch

from meshd.wire.bundle import Sampling


def draw_seed(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def sample_token(logits: torch.Tensor, sampling: Sampling, position: int) -> int:
    """Pick the token for ``position`` from one row of logits (shape ``[vocab]``)."""
    if logits.dim() != 1:
        raise ValueError(f"expected one row of logits, got shape {tuple(logits.shape)}")
    if sampling.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.to(torch.float64) / sampling.temperature
    order = torch.argsort(scores, descending=True, stable=True)
    sorted_scores = scores[order]
    if sampling.top_k > 0:
        sorted_scores = sorted_scores[: sampling.top_k]
    probs = torch.softmax(sorted_scores, dim=0)
    if 0.0 < sampling.top_p < 1.0:
        cumulative = torch.cumsum(probs, dim=0)
        keep = int(torch.searchsorted(cumulative, torch.tensor(sampling.top_p, dtype=torch.float64)).item()) + 1
        probs = probs[: max(1, keep)]
        probs = probs / probs.sum()
    gen = torch.Generator().manual_seed(draw_seed(sampling.seed, position))
    u = torch.rand((), generator=gen, dtype=torch.float64)
    index = int(torch.searchsorted(torch.cumsum(probs, dim=0), u, right=True).item())
    index = min(index, probs.numel() - 1)
    return int(order[index].item())
