"""The command-line tools, run as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

from meshd.models.builtin import directory_digest


def meshctl(*args: str, home=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if home is not None:
        env["MESHD_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", *args], capture_output=True, text=True,
                          env=env, timeout=300, check=False)


def test_model_create_writes_the_builtin_model(tmp_path, tiny_model):
    out = tmp_path / "m"
    run = meshctl("model", "create", "tiny", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(out)
    assert directory_digest(out) == directory_digest(tiny_model)
    again = meshctl("model", "create", "tiny", "--out", str(out))
    assert again.returncode == 1 and "already exists" in again.stderr


def test_model_create_rejects_unknown_names(tmp_path):
    run = meshctl("model", "create", "giant", "--out", str(tmp_path / "x"))
    assert run.returncode == 2 and "invalid choice" in run.stderr


def test_demo_reports_identical(tmp_path):
    run = meshctl("demo", home=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "identical:" in run.stdout
    assert (tmp_path / "models" / "tiny" / "config.json").is_file()


def meshd(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd.cli.meshd_main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120, check=False)


def test_a_bad_setting_is_one_line_and_exit_status_2(tmp_path):
    run = meshd("run", "--listen", "127.0.0.1:99999", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip() == ("meshd: bad configuration: listen: bad address '127.0.0.1:99999': "
                                  "port 99999 is outside 0-65535")
    assert not (tmp_path / "meshd-data").exists(), "nothing may start before the settings are valid"


def test_a_port_in_use_is_one_line_naming_the_listener(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag, what in (("--listen", "the peer transport"), ("--api", "the OpenAI API"),
                           ("--control", "the control API")):
            addresses = {"--listen": "127.0.0.1:0", "--api": "127.0.0.1:0", "--control": "127.0.0.1:0",
                         "--metrics": "127.0.0.1:0",
                         flag: f"127.0.0.1:{port}"}
            run = meshd("run", *[x for pair in addresses.items() for x in pair], "--data-dir", str(tmp_path / "d"),
                        cwd=tmp_path)
            assert run.returncode == 1, run.stderr
            assert "Traceback" not in run.stderr
            last = run.stderr.strip().splitlines()[-1]
            assert last.endswith(f"meshd stopped: cannot listen for {what} on 127.0.0.1:{port}: Address already in use")


def test_every_daemon_command_fails_in_one_line_when_the_daemon_is_down(tmp_path):
    import socket

    with socket.socket() as s:  # a port that was free a moment ago and has no listener now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for argv in (["peers"], ["status"], ["models"], ["route", "tiny"], ["sessions"], ["logs"], ["chat", "hi"],
                 ["peers", "--json"]):
        run = meshctl(*argv, "--control", f"127.0.0.1:{port}", "--timeout", "5")
        assert run.returncode == 1, (argv, run.stderr)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"meshctl: cannot reach the daemon's control API at "
                                                       f"127.0.0.1:{port}"), (argv, run.stderr)
        assert run.stdout == ""


def test_json_logs_are_one_object_per_line_naming_the_peer(tmp_path):
    import json
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        run = meshd("run", "--listen", f"127.0.0.1:{taken.getsockname()[1]}", "--api", "127.0.0.1:0",
                    "--control", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--log-format", "json",
                    "--data-dir", str(tmp_path / "d"), cwd=tmp_path)
    assert run.returncode == 1
    docs = [json.loads(line) for line in run.stderr.strip().splitlines()]
    assert docs[-1]["level"] == "error" and "cannot listen for the peer transport" in docs[-1]["msg"]
    assert len(docs[-1]["peer"]) > 20 and {"ts", "logger"} <= set(docs[-1])


def test_every_command_and_option_says_what_it_does():
    import argparse

    from meshd_relay.cli import build_parser as relay_parser

    from meshd.cli.meshctl_main import build_parser as meshctl_parser
    from meshd.cli.meshd_main import build_parser as meshd_parser

    silent = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {a.dest for a in action._choices_actions if a.help}
                for name, sub in action.choices.items():
                    if name not in helped:
                        silent.append(f"{path} {name}")
                    walk(sub, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                silent.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    for parser, name in ((meshd_parser(), "meshd"), (meshctl_parser(), "meshctl"), (relay_parser(), "meshd-relay")):
        walk(parser, name)
    assert silent == [], f"no --help text for: {', '.join(silent)}"


def test_the_relay_reports_a_port_in_use_in_one_line(tmp_path):
    import json
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, what in ((["--listen", f"127.0.0.1:{port}", "--metrics", ""], "the relay"),
                            (["--listen", "127.0.0.1:0", "--metrics", f"127.0.0.1:{port}"], "metrics")):
            run = subprocess.run([sys.executable, "-m", "meshd_relay.cli", *flags], capture_output=True, text=True,
                                 cwd=tmp_path, timeout=60, check=False)
            assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
            last = json.loads(run.stderr.strip().splitlines()[-1])
            assert last["msg"] == "relay stopped"
            assert last["error"] == f"cannot listen for {what} on 127.0.0.1:{port}: Address already in use"
