"""Settings: every one described, the reference in docs generated from them, `meshd init`, and
validation before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from meshd_relay.config import RelayConfig
from meshd_relay.config import load_config as load_relay_config

from meshd.cli.config_reference import reference
from meshd.daemon.config import PeerConfig, load_config
from meshd.identity import Identity
from meshd.settings import commented_toml, described_fields

ROOT = Path(__file__).parents[1]


def test_the_configuration_reference_is_generated_from_the_code() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == reference(), "regenerate: python -m meshd.cli.config_reference > docs/configuration.md"
    for cls in (PeerConfig, RelayConfig):
        for name, _default, _text in described_fields(cls):
            assert f"| `{name}` |" in committed


@pytest.mark.parametrize("cls, load", [(PeerConfig, load_config), (RelayConfig, load_relay_config)])
def test_a_commented_settings_file_reads_back_as_the_defaults(tmp_path: Path, cls, load) -> None:
    path = tmp_path / "settings.toml"
    path.write_text(commented_toml(cls, "header"))
    assert load(path) == cls()
    # and each line, uncommented alone, is a valid setting of its default value
    for line in path.read_text().splitlines():
        if line.startswith("# ") and " = " in line and "(not set)" not in line:
            one = tmp_path / "one.toml"
            one.write_text(line[2:] + "\n")
            assert load(one) == cls(), line


def meshd(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd.cli.meshd_main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120, check=False)


def test_init_creates_the_identity_and_a_settings_file_and_keeps_both(tmp_path: Path) -> None:
    run = meshd("init", "--config", "peer.toml", "--data-dir", "state", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    identity = Identity.load_or_create(tmp_path / "state")
    assert identity.peer_id in run.stdout
    config = load_config(tmp_path / "peer.toml")
    assert config.data_dir == tmp_path / "state"
    assert config == PeerConfig(data_dir=tmp_path / "state")
    text = (tmp_path / "peer.toml").read_text()
    for name, _default, _help in described_fields(PeerConfig):
        assert f"{name} = " in text, f"{name} is missing from the file init writes"
    again = meshd("init", "--config", "peer.toml", "--data-dir", "state", cwd=tmp_path)
    assert again.returncode == 1 and "exists" in again.stderr
    forced = meshd("init", "--config", "peer.toml", "--data-dir", "state", "--force", cwd=tmp_path)
    assert forced.returncode == 0 and identity.peer_id in forced.stdout, "the identity is kept"


@pytest.mark.parametrize("toml, message", [
    ("kv_budget = [1, 2]", "kv_budget: expected one value, not a list"),
    ("chunk_tokens = 0", "chunk_tokens must be at least 1"),
    ("step_timeout_s = -1", "step_timeout_s must be a positive number of seconds"),
    ("tracker_eligible = \"maybe\"", "tracker_eligible: 'maybe' is not true or false"),
    ("listen = \"localhost\"", "listen: bad address 'localhost'; expected HOST:PORT"),
    ("log_format = \"xml\"", "log_format: 'xml' is not one of text, json"),
    ("max_sessions = 2.5", "max_sessions: 2.5 is not a whole number"),
    ("no_such_setting = 1", "unknown settings: no_such_setting"),
    ("prefill_only = true", "prefill_only needs a model and a pinned range"),
    ("prefill_workers = -1", "prefill_workers cannot be negative"),
    ("draft_model = \"draft\"\nspeculative = \"ngram\"", "draft_model is for speculative = auto or model"),
    ("open_mesh = true\ninvite = \"x\"", "an invite joins a private mesh and open_mesh takes part in an open one"),
    ("relays = [\"127.0.0.1:7900\"]\nreachability = \"direct\"", "direct never uses them"),
    ("dtype = \"int8\"\nlayers = \"0:4\"", "layers, dtype: for the model this peer serves, and it is given none"),
    ("model_id = \"tiny\"\nbackend = \"torch\"\nnumerics = \"cpu/float32/prefill-native/decode-native-rows1\"",
     "backend, numerics: for a model given with model; a peer fetching model_id computes it in the numerics class"),
    ("name = 5", "name: expected text, not 5 (in a settings file, quote it)"),
    ("invite = 5", "invite: expected text"),
    ("lease_duration_s = 3600", "lease_duration_s is at most 600 seconds: peers refuse longer leases"),
    ("listen = ", "Invalid value"),
])
def test_a_bad_settings_file_is_refused_in_one_line_before_anything_starts(tmp_path: Path, toml: str,
                                                                          message: str) -> None:
    (tmp_path / "bad.toml").write_text(toml + "\n")
    run = meshd("run", "--config", "bad.toml", "--data-dir", "state", cwd=tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshd: bad configuration: ") and message in lines[0], lines
    assert not (tmp_path / "state").exists()


def test_a_path_setting_left_empty_is_not_set(tmp_path: Path) -> None:
    """The file `meshd init` writes shows unset paths as ``""``: uncommented, they stay unset."""
    (tmp_path / "peer.toml").write_text('draft_model = ""\nready_file = ""\nmodel = ""\n')
    config = load_config(tmp_path / "peer.toml")
    assert (config.draft_model, config.ready_file, config.model) == (None, None, None)


def test_a_peer_fetching_its_model_may_pin_its_range_and_one_without_a_model_takes_the_defaults() -> None:
    assert PeerConfig(model_id="tiny", layers=(0, 2)).layers == (0, 2)
    assert PeerConfig(kv_tier=1024, dtype="auto", backend="auto").model is None  # "auto" given is the default


def test_a_bad_settings_file_is_refused_before_the_model_code_loads(tmp_path: Path) -> None:
    """The refusal comes in a fraction of a second: torch and the model code load only for good settings."""
    (tmp_path / "bad.toml").write_text("chunk_tokens = 0\n")
    script = ("import sys\nfrom meshd.cli.meshd_main import main\n"
              "try:\n    main(['run', '--config', 'bad.toml'])\n"
              "except SystemExit as exc:\n    print(exc.code, 'torch' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         check=False)
    assert run.stdout.split() == ["2", "False"], (run.stdout, run.stderr)
    assert "chunk_tokens must be at least 1" in run.stderr
