"""Layered settings shared by the daemon and the relay: defaults, a TOML file, environment, flags.

Each program keeps one typed dataclass of settings; this module fills it in order (defaults, then
the TOML file, then ``PREFIX_<NAME>`` environment variables, then explicit overrides such as
command-line flags), refuses unknown names, and converts text to each field's type.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import field, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "ki": 1024, "kib": 1024, "m": 1e6, "mb": 1e6, "mi": 1024**2,
          "mib": 1024**2, "g": 1e9, "gb": 1e9, "gi": 1024**3, "gib": 1024**3, "t": 1e12, "tb": 1e12,
          "ti": 1024**4, "tib": 1024**4}


def setting(default: T, help_text: str) -> T:
    """A settings field with its default and what it means (for generated configs and references)."""
    return field(default=default, metadata={"help": help_text})


def setting_list(help_text: str) -> list[str]:
    """A settings field holding a list (empty by default)."""
    return field(default_factory=list, metadata={"help": help_text})


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
        try:
            converted[name] = _convert(name, value, getattr(defaults, name), converters.get(name))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: {exc}") from None
    return converted


def _convert(name: str, value: Any, default: Any, convert: Callable[[Any], Any] | None) -> Any:
    if isinstance(value, (dict, list)) and not isinstance(default, list):
        raise ValueError(f"expected one value, not a {type(value).__name__}")
    if isinstance(default, str) and not isinstance(value, str):
        raise ValueError(f"expected text, not {value!r} (in a settings file, quote it)")
    if convert is not None:
        return convert(value)
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"{value!r} is not true or false")
        return text in ("1", "true", "yes", "on")
    if isinstance(default, float):
        return float(value)
    if isinstance(default, int):
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{value!r} is not a whole number")
        return int(value)
    return value


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def described_fields(cls: type) -> list[tuple[str, Any, str]]:
    """``(name, default, help)`` of every field of a settings class; each must have its help text."""
    out = []
    defaults = cls()
    for f in fields(cls):
        text = f.metadata.get("help")
        if not text:
            raise TypeError(f"{cls.__name__}.{f.name} has no help text")
        out.append((f.name, getattr(defaults, f.name), text))
    return out


def commented_toml(cls: type, header: str, values: dict[str, Any] | None = None,
                   given_elsewhere: dict[str, str] | None = None) -> str:
    """A TOML file listing every setting with what it means and its default, commented out, except
    those given in ``values``, which are set, and those ``given_elsewhere`` (by a flag that overrides
    the file), which say where instead of offering a line that would be ignored."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for name, default, text in described_fields(cls):
        lines.append("")
        lines.extend(f"# {part}" for part in textwrap.wrap(text, 96))
        if given_elsewhere and name in given_elsewhere:
            lines.extend(f"# {part}" for part in textwrap.wrap(f"{name}: {given_elsewhere[name]}", 96,
                                                                 break_long_words=False, break_on_hyphens=False))
        elif values and name in values:
            lines.append(f"{name} = {_toml_value(values[name])}")
        elif default is None:
            lines.append(f'# {name} = ""  (not set)')
        else:
            lines.append(f"# {name} = {_toml_value(default)}")
    return "\n".join(lines) + "\n"


def settings_reference(cls: type, env_prefix: str) -> str:
    """A Markdown table of every setting: name, default, environment variable, meaning."""
    rows = ["| setting | default | environment | meaning |", "|---|---|---|---|"]
    for name, default, text in described_fields(cls):
        shown = "not set" if default is None else _toml_value(default)
        rows.append(f"| `{name}` | `{shown}` | `{env_prefix}{name.upper()}` | {text.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
