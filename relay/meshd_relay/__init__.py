"""``meshd-relay``: pipes opaque bytes between peers that cannot be dialled directly and their dialers.

The relay never terminates the peers' TLS: it pairs a dialer's WebSocket with one the registered
peer opens for that circuit and copies binary messages between them. See ``docs/relay-operators.md``.
"""

from meshd_relay.config import RelayConfig, load_config
from meshd_relay.server import RelayServer

__all__ = ["RelayConfig", "RelayServer", "load_config"]
