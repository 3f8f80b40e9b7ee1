"""Layered settings shared by the daemon and the relay: defaults, a TOML file, environment, flags.

Each program keeps one typed dataclass of settings; this module fills it in order (defaults, then
the TOML file, then ``PREFIX_<NAME>`` environment variables, then explicit overrides such as
command-line flags), refuses unknown names, and converts text to each field's type.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "ki": 1024, "kib": 1024, "m": 1e6, "mb": 1e6, "mi": 1024**2,
          "mib": 1024**2, "g": 1e9, "gb": 1e9, "gi": 1024**3, "gib": 1024**3, "t": 1e12, "tb": 1e12,
          "ti": 1024**4, "tib": 1024**4}


def parse_size(text: str | int) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1048576"`` -> bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GB, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def layered_settings(
    cls: type,
    path: Path | None,
    env_prefix: str,
    overrides: dict[str, Any] | None,
    converters: dict[str, Callable[[Any], Any]],
    list_fields: Iterable[str] = (),
) -> dict[str, Any]:
    """The values for ``cls`` from every layer, converted; only the names that some layer set."""
    values: dict[str, Any] = {}
    if path is not None:
        with Path(path).open("rb") as f:
            values.update(tomllib.load(f))
    known = {f.name for f in fields(cls)}
    lists = set(list_fields)
    for name in known:
        env = os.environ.get(f"{env_prefix}{name.upper()}")
        if env is not None:
            values[name] = [v for v in env.split(",") if v] if name in lists else env
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    defaults = cls()
    converted: dict[str, Any] = {}
    for name, value in values.items():
        default = getattr(defaults, name)
        convert = converters.get(name)
        if convert is not None:
            value = convert(value)
        elif isinstance(default, bool):
            value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
        elif isinstance(default, float):
            value = float(value)
        elif isinstance(default, int):
            value = int(value)
        converted[name] = value
    return converted
