"""``meshd`` whose shard computes wrong: every hidden state it receives is reversed along the hidden
dimension before its layers run (a head shard, which receives token ids, is left alone). Run as
``python -m`` with ``meshd run``'s arguments, by the tests that check audits catch such a peer."""

from __future__ import annotations

from meshd.cli.meshd_main import main
from meshd.runtime.shard import Shard

_honest = Shard._input


def _corrupt(self, bundle):  # type: ignore[no-untyped-def]
    x = _honest(self, bundle)
    return x if self.spec.is_head else x.flip(-1)


Shard._input = _corrupt  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
