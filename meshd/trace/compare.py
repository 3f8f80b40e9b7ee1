"""How far a hop's hidden states are from one process's, and whether that is within tolerance.

Each comparison is of one tensor of ``[positions, width]`` against the reference's at the same layer
boundary: the largest absolute difference of any element, and the relative error, the L2 norm of the
difference over the L2 norm of the reference (computed in float64), with the position whose own
relative error is largest. A comparison passes when its relative error is at most the tolerance and
every value is finite. Within one numerics class a split run is the same computation as one process,
so on one machine the errors are exactly zero; the default tolerances leave room for kernels that
round differently on another CPU or GPU of the same class, and no more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from meshd.runtime.numerics import Numerics
from meshd.trace.limits import DEFAULT_TOLERANCE

_TINY = 1e-30


def default_tolerance(numerics: Numerics) -> float:
    return DEFAULT_TOLERANCE.get(numerics.dtype_setting, 1e-2)


@dataclass(frozen=True)
class Difference:
    max_abs: float          # the largest absolute difference of any element
    rel_error: float        # ||got - want|| / ||want||
    worst_position: int     # the position whose own relative error is largest (-1 when none differs)
    finite: bool            # every value of ``got`` is a finite number

    def within(self, tolerance: float) -> bool:
        return self.finite and self.rel_error <= tolerance


def difference(got: torch.Tensor, want: torch.Tensor) -> Difference:
    """``got`` against the reference ``want``, both ``[positions, width]``."""
    if tuple(got.shape) != tuple(want.shape):
        raise ValueError(f"cannot compare shape {list(got.shape)} with the reference's {list(want.shape)}")
    a, b = got.detach().double().cpu(), want.detach().double().cpu()
    if not bool(torch.isfinite(a).all()):
        bad = int((~torch.isfinite(a)).any(dim=-1).nonzero()[0, 0])
        return Difference(math.inf, math.inf, bad, False)
    diff = a - b
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    rel = float(diff.norm() / max(float(b.norm()), _TINY))
    rows = diff.norm(dim=-1) / b.norm(dim=-1).clamp_min(_TINY)
    worst = int(torch.argmax(rows)) if max_abs > 0 else -1
    return Difference(max_abs, rel, worst, True)


@dataclass(frozen=True)
class Comparison:
    """One hop's output at one place against the reference's at the same place.

    ``what``: ``layer`` (one layer's output inside the hop), ``seam`` (what the hop sends on, the
    output of its last layer) or ``logits`` (the tail's, at the positions a token is sampled from)."""

    hop: int
    peer_id: str
    start: int
    end: int
    what: str
    layer: int | None       # the layer whose output this is (None for logits)
    difference: Difference
    ok: bool

    def as_json(self) -> dict:
        d = self.difference
        return {"hop": self.hop, "peer_id": self.peer_id, "start": self.start, "end": self.end, "what": self.what,
                "layer": self.layer, "max_abs_diff": _number(d.max_abs), "rel_error": _number(d.rel_error),
                "worst_position": None if d.worst_position < 0 else d.worst_position, "finite": d.finite,
                "ok": self.ok}

    def where(self) -> str:
        """``hop 1 (peer abcd1234, layers [2, 3)), layer 2`` and the like."""
        place = f"hop {self.hop} (peer {self.peer_id[:12]}, layers [{self.start}, {self.end}))"
        if self.what == "layer":
            return f"{place}, layer {self.layer}"
        if self.what == "seam":
            return f"{place}, its output (somewhere in layers [{self.start}, {self.end}); --layers says which)"
        return f"{place}, its logits (final norm or LM head)"


def _number(value: float) -> float | None:
    """JSON has no infinity: a value that is not finite is null (``finite`` says why)."""
    return value if math.isfinite(value) else None


def compare(hop: int, peer_id: str, start: int, end: int, what: str, layer: int | None, got: torch.Tensor,
            want: torch.Tensor, tolerance: float, first_position: int = 0) -> Comparison:
    """``got`` against ``want``, whose first row is the trace's position ``first_position``."""
    d = difference(got, want)
    if d.worst_position >= 0:
        d = replace(d, worst_position=d.worst_position + first_position)
    return Comparison(hop, peer_id, start, end, what, layer, d, d.within(tolerance))
