"""How a shard computes: the dtype it holds weights and activations in, and how its linears run.

Two rules shape this module.

1. A reply never depends on what else a peer is running. A GEMM's rows are not independent of one
   another in floating point: the kernel picks its blocking (and for one row a different kernel
   altogether) by the number of rows, so the same row computed alone and inside a batch can differ
   in its last bits, enough to flip a greedy choice now and then. So decode steps run their linears
   in GEMMs of a *band* of row counts, ``decode_rows`` to ``decode_max_rows``, inside which the
   kernel computes every row the same way whatever the count (a step of fewer rows is padded, one of
   more is cut into tiles inside the band); a session's row is then computed by the same kernel
   whether it is alone or one of many. Attention is computed per
   session (:mod:`meshd.runtime.attention`), and elementwise kernels need rows of whole vector blocks
   (:func:`meshd.runtime.shard.rows_align`). Prefill chunks run alone, as themselves. The numerics
   thus follow the kind of step, prefill or decode, and never the batch a step happens to share.

2. Weights stay in the checkpoint's dtype unless the operator asks otherwise (a bf16 checkpoint needs
   half the memory of its fp32 copy), but the fastest arithmetic for them depends on the shape of the
   step. A bf16 or fp16 shard may compute a linear as an fp32 GEMM over weights upcast on the fly
   (``prefill_fp32``, ``decode_fp32``) and round the result back to its dtype: activations, KV and
   the seam stay in the held dtype.

Which of those choices wins is measured when a peer starts (:func:`calibrate`: one layer's linears,
random weights), with a margin so that machines of one kind pick alike; layers too small for the
choice to matter keep the defaults. Measured on the 2-core AVX2 development machine for 8 layers of the
``bench`` shapes (56 linears): one decode row takes 12 ms in fp32 and 12 ms in bf16 (20 ms upcast);
8 rows take 28 ms as one fp32 GEMM and 62 ms row by row; a 512-row prefill chunk takes 286 ms in
fp32, 1495 ms in bf16 and 308 ms upcast. So there a bf16 shard prefills upcast and decodes natively,
and decode runs one row at a time (a tile of 8 would cost a lone session 2.3 times a single row).
The band is measured too (:func:`row_band`): on that machine a GEMM of one row takes a path of its
own, every count from 2 to 15 rows computes each row bit for bit alike, and 16 or more another way
again; all 16 bench layers' linears and the LM head take 33.5 ms for one row, 36 ms for two, 37.5 ms
for three, 70 ms for four and 86 ms for eight. So there decode runs in the band 2 to 15: a lone
session pays 7 % for its padding row, and eight sessions share one step that costs 2.6 times one
row instead of eight times.

Which library computes an fp32 linear is a choice too. torch sends ``F.linear`` to MKL, whose GEMMs
are far from the memory's speed on some CPUs: on a 2-core AMD EPYC (AVX-512) machine the bench
layer's MLP projection (2816 x 1024) takes 680-900 us for one row and 1090 us for eight, where
oneDNN's (``onednn``: ``torch.ops.mkldnn._linear_pointwise`` over the same weights) takes 450 us
and 600 us, and a 512-token prefill of the whole bench model 650-780 ms against 1160-1280 ms. oneDNN
also computes every row of a GEMM of two rows or more bit for bit alike, at any row count measured
(2 to 1100) and any position, so its band has no top worth the name: decode batches and prefill chunks
compute each row as a two-row step does. Its one-row GEMM takes another path, so a lone session is
padded to two rows, as in any band whose bottom is 2. Because a prefill chunk's rows then do not
depend on the rows beside them, a hop computes the prompts of several sessions queued together as one
chunk, each attending over its own keys: so oneDNN's prefill is kept unless torch's own is clearly
faster. On that machine a layer's linears of a 64-row chunk took 1.33-1.39 times as long in torch's
way as in oneDNN's, 1.13 times at 256 and 512 rows.

The choice is part of the shard's numerics class, which the compat key covers: hops of one route
compute the same way, so a split run equals one process bit for bit.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
INT8 = "int8"  # ``--dtype int8``: float32 held, linears int8 (meshd.runtime.int8); a part of ``Numerics.weights``
TILE_ROWS = 8        # rows per decode GEMM when decode steps are batched by tiles
ONE_GEMM = 1 << 30   # a band's top that never cuts a GEMM into tiles
ONEDNN_ROWS = (2, ONE_GEMM)  # oneDNN computes each row of any GEMM of two rows or more alike
BAND_PROBE_ROWS = 32  # row counts tried when measuring the band of row-invariant GEMMs
# A band whose bottom is 2 rows is refused only when its padded lone row is clearly slower than one row
# (measured 1.07 times on the development machine): peers starting together on one machine time it
# under each other's load, and a tight limit would split them into classes that cannot share a route.
BAND_LIMIT = 1.5
MARGIN = 1.25        # an alternative must be this much faster to be chosen (stable choices across peers)
TIMING_ROUNDS = 5    # turns each compared way is timed in, interleaved with the others; the best counts
MIN_MEASURED_PARAMETERS = 1_000_000  # smaller layers: the choice cannot matter, and timing them is noise


@dataclass(frozen=True)
class Numerics:
    """A shard's numerics: held dtype, device kind, and how prefill and decode linears run."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    prefill_fp32: bool = False  # prefill linears as fp32 GEMMs of upcast weights (bf16/fp16 held)
    decode_fp32: bool = False   # decode linears the same way
    prefill_onednn: bool = False  # prefill linears (fp32 held) computed by oneDNN instead of torch's default
    decode_onednn: bool = False   # decode linears the same way
    decode_rows: int = 1        # decode linears run in GEMMs of at least this many rows
    decode_max_rows: int = 0    # ... and at most this many (0: exactly decode_rows)
    backend: str = "torch"      # or "llama.cpp": ggml computes the layers (the fields above do not apply)
    weights: str = ""           # the stored form when it is not the held dtype: "gguf-q8_0", "int8", "gguf-q8_0+int8"

    @property
    def int8(self) -> bool:
        """Whether the linears compute in int8 (:mod:`meshd.runtime.int8`) over float32 activations."""
        return INT8 in self.weights.split("+")

    @property
    def dtype_setting(self) -> str:
        """The ``--dtype`` that computes so: the held dtype's name, or int8."""
        return INT8 if self.int8 else self.dtype_name

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    @property
    def decode_band(self) -> tuple[int, int]:
        """The row counts a decode GEMM may have: each row computes the same at any of them."""
        return self.decode_rows, max(self.decode_rows, self.decode_max_rows)

    @property
    def device_kind(self) -> str:
        return self.device.split(":")[0]

    @property
    def name(self) -> str:
        """A stable name of the class, for cards, status and the compat key."""
        if self.backend == "llama.cpp":
            return f"llama.cpp/{self.device_kind}/{self.weights or 'gguf'}"
        prefill = _way(self.prefill_fp32, self.prefill_onednn)
        decode = _way(self.decode_fp32, self.decode_onednn)
        low, high = self.decode_band
        rows = f"{low}" if high == low else f"{low}-{high}"
        name = f"{self.device_kind}/{self.dtype_name}/prefill-{prefill}/decode-{decode}-rows{rows}"
        return f"{name}/{self.weights}" if self.weights else name

    def prefill(self) -> AbstractContextManager[object]:
        """The mode of a prefill chunk: one GEMM of its rows (through oneDNN, a lone row padded to two,
        so that a chunk's rows compute as a decode step's do)."""
        way = self.prefill_way()
        return way if way.upcast or way.onednn else nullcontext()

    def prefill_way(self) -> _Linears:
        """How a prefill chunk's linears run, also where that is torch's plain way (:func:`linears_like`)."""
        upcast = self.prefill_fp32 and self.dtype != torch.float32
        return _Linears(rows=ONEDNN_ROWS if self.prefill_onednn else None, upcast=upcast, onednn=self.prefill_onednn)

    def decode_way(self) -> _Linears:
        """How a decode step's linears run, in the band's tiles."""
        upcast = self.decode_fp32 and self.dtype != torch.float32
        return _Linears(rows=self.decode_band, upcast=upcast, onednn=self.decode_onednn)

    def decode(self, rows: int | None = None) -> AbstractContextManager[object]:
        """The mode of a decode step of ``rows`` rows (None: not known). A step whose row count is
        inside the band, in the held dtype, is left alone: every linear is already one GEMM the band
        allows, and a torch function mode costs every op of the step some Python (4 to 5 ms of a 35 ms
        decode step of the whole bench model on the development machine)."""
        way = self.decode_way()
        low, high = self.decode_band
        if rows is not None and low <= rows <= high and not way.upcast and not way.onednn:
            return nullcontext()
        return way


class _Route:
    """The context of :func:`routed`: sets which way linears of routed modules take, and puts it back."""

    __slots__ = ("_mode", "_token")

    def __init__(self, mode: _LinearsMode) -> None:
        self._mode = mode
        self._token: contextvars.Token[_LinearsMode | None] | None = None

    def __enter__(self) -> None:
        self._token = _ROUTE.set(self._mode)

    def __exit__(self, *exc_info: object) -> None:
        assert self._token is not None
        _ROUTE.reset(self._token)


def routed(mode: AbstractContextManager[object]) -> AbstractContextManager[object]:
    """Where ``mode`` (what :meth:`Numerics.decode`, :meth:`Numerics.prefill` or :func:`linears_like`
    gives) would be on, the linears of modules prepared by :func:`route_linears` compute its way, with
    no torch function mode over the step. A mode dispatches every torch call in Python, a norm's or
    an activation's as much as a linear's: in one process, the whole ``bench`` model's decode step
    took 0.95 times as long routed as in the mode for one session and 0.88-0.91 times for eight, bit
    for bit alike."""
    return _Route(mode) if isinstance(mode, _LinearsMode) else nullcontext()


def route_linears(module: nn.Module) -> nn.Module:
    """``module`` with each ``nn.Linear`` in it (or itself) computing the way :func:`routed` sets
    (:class:`RoutedLinear`, the same weights), and each other module that applies weights of its own
    with ``F.linear`` (a mixture's router and stacked experts: modules holding a parameter of two or
    more dimensions, embeddings aside) running its forward in the routed way's mode, which catches
    those calls. Modules inside such a module are left to that mode. Idempotent."""
    if type(module) is nn.Linear:
        module.__class__ = RoutedLinear
    elif isinstance(module, (RoutedLinear, nn.Embedding)) or isinstance(module.__dict__.get("forward"), _InMode):
        pass
    elif any(p.dim() >= 2 for p in module.parameters(recurse=False)):
        module.forward = _InMode(module.forward)
    else:
        for child in module.children():
            route_linears(child)
    return module


class RoutedLinear(nn.Linear):
    """An ``nn.Linear`` that computes the way :func:`routed` sets (plain ``F.linear`` outside it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        way = _ROUTE.get()
        if way is None:
            return F.linear(x, self.weight, self.bias)
        return way.linear(x, self.weight, self.bias)


class _InMode:
    """The forward of a module that calls ``F.linear`` on weights of its own, run in the routed way's mode."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mode = _ROUTE.get()
        if mode is None:
            return self.forward(*args, **kwargs)
        with mode:
            return self.forward(*args, **kwargs)


def linears_like(numerics: Numerics | None) -> AbstractContextManager[object]:
    """The mode in which a model outside a shard (transformers' ``generate()``, one call for a prompt
    and its tokens alike) computes its linears as peers of ``numerics`` do, where theirs are not
    torch's own kernels (oneDNN, in prefill or decode): a forward of a prompt as their prefill chunks,
    a step of one token per sequence as their decode steps of that many sessions. Elsewhere nothing
    changes: torch's kernels are the peers' already, or the difference is the peers' band of rows,
    which a reference computed the plain way shows. ``None``: nothing changes."""
    if numerics is None or not (numerics.prefill_onednn or numerics.decode_onednn):
        return nullcontext()
    return _PhaseLinears(numerics.prefill_way(), numerics.decode_way())


def numerics_from_name(name: str, device: str) -> Numerics:
    """The torch numerics class called ``name`` (as :attr:`Numerics.name` writes it), on ``device``,
    which must be of the kind the name says: how a peer that fetched a model computes exactly as the
    peers it fetched from."""
    parts = name.split("/")
    try:
        if parts[0] == "llama.cpp" or len(parts) < 4:
            raise ValueError("it is not a torch numerics class (a GGUF model on llama.cpp is shared as its file)")
        kind, dtype_name, prefill, decode = parts[:4]
        weights = "/".join(parts[4:])
        if kind != device.split(":")[0]:
            raise ValueError(f"it computes on {kind}, and this peer's device is {device}")
        if not prefill.startswith("prefill-") or not decode.startswith("decode-") or "-rows" not in decode:
            raise ValueError("it is not a torch numerics class")
        decode_way, rows = decode.removeprefix("decode-").split("-rows")
        low, _, high = rows.partition("-")
        prefill_fp32, prefill_onednn = WAYS[prefill.removeprefix("prefill-")]
        decode_fp32, decode_onednn = WAYS[decode_way]
        numerics = Numerics(dtype=DTYPES[dtype_name], device=device, prefill_fp32=prefill_fp32,
                            decode_fp32=decode_fp32, prefill_onednn=prefill_onednn, decode_onednn=decode_onednn,
                            decode_rows=int(low), decode_max_rows=int(high) if high else 0, weights=weights)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"numerics class {name!r} cannot run here: {exc}") from None
    if numerics.name != name:
        raise ValueError(f"numerics class {name!r} is not one this version of meshd writes")
    if numerics.prefill_onednn or numerics.decode_onednn:
        if numerics.dtype != torch.float32 or numerics.device_kind != "cpu":
            raise ValueError(f"numerics class {name!r} cannot run here: oneDNN linears compute float32 on the CPU")
        if not onednn_available():
            raise ValueError(f"numerics class {name!r} cannot run here: this torch build has no oneDNN linear")
    from meshd.runtime.int8 import available as int8_available

    if numerics.int8 and (numerics.dtype != torch.float32 or not int8_available()):
        raise ValueError(f"numerics class {name!r} cannot run here: int8 compute needs float32 activations and "
                         "fbgemm (an x86 CPU build of torch)")
    return numerics


WAYS = {"native": (False, False), "fp32": (True, False), "onednn": (False, True)}  # name -> (upcast, oneDNN)


def _way(upcast: bool, onednn: bool) -> str:
    """How a phase's linears run, as the class name says it: in the held dtype by torch's default
    kernels (``native``), upcast to fp32 (``fp32``), or by oneDNN (``onednn``, fp32 held)."""
    return "onednn" if onednn else "fp32" if upcast else "native"


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` computed by oneDNN's GEMM over the plain weight (no packed copy is kept)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat if flat.is_contiguous() else flat.contiguous(), weight, bias,
                                             "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


_onednn_works: bool | None = None


def onednn_available() -> bool:
    """Whether this torch computes fp32 linears through oneDNN here (a build with it, on a CPU it
    supports): checked once, by computing one against ``F.linear``."""
    global _onednn_works
    if _onednn_works is None:
        try:
            gen = torch.Generator().manual_seed(0)
            x, w = torch.randn(3, 40, generator=gen), torch.randn(24, 40, generator=gen)
            _onednn_works = bool(torch.backends.mkldnn.is_available()) and torch.allclose(
                _onednn_linear(x, w, None), F.linear(x, w), rtol=1e-4, atol=1e-5)
        except (RuntimeError, AttributeError):
            _onednn_works = False
    return _onednn_works


def band_tiles(n: int, band: tuple[int, int]) -> list[int]:
    """Sizes of the GEMMs that compute ``n`` rows inside ``band``: as few as the band's top allows,
    near-equal, each padded up to the band's bottom when ``n`` is smaller than it."""
    low, high = band
    if n <= low:
        return [low]
    count = -(-n // high)
    base, extra = divmod(n, count)
    sizes = [base + 1] * extra + [base] * (count - extra)
    return [max(low, size) for size in sizes]


class _LinearsMode(TorchFunctionMode):
    """A mode that computes every ``F.linear`` called inside it by :meth:`linear`, and leaves the rest."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        return self.linear(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class _Linears(_LinearsMode):
    """Runs every ``F.linear`` of a step as the numerics say: in row tiles of the band, in fp32, or both."""

    def __init__(self, rows: tuple[int, int] | None, upcast: bool, onednn: bool = False) -> None:
        super().__init__()
        self.rows = rows
        self.upcast = upcast
        self.onednn = onednn

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` computed this way."""
        if self.rows is None:
            return self._linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        n = flat.shape[0]
        sizes = band_tiles(n, self.rows)
        if sizes == [n]:  # one GEMM the band allows: nothing to cut or pad
            return self._linear(x, weight, bias)
        tiles = []
        start = 0
        for size in sizes:
            tile = flat[start : start + size]
            if tile.shape[0] < size:
                tile = torch.cat([tile, tile.new_zeros(size - tile.shape[0], tile.shape[1])])
            tiles.append(self._linear(tile, weight, bias)[: n - start])
            start += size
        out = torch.cat(tiles)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.onednn:
            return _onednn_linear(x, weight, bias)
        if not self.upcast:
            return F.linear(x, weight, bias)
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)


class _PhaseLinears(_LinearsMode):
    """Runs a forward over sequences of several positions (a prompt) the ``prefill`` way and one of a
    single position per sequence (a generated token) the ``decode`` way."""

    def __init__(self, prefill: _Linears, decode: _Linears) -> None:
        super().__init__()
        self.prefill = prefill
        self.decode = decode

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` computed the phase's way."""
        way = self.prefill if x.dim() >= 3 and x.shape[-2] > 1 else self.decode
        return way.linear(x, weight, bias)


_ROUTE: contextvars.ContextVar[_LinearsMode | None] = contextvars.ContextVar("meshd_linears", default=None)


def default_numerics(dtype: torch.dtype, device: str) -> Numerics:
    """What a shard uses before anything is measured: native arithmetic, tiles on accelerators
    (their kernels choose algorithms by shape), one row at a time on a CPU."""
    rows = TILE_ROWS if device != "cpu" else 1
    return Numerics(dtype=dtype, device=device, decode_rows=rows)


StepTimer = Callable[[Numerics], float]
"""``timer(numerics)`` -> seconds of one representative step computed that way."""


@dataclass(frozen=True)
class Choice:
    numerics: Numerics
    measured_ms: dict[str, float]  # what each candidate took, by candidate name


BandProbe = Callable[[Numerics], tuple[int, int]]
"""``probe(numerics)`` -> the band of decode GEMM row counts that compute each row alike that way."""


def choose(base: Numerics, time_prefill: StepTimer, time_decode: StepTimer, time_batch: StepTimer,
           probe_band: BandProbe | None = None, onednn: bool = False) -> Choice:
    """Measure the alternatives to ``base`` and keep each that is at least ``MARGIN`` times faster,
    but oneDNN's prefill (fp32 held) unless torch's own is ``MARGIN`` times faster than it: it computes
    each row of a GEMM alike at any row count, which lets prompts of several sessions compute as one
    (:attr:`meshd.runtime.shard.Shard.prefills_share_rows`), and a chunk's time alone undersells that.

    On a CPU a decode step's way is chosen among torch's default kernels and, with ``onednn``, oneDNN's
    (fp32 held), each one row per GEMM and in its band of rows (or failing a band, tiles; a band from
    one row stands for the kernel's one-row way, which it computes a lone session as): every way
    whose lone session (``time_decode``, the case every reply meets) is within ``BAND_LIMIT`` of torch's
    own one-row step may serve, and of those the first that ``time_batch`` (a step of ``TILE_ROWS``
    sessions) finds ``MARGIN`` faster than the ways before it wins, since batches are where ways differ
    most: a lone session may give up a little so that concurrent ones share their GEMMs. Both limits
    are wide, and the ways compared are timed in turns, on purpose: peers starting together on one
    machine measure under each other's load, and must still choose alike to share routes.
    """
    measured: dict[str, float] = {}

    def timed(timer: StepTimer, label: str, *candidates: Numerics) -> list[float]:
        """Each candidate's best of ``TIMING_ROUNDS``, the candidates taking turns round by round, so
        that a burst of another process's load slows every one of them alike rather than one alone."""
        best = [math.inf] * len(candidates)
        for _ in range(TIMING_ROUNDS):
            for i, numerics in enumerate(candidates):
                best[i] = min(best[i], timer(numerics))
        for numerics, seconds in zip(candidates, best, strict=True):
            measured[f"{label} {numerics.name}"] = round(seconds * 1000, 3)
        return best

    chosen = base
    if base.dtype != torch.float32:
        upcast = replace(chosen, prefill_fp32=True)
        native, faster = timed(time_prefill, "prefill", chosen, upcast)
        if faster * MARGIN < native:
            chosen = upcast
        upcast = replace(chosen, decode_fp32=True)
        alone, faster = timed(time_decode, "decode", chosen, upcast)
        if faster * MARGIN < alone:
            chosen = upcast
    if chosen.device != "cpu":
        return Choice(chosen, measured)
    onednn = onednn and chosen.dtype == torch.float32
    if onednn:  # oneDNN unless clearly slower: its rows compute alike at any count, so prompts may share GEMMs
        dnn = replace(chosen, prefill_onednn=True)
        default, dnn_s = timed(time_prefill, "prefill", chosen, dnn)
        if default * MARGIN >= dnn_s:
            chosen = dnn
    ways: list[Numerics] = []
    for kernel in [chosen, *([replace(chosen, decode_onednn=True)] if onednn else [])]:
        low, high = probe_band(kernel) if probe_band is not None else (1, 1)
        if low > 1 or high == low:
            ways.append(kernel)  # one row per GEMM; a band from one row computes a lone row so anyway
        ways.append(replace(kernel, decode_rows=low, decode_max_rows=high) if high > low
                    else replace(kernel, decode_rows=TILE_ROWS))
    lone = timed(time_decode, "decode", *ways)
    serving = [way for way, seconds in zip(ways, lone, strict=True) if seconds <= lone[0] * BAND_LIMIT]
    batches = timed(time_batch, f"decode x{TILE_ROWS}", *serving)
    best, best_batch = serving[0], batches[0]
    for way, batch in zip(serving[1:], batches[1:], strict=True):
        if batch * MARGIN < best_batch:
            best, best_batch = way, batch
    return Choice(best, measured)


def row_band(numerics: Numerics, weights: list[torch.Tensor], probe_rows: int = BAND_PROBE_ROWS) -> tuple[int, int]:
    """The widest band of GEMM row counts, starting at 1 or 2, at which every row of each of
    ``weights`` computes bit for bit as in GEMMs of the band's bottom count, decode linears computed
    the way ``numerics`` says. Which kernel a GEMM takes depends on its shape, not its values, so
    random rows show it. ``(1, 1)`` when no band of several rows exists."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    upcast = numerics.decode_fp32 and numerics.dtype != torch.float32
    way = _Linears(rows=None, upcast=upcast, onednn=numerics.decode_onednn)
    with torch.inference_mode():
        for low in (1, 2):
            high = probe_rows
            for w in weights:
                x = torch.randn(probe_rows, w.shape[1], generator=gen).to(dtype=w.dtype, device=w.device)
                reference = torch.cat([way._linear(x[s : s + low], w, None) for s in range(0, probe_rows, low)])
                for rows in range(low + 1, high + 1):
                    if not torch.equal(way._linear(x[:rows], w, None), reference[:rows]):
                        high = rows - 1
                        break
                if high <= low:
                    break
            if high > low:
                return low, high
    return 1, 1


def calibrate(base: Numerics, shapes: list[tuple[int, int]], prefill_rows: int,
              band_shapes: Sequence[tuple[int, int]] = ()) -> Choice:
    """:func:`choose` timed on linears of ``shapes`` (one decoder layer's ``(out, in)`` weights) with
    random weights in the held dtype: a prefill chunk of ``prefill_rows`` rows, one decode row and a
    decode step of ``TILE_ROWS`` rows; the band of decode rows probed on those and on ``band_shapes``
    (other linears a decode step runs)."""
    if sum(out * inp for out, inp in shapes) < MIN_MEASURED_PARAMETERS:
        return Choice(base, {})
    device = torch.device(base.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    weights = [(torch.randn(shape, generator=gen) * 0.02).to(dtype=base.dtype, device=device) for shape in shapes]

    def run(numerics: Numerics, rows: int, decode: bool) -> float:
        if decode:  # a step of fewer rows than the band's bottom is padded before its layers (Shard)
            rows = max(rows, numerics.decode_band[0])
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen).to(dtype=base.dtype, device=device)
              for w in weights}
        mode = numerics.decode(rows=rows) if decode else numerics.prefill()
        with torch.inference_mode(), mode:
            for w in weights[:1]:  # warm the kernels up
                F.linear(xs[w.shape[1]], w)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the copies and the warm-up are queued, not done
            started = time.perf_counter()
            for w in weights:
                F.linear(xs[w.shape[1]], w)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - started

    return choose(base, lambda n: run(n, prefill_rows, decode=False), lambda n: run(n, 1, decode=True),
                  lambda n: run(n, TILE_ROWS, decode=True),
                  lambda n: row_band(n, weights + [(torch.randn(shape, generator=gen) * 0.02).to(
                      dtype=base.dtype, device=device) for shape in band_shapes if shape not in shapes]),
                  onednn=device.type == "cpu" and onednn_available())
