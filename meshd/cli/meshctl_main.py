"""``meshctl``: the operator tool."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshd.models.builtin import BUILTIN_MODELS, create_builtin, default_model_dir


def _cmd_model_create(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else default_model_dir(args.name)
    print(f"creating built-in model {args.name!r} in {out}", file=sys.stderr)
    try:
        create_builtin(args.name, out, progress=lambda m: print(f"  {m}", file=sys.stderr), force=args.force)
    except FileExistsError as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from meshd.cli.demo import run_demo

    return run_demo(model_dir=Path(args.model) if args.model else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshctl",
        description="Operate a meshd mesh: built-in models, demos and diagnostics.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="manage model directories")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    create = model_sub.add_parser(
        "create",
        help="generate a built-in model deterministically (no downloads)",
        description="Write a built-in model as a Hugging Face directory. The same name always gives "
        "byte-identical files.",
    )
    create.add_argument("name", choices=sorted(BUILTIN_MODELS), help="which built-in model")
    create.add_argument("--out", metavar="DIR", help="output directory (default: $MESHD_HOME/models/NAME)")
    create.add_argument("--force", action="store_true", help="replace an existing directory")
    create.set_defaults(func=_cmd_model_create)

    demo = sub.add_parser("demo", help="run the built-in model split into ranges and compare with one process")
    demo.add_argument("--model", metavar="DIR", help="model directory (default: the built-in tiny model)")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
