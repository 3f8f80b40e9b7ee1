"""``meshctl bench-relay``'s arguments, apart from the benchmark so that meshctl starts without torch."""

from __future__ import annotations

import argparse

from meshd.cli.mode_options import ModeTable, fill_defaults, misplaced

LINK_CAPS = "12.5MB,125MB"  # 100 Mbit/s and 1 Gbit/s

# the options of the measurements a flag turns on, with their defaults (meshd.cli.mode_options)
MEASUREMENT_OPTIONS: ModeTable = {
    "--compression": {"--compression-tokens": ("compression_tokens", 512),
                      "--compression-samples": ("compression_samples", 20), "--link-caps": ("link_caps", LINK_CAPS)},
    "--decode": {"--model": ("model", "bench"), "--new-tokens": ("new_tokens", 64), "--runs": ("runs", 3)},
}


def options_refused(args: argparse.Namespace) -> str | None:
    """What is wrong with options given without the measurement they are for (None: nothing, and the
    defaults of the measurements turned on are filled in)."""
    active = {flag for flag, on in (("--compression", args.compression), ("--decode", args.decode)) if on}
    wrong = [f"{flag} is for {mode}" for flag, mode in misplaced(args, MEASUREMENT_OPTIONS, active)]
    if wrong:
        return f"{'; '.join(wrong)}: give that flag too, or leave the option out"
    fill_defaults(args, MEASUREMENT_OPTIONS, active)
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=200, metavar="N", help="round trips per link and size")
    parser.add_argument("--hidden-size", type=int, default=1024, metavar="N",
                        help="hidden size for the message sizes (default 1024, the bench model's)")
    parser.add_argument("--chunk-tokens", type=int, default=128, metavar="N", help="prefill chunk in tokens")
    parser.add_argument("--compression", action="store_true",
                        help="also measure zstd on a prefill chunk over direct, relayed and capped links")
    parser.add_argument("--compression-tokens", type=int, metavar="N",
                        help="tokens in the chunk for --compression (default 512)")
    parser.add_argument("--compression-samples", type=int, metavar="N",
                        help="chunks per link and encoding for --compression (default 20)")
    parser.add_argument("--link-caps", metavar="LIST",
                        help=f"relay bandwidth caps for --compression (default {LINK_CAPS})")
    parser.add_argument("--decode", action="store_true",
                        help="also measure decode tok/s of --model on 2 peers, tail direct vs relayed")
    parser.add_argument("--model", metavar="NAME|DIR", help="model for --decode (default bench)")
    parser.add_argument("--new-tokens", type=int, metavar="N",
                        help="tokens per decode run for --decode (default 64)")
    parser.add_argument("--runs", type=int, metavar="N",
                        help="decode runs per link for --decode (default 3)")
    parser.add_argument("--workdir", metavar="DIR", help="keep logs here (default: a temporary directory)")
    parser.add_argument("--out", default="bench-out/bench-relay.json", metavar="FILE", help="JSON report")
