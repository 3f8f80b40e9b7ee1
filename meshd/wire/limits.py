"""Bounds a bundle's fields must keep, importable without torch (settings and request validation use them)."""

MAX_TOP_LOGPROBS = 20  # alternatives the tail reports per token
MAX_DRAFT_TOKENS = 15  # drafted tokens one decode step may verify (16 positions with its first)
MAX_PREFIX_NAME_BYTES = 64  # a kept prefix's name: the entry's keyed hash of it
