"""The devices a shard can run on, and how much memory each has for weights.

Device code paths stay small and shared with the CPU's: tensors are created on the device, bundles
move to it on arrival and back to the CPU to be encoded. The card advertises the device and its
memory, and placement sizes ranges by it.
"""

from __future__ import annotations

import psutil
import torch

from meshd.errors import MeshError


class DeviceUnavailable(MeshError, ValueError):
    """The device asked for is unknown, or not on this machine: reported in one line, not as a bug."""


def resolve_device(requested: str) -> str:
    """``auto`` -> ``cuda:0`` when CUDA is there, else ``mps`` when that is, else ``cpu``; a named
    device is checked to exist."""
    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda:0"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    kind, _, index = requested.partition(":")
    if kind == "cpu" and not index:
        return "cpu"
    if kind == "cuda" and (not index or index.isdigit()):
        if not torch.cuda.is_available():
            raise DeviceUnavailable("--device cuda: this machine has no CUDA device that torch can use")
        n = int(index or 0)
        if not 0 <= n < torch.cuda.device_count():
            raise DeviceUnavailable(f"--device {requested}: there are {torch.cuda.device_count()} CUDA devices")
        return f"cuda:{n}"
    if kind == "mps" and not index:
        if not torch.backends.mps.is_available():
            raise DeviceUnavailable("--device mps: this machine has no MPS device")
        return "mps"
    raise DeviceUnavailable(f"unknown device {requested!r}; expected auto, cpu, cuda[:N] or mps")


def device_memory_bytes(device: str) -> int:
    """Memory the device has: the machine's RAM for the CPU (and for MPS, which shares it)."""
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return int(psutil.virtual_memory().total)
