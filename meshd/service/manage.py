"""Carrying out a :class:`~meshd.service.plan.ServicePlan`: files written whole, commands run in order."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable

from meshd.files import write_atomically
from meshd.service.plan import Remove, ServiceError, ServicePlan, Step

Say = Callable[[str], None]


def _run(argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ServiceError(f"{argv[0]} is not installed on this machine") from None


def run_step(step: Step, say: Say) -> None:
    if step.unless and _run(step.unless).returncode == 0:
        say(f"skip {step.argv[0]}: `{shlex.join(step.unless)}` succeeded")
        return
    say(f"run {shlex.join(step.argv)}")
    result = _run(step.argv)
    if result.returncode != 0 and not step.may_fail:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise ServiceError(f"`{shlex.join(step.argv)}` failed (exit {result.returncode})"
                           + (f": {detail[-1]}" if detail else ""))


def apply(plan: ServicePlan, say: Say) -> None:
    """Write, remove and run what the plan says, in order; the first failure stops it with its error."""
    for action in plan.actions:
        if isinstance(action, Step):
            run_step(action, say)
        elif isinstance(action, Remove):
            try:
                action.path.unlink(missing_ok=True)
            except PermissionError:
                raise ServiceError(f"cannot remove {action.path}: permission denied (a --system service "
                                   "needs root)") from None
            say(f"removed {action.path}")
        elif action.keep_existing and action.path.exists():
            say(f"keep {action.path} (exists)")
        else:
            try:
                action.path.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(action.path, action.content, action.mode)
            except PermissionError:
                raise ServiceError(f"cannot write {action.path}: permission denied (a --system install "
                                   "needs root)") from None
            say(f"wrote {action.path}")
    for note in plan.notes:
        say(f"note: {note}")
