"""``meshctl service install|uninstall|status|logs``: meshd or meshd-relay under systemd or launchd."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from meshd.service.plan import PLATFORMS, Installation, ServiceError, current_platform


def add_service_parser(sub: argparse._SubParsersAction) -> None:
    service = sub.add_parser(
        "service", help="install, remove and inspect meshd (or meshd-relay) as a systemd or launchd service",
        description="Run meshd or meshd-relay as a service of this machine's service manager: systemd on "
        "Linux, launchd on macOS. --user installs for the current user without root; --system installs "
        "for the whole machine (root), running as a dedicated user with hardening.")
    actions = service.add_subparsers(dest="service_action", required=True, metavar="ACTION")
    for name, text in (("install", "render the service file for this installation, install and start it"),
                       ("uninstall", "stop and disable the service and remove its file (settings and "
                                     "identity are kept)"),
                       ("status", "what the service manager says about the service"),
                       ("logs", "the service's recent log lines")):
        p = actions.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        scope = p.add_mutually_exclusive_group()
        scope.add_argument("--user", dest="scope", action="store_const", const="user",
                           help="a service of the current user (default; no root needed)")
        scope.add_argument("--system", dest="scope", action="store_const", const="system",
                           help="a service of the machine (needs root)")
        p.add_argument("--relay", action="store_true", help="meshd-relay instead of the meshd peer")
        p.add_argument("--platform", choices=PLATFORMS,
                       help="render for this platform (default: this machine's; useful with --dry-run)")
        if name == "install":
            p.add_argument("--config", type=Path, metavar="FILE",
                           help="settings file the service reads (default: the platform's usual place; "
                           "a commented one is written there if absent)")
            p.add_argument("--data-dir", type=Path, metavar="DIR",
                           help="identity and state of the peer (default: the platform's usual place; not with "
                           "--relay, which keeps none)")
        if name in ("install", "uninstall"):
            p.add_argument("--dry-run", action="store_true",
                           help="print every file it would write and every command it would run, do nothing")
        if name == "logs":
            p.add_argument("-n", "--lines", type=int, default=100, help="how many lines (default 100)")
            p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
        p.set_defaults(func=_cmd_service, scope="user")


def _cmd_service(args: argparse.Namespace) -> int:
    from meshd.service.manage import apply

    if args.relay and getattr(args, "data_dir", None) is not None:
        print("meshctl: meshd-relay keeps no state; --data-dir is for the meshd peer's service", file=sys.stderr)
        return 2
    try:
        inst = Installation.here("meshd-relay" if args.relay else "meshd", args.scope, args.platform,
                                 config=getattr(args, "config", None), data_dir=getattr(args, "data_dir", None))
        if args.service_action in ("install", "uninstall"):
            plan = inst.install_plan() if args.service_action == "install" else inst.uninstall_plan()
            if args.dry_run:
                print(plan.describe())
                return 0
            if inst.platform != current_platform():
                raise ServiceError(f"this machine is not {inst.platform}; use --dry-run to see the files")
            apply(plan, lambda line: print(line, file=sys.stderr))
            return 0
        command = (inst.status_command() if args.service_action == "status"
                   else inst.logs_command(args.lines, args.follow))
        try:
            return subprocess.run(command, check=False).returncode
        except FileNotFoundError:
            raise ServiceError(f"{command[0]} is not installed on this machine") from None
    except ServiceError as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return 1

