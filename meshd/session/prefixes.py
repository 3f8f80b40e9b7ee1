"""The entry's side of prefix KV: where a prompt's prefill is cut, what the prefixes are called,
which to keep, and which route's hops were asked to keep them.

A prompt is prefilled in chunks that end at fixed places: the end of every chat message (as the
model's template renders it) and every multiple of the chunk size. Two prompts that share their
first tokens up to such a place are therefore prefilled by the same chunks up to there, so the KV a
hop kept after that chunk is exactly what a new session would compute (:mod:`meshd.runtime.prefix_kv`).
A prefix's name is a keyed hash (HMAC-SHA256 under this entry's secret and the model's compat key) of
its tokens and of where they were cut: it reveals nothing of the text to hops, and names of one
entry never match another's.

Hops keep the KV after the first message (a system prompt that many requests share) and after the
last one (what the conversation's next turn starts with); a prompt without messages keeps its last
whole chunk. :class:`PrefixMap` remembers which route was asked to keep what, so the entry can route
the next turn to those hops and ask them (:mod:`meshd.session.entry`) which they still hold.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshd.identity.private_files import PrivateFileError, load_or_create_private

MIN_PREFIX_TOKENS = 64  # shorter prefixes are not worth a snapshot: they prefill in about one decode step
MAX_REMEMBERED = 4096   # prefixes the entry remembers the holders of
NAME_BYTES = 32
KEY_FILE = "prefix.key"

Holders = tuple[tuple[str, int, int], ...]  # (peer id, start, end) of each hop that was asked to keep a prefix


@dataclass(frozen=True)
class PromptPrefixes:
    """A prompt's prefill cuts (chunk ends inside it), each cut's prefix name, and the cuts to keep."""

    length: int
    chunk_tokens: int
    names: dict[int, bytes]   # cut position -> name of the prefix that ends there
    keep: frozenset[int]

    @property
    def cuts(self) -> list[int]:
        return sorted(self.names)

    def spans(self, start: int, end: int) -> list[tuple[int, int]]:
        """The prefill chunks of positions ``[start, end)``: split at every cut and every multiple of
        the chunk size (past the prompt too: a repaired route re-prefills the reply after it)."""
        return chunk_spans(start, end, self.cuts, self.chunk_tokens)


def chunk_spans(start: int, end: int, cuts: Iterable[int], chunk_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` split at ``cuts`` and at every multiple of ``chunk_tokens``."""
    if chunk_tokens < 1:
        raise ValueError("chunks hold at least one token")
    points = {p for p in cuts if start < p < end}
    points.update(range((start // chunk_tokens + 1) * chunk_tokens, end, chunk_tokens))
    edges = [start, *sorted(points), end]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


def plan_prefixes(tokens: Sequence[int], boundaries: Sequence[int], chunk_tokens: int, key: bytes,
                  *, messages: bool) -> PromptPrefixes:
    """The cuts of ``tokens`` (message ends ``boundaries``, multiples of ``chunk_tokens``) and their names
    under ``key``; ``messages``: whether the prompt is a chat (keeps its first and last message ends)."""
    n = len(tokens)
    ends = sorted({b for b in boundaries if 0 < b < n})
    cuts = sorted({*ends, *range(chunk_tokens, n, chunk_tokens)})
    running = hmac.new(key, chunk_tokens.to_bytes(4, "big"), hashlib.sha256)
    names: dict[int, bytes] = {}
    ids = np.asarray(tokens, dtype="<i8")
    previous = 0
    for cut in cuts:
        running.update(cut.to_bytes(4, "big") + ids[previous:cut].tobytes())
        names[cut] = running.copy().digest()[:NAME_BYTES]
        previous = cut
    if messages:
        keep = {p for p in (ends[:1] + ends[-1:]) if p >= MIN_PREFIX_TOKENS}
    else:
        keep = {max(cuts)} if cuts and max(cuts) >= MIN_PREFIX_TOKENS else set()
    return PromptPrefixes(n, chunk_tokens, names, frozenset(keep))


def entry_key(secret: bytes, compat_key: str) -> bytes:
    """The key prefix names of one model are hashed under at this entry."""
    return hmac.new(secret, compat_key.encode(), hashlib.sha256).digest()


def load_secret(data_dir: Path | None) -> bytes:
    """This entry's prefix secret, kept in its data directory (owner-only) so that names survive a
    restart; a fresh one for each run when there is no data directory."""
    if data_dir is None:
        return secrets.token_bytes(32)
    path = Path(data_dir) / KEY_FILE
    raw, _created = load_or_create_private(path, lambda: secrets.token_bytes(32).hex().encode("ascii") + b"\n",
                                           "prefix key")
    try:
        secret = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != 32:
        raise PrivateFileError(f"prefix key {path} is not 64 hex characters (delete it to make a new one)")
    return secret


@dataclass(frozen=True)
class KnownPrefix:
    position: int
    name: bytes
    holders: Holders
    from_workers: bool = False  # computed by prefill workers for this prompt, not kept by an earlier route


class PrefixMap:
    """Which route's hops this entry asked to keep which prefix, the most recent first out of memory last."""

    def __init__(self, max_entries: int = MAX_REMEMBERED) -> None:
        self.max_entries = max_entries
        self._holders: OrderedDict[bytes, Holders] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def kept(self, names: Iterable[bytes], holders: Holders) -> None:
        for name in names:
            self._holders[name] = holders
            self._holders.move_to_end(name)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, name: bytes) -> None:
        self._holders.pop(name, None)

    def known(self, prefixes: PromptPrefixes) -> list[KnownPrefix]:
        """The prompt's prefixes (all but the whole prompt: one token at least is computed) whose holders
        this entry knows, longest first."""
        found = [KnownPrefix(p, name, self._holders[name]) for p, name in prefixes.names.items()
                 if p < prefixes.length and name in self._holders]
        return sorted(found, key=lambda k: -k.position)
