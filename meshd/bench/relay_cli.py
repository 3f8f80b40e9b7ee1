"""``meshctl bench-relay``'s arguments, apart from the benchmark so that meshctl starts without torch."""

from __future__ import annotations

import argparse

LINK_CAPS = "12.5MB,125MB"  # 100 Mbit/s and 1 Gbit/s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=200, metavar="N", help="round trips per link and size")
    parser.add_argument("--hidden-size", type=int, default=1024, metavar="N",
                        help="hidden size for the message sizes (default 1024, the bench model's)")
    parser.add_argument("--chunk-tokens", type=int, default=128, metavar="N", help="prefill chunk in tokens")
    parser.add_argument("--compression", action="store_true",
                        help="also measure zstd on a prefill chunk over direct, relayed and capped links")
    parser.add_argument("--compression-tokens", type=int, default=512, metavar="N",
                        help="tokens in the chunk for --compression (default 512)")
    parser.add_argument("--compression-samples", type=int, default=20, metavar="N",
                        help="chunks per link and encoding for --compression (default 20)")
    parser.add_argument("--link-caps", default=LINK_CAPS, metavar="LIST",
                        help=f"relay bandwidth caps for --compression (default {LINK_CAPS})")
    parser.add_argument("--decode", action="store_true",
                        help="also measure decode tok/s of --model on 2 peers, tail direct vs relayed")
    parser.add_argument("--model", default="bench", metavar="NAME|DIR", help="model for --decode (default bench)")
    parser.add_argument("--new-tokens", type=int, default=64, metavar="N",
                        help="tokens per decode run for --decode (default 64)")
    parser.add_argument("--runs", type=int, default=3, metavar="N",
                        help="decode runs per link for --decode (default 3)")
    parser.add_argument("--workdir", metavar="DIR", help="keep logs here (default: a temporary directory)")
    parser.add_argument("--out", default="bench-out/bench-relay.json", metavar="FILE", help="JSON report")
