"""Options that only some modes of a command take (one benchmark of several, a measurement turned on
by a flag): refused when given without their mode, since they would be silently ignored there.

Such an option parses to None when it is not given, which is how one given is told apart from its
default; once the modes in effect are known, their own options get their defaults.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping

# by mode: each option's flag, and its destination in the parsed arguments and its default
ModeTable = Mapping[str, Mapping[str, tuple[str, object]]]


def misplaced(args: argparse.Namespace, table: ModeTable, active: Collection[str]) -> list[tuple[str, str]]:
    """The flags given that belong to none of the ``active`` modes, each with the mode it is for."""
    return [(flag, mode) for mode, options in table.items() if mode not in active
            for flag, (dest, _default) in options.items() if getattr(args, dest) is not None]


def fill_defaults(args: argparse.Namespace, table: ModeTable, active: Collection[str]) -> None:
    """Give the ``active`` modes' options that were not given their defaults."""
    for mode in active:
        for dest, default in table[mode].values():
            if getattr(args, dest) is None:
                setattr(args, dest, default)
