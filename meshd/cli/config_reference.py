"""docs/configuration.md, generated from the settings classes of the peer and the relay, so that the
reference cannot drift from the code: ``python -m meshd.cli.config_reference > docs/configuration.md``
(a test fails when the committed file differs)."""

from __future__ import annotations

from meshd.daemon.config import PeerConfig
from meshd.settings import settings_reference

INTRO = """\
# Configuration reference

Generated from the settings code (`python -m meshd.cli.config_reference > docs/configuration.md`);
a test fails when this file and the code disagree.

Each program reads its settings in this order, later ones winning: the defaults below, the TOML
file given with `--config`, environment variables, then command-line flags (the common settings
have one, `--help` lists them, e.g. `kv_budget` is `--kv-budget`). An unknown setting, a value of the
wrong type or out of range stops the program before it starts anything, with one line naming the
setting and exit status 2. Sizes take units (`512MiB`, `2GB`, `1048576`); lists in the environment
are comma-separated. `meshd init` writes a TOML file with every setting below, commented out.
"""


def reference() -> str:
    from meshd_relay.config import RelayConfig

    return (INTRO + "\n## meshd (the peer)\n\n" + settings_reference(PeerConfig, "MESHD_")
            + "\n## meshd-relay\n\n" + settings_reference(RelayConfig, "MESHD_RELAY_"))


if __name__ == "__main__":
    print(reference(), end="")
