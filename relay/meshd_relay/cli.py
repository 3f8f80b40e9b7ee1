"""``meshd-relay``: run a relay until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import trio

from meshd.cli.signals import run_until_signalled
from meshd.errors import reportable
from meshd.logs import FORMATS as LOG_FORMATS
from meshd.logs import LEVELS as LOG_LEVELS
from meshd.logs import configure_logging as _configure
from meshd_relay.config import RelayConfig, load_config
from meshd_relay.server import RelayServer


def configure_logging(config: RelayConfig) -> None:
    _configure(config.log_level, config.log_format, quiet=("trio-websocket", "hpack", "hypercorn"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshd-relay", description=(
        "Relay for meshd peers that cannot be dialled directly. It pipes the peers' end-to-end TLS "
        "and never sees plaintext. Settings: --config (TOML), then MESHD_RELAY_* variables, then these flags."))
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML file with any of the settings below")
    p.add_argument("--listen", metavar="HOST:PORT", help="WebSocket listener (default 0.0.0.0:7800)")
    p.add_argument("--metrics", metavar="HOST:PORT", help="Prometheus /metrics listener ('' turns it off)")
    p.add_argument("--max-peers", type=int, help="registered peers at once")
    p.add_argument("--max-circuits-per-peer", type=int, help="open circuits to one peer")
    p.add_argument("--bandwidth", dest="bandwidth_bytes_per_s", metavar="SIZE",
                   help="bytes per second per peer, e.g. 8MiB (0: no cap)")
    p.add_argument("--bandwidth-burst", dest="bandwidth_burst_bytes", metavar="SIZE",
                   help="bytes a peer may send at once above its rate (default 4MiB)")
    p.add_argument("--idle-timeout", dest="idle_timeout_s", type=float, metavar="SECONDS",
                   help="close a circuit idle this long (default 300)")
    p.add_argument("--max-message", dest="max_message_bytes", metavar="SIZE", help="largest WebSocket message")
    p.add_argument("--allow-peer", dest="allow_peers", action="append", metavar="PEER_ID",
                   help="only these peers may register (repeatable)")
    p.add_argument("--mesh-key", metavar="HEX",
                   help="serve one private mesh: only peers showing its membership may register (the admission "
                   "key's 64 hex characters, from `meshctl status` on a member)")
    p.add_argument("--log-level", choices=LOG_LEVELS,
                   help="least severe records logged (default info)")
    p.add_argument("--log-format", choices=LOG_FORMATS,
                   help="json (default): one object per line; text: lines for people")
    p.add_argument("--ready-file", metavar="FILE", help="write the bound ports as JSON once listening")
    return p


def main(argv: list[str] | None = None) -> None:
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config")
    try:
        config = load_config(path, args)
    except (ValueError, OSError) as exc:
        print(f"meshd-relay: bad configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    configure_logging(config)

    server = RelayServer(config)
    try:
        trio.run(run_until_signalled, server.serve, logging.getLogger("meshd.relay"))
    except BaseException as exc:  # only OS and meshd errors are reported in one line; the rest re-raised
        error = reportable(exc)
        if error is None:
            raise
        logging.getLogger("meshd.relay").error("relay stopped", extra={"fields": {"error": str(error)}})
        sys.exit(1)


if __name__ == "__main__":
    main()
