"""What this machine's CPU is, as the kernel says (Linux ``/proc/cpuinfo``): its model and instruction
set flags. Machines of one kind can differ in both, and with them the kernels that run fastest and
every speed figure."""

from __future__ import annotations

import platform
from functools import cache

CPUINFO = "/proc/cpuinfo"
# the flags that decide which CPU kernels pay, as a benchmark report lists them
KERNEL_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@cache
def _cpuinfo(path: str = CPUINFO) -> tuple[str, frozenset[str]]:
    """The first processor's model name and flags in ``path``."""
    model, flags = "", frozenset[str]()
    try:
        with open(path, encoding="ascii", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor(), flags


def cpu_model() -> str:
    """The CPU's model name ('' where the system does not say)."""
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction set flags (empty where the system does not say)."""
    return _cpuinfo()[1]


def kernel_features() -> list[str]:
    """Which of :data:`KERNEL_FEATURES` this CPU has."""
    return [f for f in KERNEL_FEATURES if f in cpu_flags()]
