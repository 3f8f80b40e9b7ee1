"""int8 compute on the CPU: a shard's linears (its layers' and the LM head) as int8 GEMMs.

Weights are stored int8 with one scale per output channel (the row's largest magnitude / 127);
activations, KV and the seam stay float32, and the embedding stays a float lookup. The GEMMs are
fbgemm's packed int8 kernels (``quantized.linear_dynamic``), which quantize their input on the fly.
On the 2-core development machine the 16 layers and the 32000 x 1024 LM head of the ``bench`` model
take 31 ms for one row in fp32 and 11 ms as packed int8 GEMMs; weight-only int8
(``torch._weight_int8pack_mm``) is about five times *slower* than fp32 there, so it is not used.
``reduce_range`` quantizes activations to 7 bits: a CPU without AVX-512 VNNI adds pairs of u8 x s8
products into int16 (``vpmaddubsw``), which full-range activations overflow; with 7 bits the integer
dot products are exact there as with VNNI, and cost 0.3 % of held-out perplexity (8 bits: 0.07 %).

``linear_dynamic`` quantizes its whole input with one scale, so a row's result would depend on the
other rows of the batch. So each row is first divided by its own largest magnitude, and one constant
"pin" row ``[1, -1, 0, ...]`` is appended: the input's range is then exactly [-1, 1] whatever the
batch, every row is quantized with the same scale, the integer dot products are exact, and a row's
result is bit for bit the same alone or in any batch. The output rows are scaled back and the bias
added in fp32. The relative error against fp32 is about 1.8 % a linear.

That normalisation is a few small ops per linear, whose Python overhead shows at one row: the
bench model's linears take 15 ms with it against 11 ms of bare GEMMs. Linears that read one input
(attention's q/k/v, the MLP's gate/up) run as one packed GEMM (:class:`Int8Fused`): one
normalisation and one call for them, their output split among them, 65 GEMMs a step instead of 113;
on 2 threads that takes the 16 layers from 14.5 to 13.4 ms (on one thread it gains nothing). A whole
decode step takes 20 ms against 37 ms in fp32.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

import torch
from torch import nn

ENGINE = "fbgemm"
TINY = 1e-30  # a weight row's scale never goes below this: an all-zero row stays zero, never 0/0
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # linears that read one input
# Every row of an int8 linear computes alike whatever the GEMM's row count, so the decode band spans
# every step a host batches (16 sessions of 16 positions each); past it nothing changes either.
INVARIANT_ROWS = 256


def is_int8_weight(name: str, shape: Sequence[int]) -> bool:
    """Whether a layer's checkpoint tensor is held int8: a linear's 2-D weight (experts' stay float)."""
    return name.endswith(".weight") and len(shape) == 2 and ".experts." not in name


def int8_weight_bytes(shape: Sequence[int]) -> int:
    """Bytes an int8 linear holds for a weight of ``shape``: a byte an element, a float32 scale a row."""
    rows, cols = (int(d) for d in shape)
    return rows * cols + 4 * rows


def available() -> bool:
    """Whether this torch has fbgemm's int8 kernels (x86 CPUs)."""
    return ENGINE in torch.backends.quantized.supported_engines


@contextmanager
def _fbgemm() -> Iterator[None]:
    """Pack weights for fbgemm (the kernels the measurements chose), whatever the default engine is.
    ``quantize_per_channel`` warns that it is deprecated; it is the only way to build the packed
    weights that ``linear_dynamic`` takes, so that one warning is silenced here."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = ENGINE
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantize_per_channel.*", category=UserWarning)
            warnings.filterwarnings("ignore", message=".*deprecated.*", category=DeprecationWarning)
            warnings.filterwarnings("ignore", message=".*deprecated.*", category=FutureWarning)
            yield
    finally:
        torch.backends.quantized.engine = before


_linear_dynamic = torch.ops.quantized.linear_dynamic


class Int8Linear(nn.Module):
    """An ``nn.Linear`` as an int8 GEMM whose rows are batch-invariant (see the module docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not available():
            raise RuntimeError("int8 compute needs fbgemm (an x86 CPU build of torch)")
        weight = linear.weight.detach().to(device="cpu", dtype=torch.float32)
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])
        if self.in_features < 2:
            raise ValueError("an int8 linear needs at least two inputs (its pin row holds 1 and -1)")
        scale = weight.abs().amax(dim=1).clamp(min=TINY) / 127
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        with _fbgemm():
            q = torch.quantize_per_channel(weight, scale.double(), zeros, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(q, None)
        # kept for the finite-weights check (a non-finite weight makes its row's scale so) and accounting
        self.scale = nn.Parameter(scale, requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        pin = torch.zeros(1, self.in_features)
        pin[0, 0], pin[0, 1] = 1.0, -1.0
        self.register_buffer("_pin", pin, persistent=False)

    @property
    def int8_bytes(self) -> int:
        """Bytes of the int8 weight values (the scales and bias are parameters, counted with them)."""
        return self.in_features * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32:
            flat = flat.float()
        scale = flat.abs().amax(dim=1, keepdim=True)
        # NaN from a row of zeros (0/0) becomes 0, and that row's output 0 again through its scale; a
        # row holding NaN or inf would set the quantization range of the whole batch, so it is zeroed
        # here too, and comes out NaN through its scale all the same
        normed = torch.cat([flat / scale, self._pin]).nan_to_num_(0.0, 0.0, 0.0)
        out = _linear_dynamic(normed, self._packed, True)[:-1].mul_(scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Fused(nn.Module):
    """Linears that read the same input as one :class:`Int8Linear` over their concatenated weights.

    Each member (:class:`Int8Part`) asks for its columns; the first to ask with a new input computes
    them all, and the rest take theirs from that output, each once. The input is held while the
    output is, so its identity cannot be reused by another tensor in the meantime.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        weight = torch.cat([lin.weight.detach().float() for lin in linears])
        biased = [lin.bias is not None for lin in linears]
        joined = nn.Linear(weight.shape[1], weight.shape[0], bias=any(biased), device="meta")
        joined.weight = nn.Parameter(weight, requires_grad=False)
        if any(biased):
            joined.bias = nn.Parameter(torch.cat([
                lin.bias.detach().float() if lin.bias is not None else torch.zeros(lin.out_features)
                for lin in linears]), requires_grad=False)
        self.linear = Int8Linear(joined)
        self.sizes = [int(lin.out_features) for lin in linears]
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor] = []
        self._taken: set[int] = set()

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or index in self._taken:
            out = self.linear.forward(x)
            self._input, self._taken = x, set()
            self._outputs = list(out.split(self.sizes, dim=-1))
        self._taken.add(index)
        result = self._outputs[index]
        if len(self._taken) == len(self.sizes):
            self._input, self._outputs = None, []
        return result


class Int8Part(nn.Module):
    """One member of an :class:`Int8Fused` group, in the place of the linear it replaces."""

    def __init__(self, fused: Int8Fused, index: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.fused = [fused]  # a list: the group is owned by the parent module, not by each member
        self.index = index
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused[0].part(self.index, x)


def quantize_linears(module: nn.Module) -> nn.Module:
    """``module`` with every ``nn.Linear`` in it (or itself, when it is one) replaced by its int8 form,
    groups of ``FUSED_GROUPS`` under one parent fused, the fp32 weights let go. Anything else
    (embeddings, norms, experts' stacked weights) stays as it is."""
    if isinstance(module, nn.Linear):
        return Int8Linear(module)
    for parent in list(module.modules()):
        children = dict(parent.named_children())
        for group in FUSED_GROUPS:
            linears = [children.get(name) for name in group]
            if all(isinstance(lin, nn.Linear) for lin in linears):
                members: list[nn.Linear] = [lin for lin in linears if isinstance(lin, nn.Linear)]
                fused = Int8Fused(members)
                parent.add_module("int8_" + "_".join(group), fused)
                for i, (name, lin) in enumerate(zip(group, members, strict=True)):
                    setattr(parent, name, Int8Part(fused, i, lin.in_features, lin.out_features))
                    children.pop(name)
        for name, child in children.items():
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
    return module


def release_freed_memory() -> None:
    """Hand the C heap's free memory back to the system: the fp32 weights freed once packed leave holes
    below the packed ones that glibc keeps otherwise (a ``bench`` shard's RSS: 663 MB kept, 370 MB
    after). Only glibc has ``malloc_trim``; elsewhere this does nothing."""
    with suppress(AttributeError, OSError):
        ctypes.CDLL(None).malloc_trim(0)


def int8_bytes(module: nn.Module) -> int:
    """Bytes of the int8 weight values under ``module`` (its parameters are counted apart)."""
    return sum(m.int8_bytes for m in module.modules() if isinstance(m, Int8Linear))
