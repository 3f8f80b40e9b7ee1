"""``meshd`` whose card claims its range decodes ten million tokens a second, whatever it measured.
Run as ``python -m`` with ``meshd run``'s arguments, by the tests that check speed claims are timed."""

from __future__ import annotations

import meshd.runtime.served_model as served_model
from meshd.cli.meshd_main import main

BOAST_TOK_S = 1e7

served_model.measure_decode_tok_s = lambda shard: BOAST_TOK_S  # type: ignore[assignment]

if __name__ == "__main__":
    main()
