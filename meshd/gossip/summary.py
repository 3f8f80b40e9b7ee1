"""Bucket summaries of a membership digest, so that anti-entropy costs what differs, not what is held.

Every member's digest entry ``(peer_id, sequence, state)`` falls in one of ``count`` buckets by a
hash of its peer id; a bucket's summary is the XOR of its entries' 64-bit hashes (0 for an empty
bucket). Two peers whose views agree have equal summaries, so a push-pull carries ``8 x count``
bytes plus the entries of the buckets that differ, whatever the size of the mesh. The bucket count
is a power of two that grows with the mesh up to :data:`MAX_BUCKETS`, which keeps a bucket to a few
entries in a mesh of a thousand peers and the summary to 1 KiB.

An exchange repairs at most :data:`MAX_REPAIRED` of the buckets that differ where both sides hold
entries, chosen at random, so that a mesh with much news in flight (a lossy network's suspicions
and refutations) does not pay for all of it twice, by piggyback and by push-pull; buckets the
asker holds nothing in (a newcomer's) are all sent, once.

The summary is not a security boundary: a peer can only make its own view look different, which
costs it an exchange, and a bucket whose hashes collide by chance is repaired by the next change in
it or by piggybacked gossip.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

from google.protobuf.message import Message

MAX_BUCKETS = 128
MEMBERS_PER_BUCKET = 8
MAX_REPAIRED = 16  # differing buckets one push-pull repairs where both sides hold entries
_HASH = struct.Struct("<Q")


def bucket_count_for(members: int) -> int:
    """A power of two near ``members / MEMBERS_PER_BUCKET``, between 1 and :data:`MAX_BUCKETS`."""
    count = 1
    while count < MAX_BUCKETS and count * MEMBERS_PER_BUCKET < members:
        count *= 2
    return count


def valid_count(count: int) -> bool:
    return 1 <= count <= MAX_BUCKETS and count & (count - 1) == 0


class SummaryCache:
    """Entry hashes and bucket positions, kept per peer id: a summary is built on every push-pull."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[int, int, int]] = {}  # peer -> (sequence, state, hash)
        self._positions: dict[str, int] = {}  # peer -> 32-bit hash of its id

    def position(self, peer_id: str, count: int) -> int:
        pos = self._positions.get(peer_id)
        if pos is None:
            pos = int.from_bytes(hashlib.blake2b(peer_id.encode(), digest_size=4).digest(), "little")
            self._positions[peer_id] = pos
        return pos & (count - 1)

    def entry_hash(self, peer_id: str, sequence: int, state: int) -> int:
        held = self._entries.get(peer_id)
        if held is not None and held[0] == sequence and held[1] == state:
            return held[2]
        raw = f"{peer_id}\0{sequence}\0{state}".encode()
        value: int = _HASH.unpack(hashlib.blake2b(raw, digest_size=8).digest())[0]
        self._entries[peer_id] = (sequence, state, value)
        return value

    def forget(self, keep: Iterable[str]) -> None:
        """Drop what is cached for peers no longer held (the cache must not outgrow the digest)."""
        kept = set(keep)
        for table in (self._entries, self._positions):
            for peer_id in [p for p in table if p not in kept]:
                del table[peer_id]

    def summarize(self, entries: Iterable[tuple[str, int, int]], count: int) -> list[int]:
        buckets = [0] * count
        for peer_id, sequence, state in entries:
            buckets[self.position(peer_id, count)] ^= self.entry_hash(peer_id, sequence, state)
        return buckets


def encode(buckets: list[int]) -> bytes:
    return b"".join(_HASH.pack(b) for b in buckets)


def decode(raw: bytes) -> list[int] | None:
    """The bucket hashes of a received summary; None when it is not a valid one."""
    if len(raw) % _HASH.size or not valid_count(len(raw) // _HASH.size):
        return None
    return [v for (v,) in _HASH.iter_unpack(raw)]


def hash_of(records: Sequence[Message]) -> int:
    """One 64-bit hash of a list of messages (revocations, accusations), 0 for none."""
    if not records:
        return 0
    h = hashlib.blake2b(digest_size=8)
    for record in records:
        raw = record.SerializeToString()
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    value: int = _HASH.unpack(h.digest())[0]
    return value


def differing(ours: list[int], theirs: list[int]) -> set[int]:
    return {i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b}


__all__ = ["MAX_BUCKETS", "SummaryCache", "bucket_count_for", "decode", "differing", "encode", "hash_of", "valid_count"]
