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
