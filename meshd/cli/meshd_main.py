"""``meshd``: the daemon."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="meshd", description="The meshd peer daemon.")
    parser.parse_args(argv)
    parser.print_help()
