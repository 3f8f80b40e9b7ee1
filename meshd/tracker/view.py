"""The slice of the gossip view that placement and routing look at."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardOffer:
    """One peer's offer of one model, as its capability card states it."""

    peer_id: str
    model_id: str
    compat_key: str
    n_layers: int
    layer_bytes: int             # weight bytes of one decoder layer
    edge_bytes: int              # extra bytes of the embedding (head) or final norm + LM head (tail)
    memory_budget_bytes: int     # what the peer may spend on weights for this model
    range: tuple[int, int] | None  # loaded (or pinned) range; None while waiting to be placed
    ms_per_layer: float = 1.0    # measured decode time of one layer for one token
    active_sessions: int = 0
    queued: int = 0
    relayed: bool = False
    pinned: bool = False         # the operator fixed the range; placement never assigns one


@dataclass(frozen=True)
class Hop:
    peer_id: str
    start: int
    end: int


@dataclass(frozen=True)
class Route:
    model_id: str
    compat_key: str
    hops: tuple[Hop, ...]
    epoch: int
    cost_ms: float
    terms: tuple[dict, ...] = ()

    def describe(self) -> str:
        return " -> ".join(f"{h.peer_id[:8]}[{h.start},{h.end})" for h in self.hops)
