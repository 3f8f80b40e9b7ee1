"""Keep the garbage collector's full passes short in a daemon.

A peer's heap holds a few hundred thousand objects that live as long as it does: the modules of torch,
transformers and the rest of the daemon, and a loaded shard's. CPython's full collection visits every
one of them; in a bench peer under load one took about 0.2 s, and while it runs neither the event
loop nor the compute thread moves (docs/benchmarks.md, "Where a loaded mesh's time goes"). So a daemon
collects once when it starts and once after a shard is loaded, and freezes what survives
(:func:`gc.freeze`): later full passes visit only what was allocated since. Unloading thaws the
frozen objects again, so that what the old shard leaves in reference cycles is collected rather than
kept for good.

Only a process that calls :func:`manage_heap` (``meshd run``) does this; tests that load shards in
their own process keep the collector as it is.
"""

from __future__ import annotations

import gc

_managed = False


def manage_heap() -> None:
    """From now on, loads and unloads in this process settle the heap; settle it now too."""
    global _managed
    _managed = True
    settle()


def settle() -> None:
    """Collect everything, the frozen objects included, and freeze what survives."""
    if not _managed:
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Make the frozen objects collectable again (a shard is being dropped)."""
    if _managed:
        gc.unfreeze()
