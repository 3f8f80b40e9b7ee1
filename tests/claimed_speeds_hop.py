"""``meshd`` whose card claims the speeds given among ``run``'s arguments, instead of the ones it
measured: ``python -m tests.claimed_speeds_hop run ... [--decode-tok-s X] [--prefill-tok-s Y] [--corrupt-kv]``.
A test steers the entry's choice of routes and prefill workers with it; ``--corrupt-kv`` flips a byte of
every prefix chunk it hands to an importing hop (which must refuse it)."""

from __future__ import annotations

import argparse
import sys

import meshd.runtime.served_model as served_model
from meshd.cli.meshd_main import main
from meshd.wire import card_pb2 as cpb
from meshd.wire import kv_tier_pb2 as kvpb


def _claiming(decode_tok_s: float | None, prefill_tok_s: float | None):
    measured = served_model.ServedModel.card_entry

    def card_entry(self: served_model.ServedModel) -> cpb.ModelServed:
        entry = measured(self)
        if decode_tok_s is not None:
            entry.decode_tok_s = decode_tok_s
        if prefill_tok_s is not None:
            entry.prefill_tok_s = prefill_tok_s
        return entry

    return card_entry


def _corrupting():
    honest = served_model.ServedModel.kept_chunk

    def kept_chunk(self: served_model.ServedModel, get: kvpb.KVGet, identity) -> kvpb.KVChunk | None:
        chunk = honest(self, get, identity)
        if chunk is not None and chunk.data:
            chunk.data = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]
        return chunk

    return kept_chunk


if __name__ == "__main__":  # only in the daemon this module runs as
    claims = argparse.ArgumentParser()
    claims.add_argument("--decode-tok-s", type=float)
    claims.add_argument("--prefill-tok-s", type=float)
    claims.add_argument("--corrupt-kv", action="store_true")
    ours, rest = claims.parse_known_args(sys.argv[1:])
    served_model.ServedModel.card_entry = _claiming(ours.decode_tok_s, ours.prefill_tok_s)  # type: ignore[method-assign]
    if ours.corrupt_kv:
        served_model.ServedModel.kept_chunk = _corrupting()  # type: ignore[method-assign]
    main(rest)
