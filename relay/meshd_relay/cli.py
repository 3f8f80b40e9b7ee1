"""``meshd-relay``: run a relay until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import trio

from meshd.cli.signals import run_until_signalled
from meshd_relay.config import RelayConfig, load_config
from meshd_relay.server import RelayServer


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the event's own fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        doc.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        extra = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        return f"{stamp} {record.levelname} {record.name}: {record.getMessage()}" + (f" {extra}" if extra else "")


def configure_logging(config: RelayConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if config.log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.log_level.upper())
    for noisy in ("trio-websocket", "hpack", "hypercorn"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


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
    p.add_argument("--bandwidth-burst", dest="bandwidth_burst_bytes", metavar="SIZE")
    p.add_argument("--idle-timeout", dest="idle_timeout_s", type=float, metavar="SECONDS")
    p.add_argument("--max-message", dest="max_message_bytes", metavar="SIZE", help="largest WebSocket message")
    p.add_argument("--allow-peer", dest="allow_peers", action="append", metavar="PEER_ID",
                   help="only these peers may register (repeatable)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["json", "text"])
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
    except OSError as exc:
        logging.getLogger("meshd.relay").error("relay stopped", extra={"fields": {"error": str(exc)}})
        sys.exit(1)


if __name__ == "__main__":
    main()
