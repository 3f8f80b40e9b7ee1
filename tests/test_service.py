"""meshctl service: rendered units and property lists, dry runs, verification by systemd, real installs."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.cli.meshctl_main import main as meshctl
from meshd.service.manage import apply
from meshd.service.plan import PROGRAMS, FileWrite, Installation, ServiceError, ServicePlan, Step, default_settings

REQUIRE_TOOLS = os.environ.get("MESHD_REQUIRE_SYSTEM_TOOLS") == "1"


def _run_meshctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        meshctl(list(argv))
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err


@pytest.mark.parametrize("platform", ["linux", "macos"])
@pytest.mark.parametrize("scope", ["user", "system"])
@pytest.mark.parametrize("relay", [False, True])
def test_a_dry_run_prints_every_file_and_command_and_touches_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        platform: str, scope: str, relay: bool) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    rc, out, _ = _run_meshctl(capsys, "service", "install", "--dry-run", f"--{scope}", "--platform", platform,
                              *(["--relay"] if relay else []))
    assert rc == 0
    program = "meshd-relay" if relay else "meshd"
    inst = Installation.here(program, scope, platform)
    assert f"write {inst.service_file} (mode 644):" in out
    assert f"write {inst.config_file} (kept if present):" in out
    assert str(inst.executable) in out
    if platform == "linux":
        assert f"run {'systemctl' if scope == 'system' else 'systemctl --user'} enable --now {program}.service" in out
        if scope == "user":
            assert "loginctl enable-linger" in out
        if scope == "system" and not relay:
            assert "useradd --system" in out and "User=meshd" in out and "ProtectSystem=strict" in out
        if scope == "system" and relay:
            assert "DynamicUser=yes" in out
    else:
        domain = "system" if scope == "system" else f"gui/{os.getuid()}"
        assert f"run launchctl bootstrap {domain} {inst.service_file}" in out
    assert list(tmp_path.iterdir()) == [], "a dry run wrote files"
    settings = default_settings(program, inst.state_dir)
    # the unit gives the data directory with --data-dir, which overrides the file: no line offers it
    flat = settings.replace("\n# ", " ")  # the comments' lines joined again
    assert "data_dir =" not in settings and (f"({inst.state_dir})" in flat) is not relay
    assert (str(inst.state_dir) in out) is not relay, "only the peer has a data directory"

    rc, out, _ = _run_meshctl(capsys, "service", "uninstall", "--dry-run", f"--{scope}", "--platform", platform,
                              *(["--relay"] if relay else []))
    assert rc == 0 and f"remove {inst.service_file}" in out and "kept:" in out


def test_the_relay_service_takes_no_data_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = _run_meshctl(capsys, "service", "install", "--dry-run", "--relay", "--data-dir", str(tmp_path))
    assert rc == 2 and out == ""
    assert err.strip() == "meshctl: meshd-relay keeps no state; --data-dir is for the meshd peer's service"


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        if REQUIRE_TOOLS:
            pytest.fail("systemd-analyze is missing; `make test` installs Debian's systemd package")
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    return tool


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("scope", ["system", "user"])
def test_the_systemd_units_pass_systemd_analyze_verify(tmp_path: Path, program: str, scope: str) -> None:
    tool = _systemd_analyze()
    inst = Installation.here(program, scope, "linux", config=tmp_path / "settings.toml")
    assert inst.executable.is_file(), "the unit must name this installation's own program"
    unit = tmp_path / inst.unit_name
    unit.write_text(inst.render())
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    result = subprocess.run([tool, *(["--user"] if scope == "user" else []), "verify", str(unit)],
                            capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    # systemd reports unknown keys and bad values as warnings with exit status 0: both must be silent
    assert result.returncode == 0 and result.stderr.strip() == "" and result.stdout.strip() == "", result
    text = unit.read_text()
    assert "Restart=on-failure" in text and "KillSignal=SIGTERM" in text
    if scope == "system":
        for option in ("NoNewPrivileges=yes", "ProtectSystem=strict", "LimitNOFILE=", "TasksMax="):
            assert option in text
        assert ("StateDirectory=meshd" in text) == (program == "meshd")


def test_a_broken_unit_is_caught_by_the_same_check(tmp_path: Path) -> None:
    """The verification above can fail: systemd's warnings for a bad key reach stderr."""
    tool = _systemd_analyze()
    inst = Installation.here("meshd", "system", "linux")
    unit = tmp_path / inst.unit_name
    unit.write_text(inst.render().replace("Restart=on-failure", "Restart=sometimes"))
    result = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, cwd=tmp_path)
    assert "sometimes" in result.stderr


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("scope", ["user", "system"])
def test_the_launchd_property_lists_parse_and_carry_the_expected_keys(program: str, scope: str) -> None:
    inst = Installation.here(program, scope, "macos", config=Path("/tmp/with space & <odd>/s.toml"))
    job = plistlib.loads(inst.render().encode())
    assert job["Label"] == inst.label
    assert job["ProgramArguments"][0] == str(inst.executable)
    assert job["ProgramArguments"][job["ProgramArguments"].index("--config") + 1] == "/tmp/with space & <odd>/s.toml"
    assert ("run" in job["ProgramArguments"]) == (program == "meshd")
    assert job["RunAtLoad"] is True and job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["ExitTimeOut"] >= 10 and job["StandardErrorPath"] == str(inst.log_file)
    assert job["SoftResourceLimits"]["NumberOfFiles"] == 65536
    assert ("UserName" in job) == (scope == "system")
    if scope == "user":
        assert inst.service_file.parent.name == "LaunchAgents"
    else:
        assert str(inst.service_file).startswith("/Library/LaunchDaemons/")


def test_execstart_quotes_paths_as_systemd_reads_them(tmp_path: Path) -> None:
    odd = tmp_path / "my settings" / "100% $real.toml"
    text = Installation.here("meshd", "user", "linux", config=odd).render()
    line = next(x for x in text.splitlines() if x.startswith("ExecStart="))
    assert '"' + str(odd).replace("%", "%%").replace("$", "$$") + '"' in line


def test_applying_keeps_an_existing_config_and_stops_at_a_failing_command(tmp_path: Path) -> None:
    config = tmp_path / "etc" / "meshd.toml"
    config.parent.mkdir()
    config.write_text('name = "mine"\n')
    marker = tmp_path / "after"
    plan = ServicePlan("install", [
        FileWrite(config, "# default\n", keep_existing=True),
        FileWrite(tmp_path / "units" / "meshd.service", "[Unit]\n"),
        Step((sys.executable, "-c", "raise SystemExit('no bus here')")),
        Step(("touch", str(marker))),
    ])
    said: list[str] = []
    with pytest.raises(ServiceError, match="failed \\(exit 1\\): no bus here"):
        apply(plan, said.append)
    assert config.read_text() == 'name = "mine"\n'
    assert (tmp_path / "units" / "meshd.service").read_text() == "[Unit]\n"
    assert not marker.exists(), "a command after the failing one ran"
    assert any(line.startswith("keep ") for line in said)


def test_a_step_is_skipped_when_its_check_succeeds(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    said: list[str] = []
    apply(ServicePlan("install", [Step(("touch", str(marker)), unless=("true",))]), said.append)
    assert not marker.exists() and said[0].startswith("skip touch")


def _user_manager() -> str:
    """Empty when `systemctl --user` reaches a running user manager, else why not."""
    if shutil.which("systemctl") is None:
        return "systemctl is not installed"
    state = subprocess.run(["systemctl", "--user", "is-system-running"], capture_output=True, text=True)
    word = state.stdout.strip()
    return "" if word in ("running", "degraded") else f"no systemd user manager here (`systemctl --user " \
        f"is-system-running`: {word or state.stderr.strip()})"


@pytest.mark.slow
def test_a_real_user_install_starts_the_peer_and_uninstall_removes_it(tmp_path: Path) -> None:
    why = _user_manager()
    if why:
        pytest.skip(why)
    inst = Installation.here("meshd", "user", "linux", config=tmp_path / "meshd.toml", data_dir=tmp_path / "data")
    if inst.service_file.exists():
        pytest.skip(f"{inst.service_file} exists: this user already runs meshd as a service")
    (tmp_path / "meshd.toml").write_text('listen = "127.0.0.1:0"\napi = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\n')
    try:
        apply(inst.install_plan(), lambda _line: None)
        active = subprocess.run(["systemctl", "--user", "is-active", inst.unit_name], capture_output=True, text=True)
        assert active.stdout.strip() in ("active", "activating")
    finally:
        apply(inst.uninstall_plan(), lambda _line: None)
    assert not inst.service_file.exists()


def test_a_user_install_without_a_user_manager_fails_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Where there is no user manager (containers, CI) the real install path runs up to systemctl and
    stops there with systemd's own reason; the files it wrote are the rendered ones."""
    why = _user_manager()
    if not why:
        pytest.skip("a user manager is running here; the real install test covers this machine")
    if shutil.which("systemctl") is None:
        pytest.skip(why)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    rc, _, err = _run_meshctl(capsys, "service", "install", "--user", "--platform", "linux")
    assert rc == 1
    assert err.strip().splitlines()[-1].startswith("meshctl: `systemctl --user daemon-reload` failed")
    unit = tmp_path / "config" / "systemd" / "user" / "meshd.service"
    assert unit.read_text() == Installation.here("meshd", "user", "linux").render()
    written = tmp_path / "config" / "meshd" / "meshd.toml"
    assert written.read_text().startswith("# meshd settings")
    from meshd.daemon.config import PeerConfig, load_config

    assert load_config(written) == PeerConfig(), "the settings a fresh install writes are the defaults"
    assert (tmp_path / "data" / "meshd" / "data").is_dir()


def test_installing_for_another_platform_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    other = "macos" if sys.platform.startswith("linux") else "linux"
    rc, _, err = _run_meshctl(capsys, "service", "install", "--user", "--platform", other)
    assert rc == 1 and "use --dry-run" in err
