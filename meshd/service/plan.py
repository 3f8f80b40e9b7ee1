"""What installing meshd or meshd-relay as a service means on this machine: files and commands.

A :class:`ServicePlan` is computed without touching anything (``--dry-run`` prints it), from the
templates in ``systemd/`` (Linux) and ``launchd/`` (macOS) beside this module and the facts of this
installation: the interpreter's environment, the user, the config file and the data directory.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape

HERE = Path(__file__).parent
PROGRAMS = ("meshd", "meshd-relay")
PLATFORMS = ("linux", "macos")
SCOPES = ("user", "system")
SYSTEM_USER = {"linux": "meshd", "macos": "_meshd"}
DESCRIPTIONS = {
    "meshd": "meshd peer (serves layers of a language model to a mesh, answers the OpenAI API)",
    "meshd-relay": "meshd relay (opaque WebSocket pipe for meshd peers behind NAT)",
}
LABELS = {"meshd": "org.meshd.meshd", "meshd-relay": "org.meshd.relay"}
# the daemon drains sessions for drain_timeout_s (30 s by default) on SIGTERM; the manager waits longer
STOP_TIMEOUT_S = {"meshd": 45, "meshd-relay": 10}
SETTINGS_HEADER = """{program} settings (TOML), written by `meshctl service install` because there were none.
Every setting is listed with its meaning and default, commented out: uncomment what you change,
then `meshctl service install` again or restart the service. docs/configuration.md has the same list."""


def default_settings(program: str, data_dir: Path | None = None) -> str:
    """The commented settings file a fresh install gets: every setting, none set (the data directory
    is the service's ``--data-dir``, which a line here could not change)."""
    from meshd.settings import commented_toml

    if program == "meshd":
        from meshd.daemon.config import PeerConfig

        given = {"data_dir": f"the service gives it ({data_dir}) with --data-dir, which overrides this file; to "
                             "change it, run `meshctl service install` again with --data-dir"} if data_dir else None
        return commented_toml(PeerConfig, SETTINGS_HEADER.format(program=program), given_elsewhere=given)
    from meshd_relay.config import RelayConfig

    return commented_toml(RelayConfig, SETTINGS_HEADER.format(program=program))


class ServiceError(Exception):
    """A service cannot be installed or managed as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Step:
    """One command of a plan; skipped when ``unless`` (a check command) succeeds."""

    argv: tuple[str, ...]
    unless: tuple[str, ...] = ()
    may_fail: bool = False  # for stop/disable of something that may not be running

    def __str__(self) -> str:
        text = shlex.join(self.argv)
        return f"{text}    (unless `{shlex.join(self.unless)}` succeeds)" if self.unless else text


@dataclass(frozen=True)
class FileWrite:
    path: Path
    content: str
    mode: int = 0o644
    keep_existing: bool = False  # an operator's config is never overwritten


@dataclass(frozen=True)
class Remove:
    path: Path


Action = FileWrite | Remove | Step


@dataclass
class ServicePlan:
    """Everything one ``meshctl service`` action does, in order, then what the operator should know."""

    action: str
    actions: list[Action] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = []
        for a in self.actions:
            if isinstance(a, FileWrite):
                state = "kept if present" if a.keep_existing else f"mode {a.mode:o}"
                lines.append(f"write {a.path} ({state}):")
                lines.extend(f"    {line}" for line in a.content.rstrip("\n").splitlines())
            elif isinstance(a, Remove):
                lines.append(f"remove {a.path}")
            else:
                lines.append(f"run {a}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


@dataclass(frozen=True)
class Installation:
    """Where one program's service lives for one platform and scope."""

    program: str
    platform: str
    scope: str
    home: Path
    uid: int
    user: str
    bin_dir: Path
    config: Path | None = None
    data_dir: Path | None = None

    @classmethod
    def here(cls, program: str, scope: str, platform: str | None = None, config: Path | None = None,
             data_dir: Path | None = None) -> Installation:
        if program not in PROGRAMS:
            raise ServiceError(f"unknown program {program!r}; one of {', '.join(PROGRAMS)}")
        if scope not in SCOPES:
            raise ServiceError(f"unknown scope {scope!r}; --user or --system")
        platform = platform or current_platform()
        if platform not in PLATFORMS:
            raise ServiceError(f"services are installed on Linux (systemd) and macOS (launchd), not {platform}")
        return cls(program, platform, scope, Path.home(), os.getuid(), _user_name(), Path(sys.executable).parent,
                   config=config.absolute() if config else None,
                   data_dir=data_dir.absolute() if data_dir else None)

    # -- where things go ----------------------------------------------------------------------------

    @property
    def executable(self) -> Path:
        return self.bin_dir / self.program

    @property
    def label(self) -> str:
        return LABELS[self.program]

    @property
    def unit_name(self) -> str:
        return f"{self.program}.service"

    @property
    def service_file(self) -> Path:
        if self.platform == "linux":
            base = (Path("/etc/systemd/system") if self.scope == "system"
                    else _xdg(self.home, "XDG_CONFIG_HOME", ".config") / "systemd" / "user")
            return base / self.unit_name
        base = Path("/Library/LaunchDaemons") if self.scope == "system" else self.home / "Library" / "LaunchAgents"
        return base / f"{self.label}.plist"

    @property
    def config_file(self) -> Path:
        if self.config is not None:
            return self.config
        name = "meshd.toml" if self.program == "meshd" else "relay.toml"
        if self.platform == "linux":
            base = Path("/etc") if self.scope == "system" else _xdg(self.home, "XDG_CONFIG_HOME", ".config")
            return base / self.program / name
        return self._support_dir / name

    @property
    def state_dir(self) -> Path:
        if self.data_dir is not None:
            return self.data_dir
        if self.platform == "linux":
            if self.scope == "system":
                return Path("/var/lib") / self.program
            return _xdg(self.home, "XDG_DATA_HOME", Path(".local") / "share") / "meshd" / "data"
        return self._support_dir / "data"

    @property
    def log_file(self) -> Path:
        """macOS only: launchd writes stdout and stderr here (systemd has the journal)."""
        base = Path("/Library/Logs") if self.scope == "system" else self.home / "Library" / "Logs"
        return base / "meshd" / f"{self.program}.log"

    @property
    def _support_dir(self) -> Path:
        root = Path("/Library") if self.scope == "system" else self.home / "Library"
        return root / "Application Support" / self.program

    @property
    def arguments(self) -> list[str]:
        args = [str(self.executable), *(["run"] if self.program == "meshd" else []), "--config", str(self.config_file)]
        if self.program == "meshd":
            args += ["--data-dir", str(self.state_dir)]
        return args

    @property
    def _systemctl(self) -> tuple[str, ...]:
        return ("systemctl",) if self.scope == "system" else ("systemctl", "--user")

    @property
    def _launchd_domain(self) -> str:
        return "system" if self.scope == "system" else f"gui/{self.uid}"

    # -- rendering ----------------------------------------------------------------------------------

    def render(self) -> str:
        """The unit file or property list for this installation."""
        return self._render_systemd() if self.platform == "linux" else self._render_launchd()

    def _render_systemd(self) -> str:
        system = self.scope == "system"
        if self.program == "meshd-relay":
            identity = ["DynamicUser=yes", "ConfigurationDirectory=meshd-relay"] if system else []
            hardening = "relay-system.conf" if system else "user.conf"
        else:
            identity = [f"User={SYSTEM_USER['linux']}", f"Group={SYSTEM_USER['linux']}",
                        f"StateDirectory={self.state_dir.name}", "StateDirectoryMode=0700",
                        "ConfigurationDirectory=meshd"] if system and self.data_dir is None else (
                [f"User={SYSTEM_USER['linux']}", f"Group={SYSTEM_USER['linux']}",
                 f"ReadWritePaths={self.state_dir}"] if system else [])
            hardening = "meshd-system.conf" if system else "user.conf"
        template = Template((HERE / "systemd" / "unit.service").read_text())
        return template.substitute(
            description=DESCRIPTIONS[self.program],
            exec_start=" ".join(_systemd_quote(a) for a in self.arguments),
            identity="\n".join(identity),
            stop_timeout=f"{STOP_TIMEOUT_S[self.program]}s",
            hardening=(HERE / "systemd" / hardening).read_text().rstrip("\n"),
            wanted_by="multi-user.target" if system else "default.target",
        )

    def _render_launchd(self) -> str:
        identity = ""
        if self.scope == "system":
            user = SYSTEM_USER["macos"]
            identity = "\n".join(f"\t<key>{key}</key>\n\t<string>{user}</string>" for key in ("UserName", "GroupName"))
        template = Template((HERE / "launchd" / "service.plist").read_text())
        return template.substitute(
            description=escape(DESCRIPTIONS[self.program]),
            label=self.label,
            program_arguments="\n".join(f"\t\t<string>{escape(a)}</string>" for a in self.arguments),
            identity=identity,
            working_directory=escape(str(self.state_dir if self.program == "meshd" else self.log_file.parent)),
            stop_timeout=STOP_TIMEOUT_S[self.program],
            log_path=escape(str(self.log_file)),
        )

    # -- plans --------------------------------------------------------------------------------------

    def install_plan(self) -> ServicePlan:
        plan = ServicePlan("install")
        plan.actions.append(FileWrite(self.config_file, default_settings(self.program, self.state_dir), 0o644,
                                      keep_existing=True))
        plan.actions.append(FileWrite(self.service_file, self.render()))
        system_user = SYSTEM_USER[self.platform]
        needs_user = self.scope == "system" and self.program == "meshd"
        if self.platform == "linux":
            if needs_user:
                plan.actions.append(Step(("useradd", "--system", "--user-group", "--home-dir", str(self.state_dir),
                                        "--no-create-home", "--shell", "/usr/sbin/nologin", system_user),
                                       unless=("id", "-u", system_user)))
                if self.data_dir is not None:
                    plan.actions.append(Step(("install", "-d", "-m", "0700", "-o", system_user, "-g", system_user,
                                            str(self.state_dir))))
            elif self.scope == "user" and self.program == "meshd":  # the relay keeps no state
                plan.actions.append(Step(("install", "-d", "-m", "0700", str(self.state_dir))))
            plan.actions += [Step((*self._systemctl, "daemon-reload")),
                           Step((*self._systemctl, "enable", "--now", self.unit_name))]
            if self.scope == "user":
                plan.notes.append(f"a user service stops when {self.user} logs out; to keep it running: "
                                  f"loginctl enable-linger {self.user}")
        else:
            if needs_user:
                plan.actions.append(Step(("sysadminctl", "-addUser", system_user, "-fullName", "meshd daemon",
                                        "-shell", "/usr/bin/false", "-home", str(self.state_dir), "-roleAccount"),
                                       unless=("id", "-u", system_user)))
            owner = (("-o", system_user) if needs_user else ())
            if self.program == "meshd":
                plan.actions.append(Step(("install", "-d", "-m", "0700", *owner, str(self.state_dir))))
            plan.actions.append(Step(("install", "-d", "-m", "0755", *owner, str(self.log_file.parent))))
            plan.actions.append(Step(("launchctl", "bootout", f"{self._launchd_domain}/{self.label}"), may_fail=True))
            plan.actions.append(Step(("launchctl", "bootstrap", self._launchd_domain, str(self.service_file))))
            plan.actions.append(Step(("launchctl", "enable", f"{self._launchd_domain}/{self.label}")))
        if self.scope == "system" and not _reachable_by_others(self.executable):
            plan.notes.append(f"warning: {self.executable} is not reachable by other users (a directory above it "
                              f"lacks o+x), so the service's own user cannot start it; install meshd where every "
                              f"user can read it (for example a virtual environment in /opt/meshd)")
        plan.notes.append(f"settings: {self.config_file} (written only if absent); then "
                          f"`meshctl service status{self._flags}`")
        return plan

    def uninstall_plan(self) -> ServicePlan:
        plan = ServicePlan("uninstall")
        if self.platform == "linux":
            plan.actions.append(Step((*self._systemctl, "disable", "--now", self.unit_name), may_fail=True))
            plan.actions.append(Remove(self.service_file))
            plan.actions.append(Step((*self._systemctl, "daemon-reload")))
        else:
            plan.actions.append(Step(("launchctl", "bootout", f"{self._launchd_domain}/{self.label}"), may_fail=True))
            plan.actions.append(Remove(self.service_file))
        kept = [str(self.config_file)] + ([str(self.state_dir)] if self.program == "meshd" else [])
        plan.notes.append(f"kept: {', '.join(kept)} (the identity key and settings; remove them by hand if wanted)")
        return plan

    def status_command(self) -> list[str]:
        if self.platform == "linux":
            return [*self._systemctl, "status", "--no-pager", "--lines=0", self.unit_name]
        return ["launchctl", "print", f"{self._launchd_domain}/{self.label}"]

    def logs_command(self, lines: int, follow: bool) -> list[str]:
        if self.platform == "linux":
            journal = ["journalctl"] + (["--user"] if self.scope == "user" else [])
            return [*journal, "--unit", self.unit_name, "--lines", str(lines), "--no-pager",
                    *(["--follow"] if follow else [])]
        return ["tail", "-n", str(lines), *(["-F"] if follow else []), str(self.log_file)]

    @property
    def _flags(self) -> str:
        return (" --system" if self.scope == "system" else " --user") + (
            " --relay" if self.program == "meshd-relay" else "")


def current_platform() -> str:
    return {"linux": "linux", "darwin": "macos"}.get(sys.platform, sys.platform)


def _xdg(home: Path, variable: str, default: Path | str) -> Path:
    value = os.environ.get(variable)
    return Path(value) if value and Path(value).is_absolute() else home / default


def _reachable_by_others(path: Path) -> bool:
    """Whether a user other than the owner may execute ``path`` (every directory above it searchable)."""
    try:
        if os.stat(path).st_mode & 0o005 != 0o005:
            return False
        return all(os.stat(p).st_mode & 0o001 for p in path.parents)
    except OSError:
        return False


def _user_name() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _systemd_quote(arg: str) -> str:
    """Quote one ExecStart argument as systemd reads it (double quotes, backslash escapes; % doubled)."""
    arg = arg.replace("%", "%%")
    if arg and not any(c in arg for c in " \t\"'\\;$"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("$", "$$") + '"'
