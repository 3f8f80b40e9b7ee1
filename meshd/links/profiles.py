"""Link shapes: the named profiles and the ``DELAY[±JITTER]/RATE`` text that ``--link-shape`` and
``meshctl bench --link`` take, parsed in one place.

A shape is a one-way delay, a jitter around it and a rate in bit/s. Grammar::

    lan | wifi | wan                     the profiles below
    DELAY/RATE                           10ms/100Mbit
    DELAY±JITTER/RATE  (or +-JITTER)     3ms±2ms/200Mbit: each chunk's delay uniform in [1, 5] ms
    DELAY~JITTER/RATE                    3ms~1ms/200Mbit: normal, standard deviation 1 ms (never below 0)

Durations take ``us`` (or ``µs``), ``ms`` or ``s``; rates are bits per second with an optional
``k``, ``M`` or ``G`` (powers of 1000) and an optional ``bit``, ``bit/s`` or ``bps``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

Jitter = Literal["uniform", "normal"]


class LinkShapeError(ValueError):
    """A link shape that does not parse or makes no sense; the message says which part and why."""


@dataclass(frozen=True)
class LinkShape:
    """One direction of a link: every byte arrives ``delay_s`` (± jitter) after it has been
    serialized onto a link of ``rate_bit_s``."""

    delay_s: float
    rate_bit_s: float
    jitter_s: float = 0.0
    jitter: Jitter = "uniform"  # uniform: delay ± jitter_s evenly; normal: jitter_s is the standard deviation
    name: str = ""  # the profile's name, or the text it was parsed from

    def __post_init__(self) -> None:
        if not self.delay_s >= 0:
            raise LinkShapeError(f"link delay must be 0 or more, not {self.delay_s * 1e3:g} ms")
        if not self.jitter_s >= 0:
            raise LinkShapeError(f"link jitter must be 0 or more, not {self.jitter_s * 1e3:g} ms")
        if self.jitter == "uniform" and self.jitter_s > self.delay_s:
            raise LinkShapeError(f"jitter ±{_duration(self.jitter_s)} exceeds the delay {_duration(self.delay_s)}: "
                                 "a uniform delay would go below 0 (use ~ for a normal jitter, clipped at 0)")
        if not self.rate_bit_s > 0:
            raise LinkShapeError(f"link rate must be more than 0 bit/s, not {self.rate_bit_s:g}")

    @property
    def bytes_per_s(self) -> float:
        return self.rate_bit_s / 8

    @property
    def spec(self) -> str:
        """The shape as text that parses back to it, e.g. ``3ms±2ms/200Mbit``."""
        jitter = ""
        if self.jitter_s:
            jitter = ("±" if self.jitter == "uniform" else "~") + _duration(self.jitter_s)
        return f"{_duration(self.delay_s)}{jitter}/{_rate(self.rate_bit_s)}"

    @property
    def label(self) -> str:
        """The name it is known by: the profile's, else its spec."""
        return self.name or self.spec

    def as_json(self) -> dict[str, Any]:
        return {"name": self.label, "spec": self.spec, "delay_ms": round(self.delay_s * 1e3, 6),
                "jitter_ms": round(self.jitter_s * 1e3, 6), "jitter": self.jitter,
                "rate_mbit": round(self.rate_bit_s / 1e6, 6)}


PROFILES: dict[str, LinkShape] = {
    "lan": LinkShape(delay_s=0.0005, rate_bit_s=1e9, name="lan"),
    "wifi": LinkShape(delay_s=0.003, jitter_s=0.002, rate_bit_s=200e6, name="wifi"),
    "wan": LinkShape(delay_s=0.020, rate_bit_s=50e6, name="wan"),
}

_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(us|µs|ms|s)?$", re.IGNORECASE)
_DURATION_UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([kmg]?)(bit/s|bits/s|bit|bits|bps)?$", re.IGNORECASE)
_RATE_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}
_JITTER = re.compile(r"±|\+-|~")


def parse_link_shape(text: str) -> LinkShape:
    """A profile name or ``DELAY[±JITTER]/RATE``; ``LinkShapeError`` says what is wrong."""
    spec = str(text).strip()
    if spec.lower() in PROFILES:
        return PROFILES[spec.lower()]
    if "/" not in spec:
        raise LinkShapeError(f"link shape {text!r} is neither a profile ({', '.join(PROFILES)}) nor DELAY/RATE "
                             "(e.g. 10ms/100Mbit, 3ms±2ms/200Mbit)")
    timing, rate_text = spec.split("/", 1)
    parts = _JITTER.split(timing)
    if len(parts) > 2:
        raise LinkShapeError(f"link shape {text!r} has more than one jitter")
    jitter: Jitter = "normal" if "~" in timing else "uniform"
    delay = _parse_duration(parts[0], "delay", text)
    jitter_s = _parse_duration(parts[1], "jitter", text) if len(parts) == 2 else 0.0
    return LinkShape(delay_s=delay, jitter_s=jitter_s, jitter=jitter, rate_bit_s=_parse_rate(rate_text, text),
                     name=spec)


def parse_link_shapes(text: str) -> tuple[LinkShape, ...]:
    """A comma-separated list of link shapes, each once, in the order given."""
    shapes: dict[str, LinkShape] = {}
    for item in str(text).split(","):
        if item.strip():
            shape = parse_link_shape(item)
            shapes.setdefault(shape.label, shape)
    if not shapes:
        raise LinkShapeError(f"no link shape in {text!r}")
    return tuple(shapes.values())


def _parse_duration(text: str, what: str, whole: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise LinkShapeError(f"link {what} {text.strip()!r} in {whole!r} is not a duration (e.g. 10ms, 500us)")
    if match.group(2) is None:
        raise LinkShapeError(f"link {what} {text.strip()!r} in {whole!r} needs a unit: us, ms or s")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def _parse_rate(text: str, whole: str) -> float:
    match = _RATE.match(text.strip())
    if not match:
        hint = " (rates are bits per second: 800Mbit, not 100MB)" if re.search(r"B\b|byte", text) else ""
        raise LinkShapeError(f"link rate {text.strip()!r} in {whole!r} is not a rate (e.g. 100Mbit, 1G, "
                             f"500kbit/s){hint}")
    return float(match.group(1)) * _RATE_PREFIXES[match.group(2).lower()]


def _duration(seconds: float) -> str:
    if seconds and seconds < 1e-4:
        return f"{seconds * 1e6:g}us"
    return f"{seconds * 1e3:g}ms"


def _rate(bit_s: float) -> str:
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bit_s >= scale:
            return f"{bit_s / scale:g}{prefix}bit"
    return f"{bit_s:g}bit"
