"""Drafts for speculative decoding, and how many tokens a step should draft.

Every decode step crosses the whole route, so over real links a token costs the route's round trip
whatever the peers compute. The entry therefore guesses the next tokens and sends them along with
the one it knows; the route computes all of them in one traversal and the tail keeps those that
equal what it samples (:mod:`meshd.runtime.shard`). Sampling is seeded by position, so the reply is
the one plain decoding gives, and a good guess saves a traversal per token guessed right.

Two sources guess: :class:`NgramDrafter` looks the context's last tokens up earlier in the prompt and
reply (free, and right whenever text repeats), :class:`ModelDrafter` runs a small model with the same
tokenizer on the entry; :class:`LookupThenModel` asks the lookup first and the model for the rest.
:class:`DraftLength` picks how many to guess from what it measured: how often the tail accepts a
guess at each position and what a step costs per extra position.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from meshd.wire.limits import MAX_DRAFT_TOKENS

NGRAM_MAX = 4  # longest context suffix looked up
LOOKUP_THEN_MODEL_MIN_N = 3  # with a draft model, lookup guesses only from a match of this many tokens
DECAY = 0.9    # weight of older steps in the measured acceptance and step costs
PRIOR_PER_POSITION = 0.1  # an extra position's cost, as a share of a one-position step, until measured
PRIOR_ACCEPTANCE = 0.6  # a first guess is taken to be right this often until measured
EXPLORE_EVERY = 8  # every this many steps, two guesses more than the best measured so far


class Drafter(Protocol):
    """Guesses how one session's text goes on; one per session (it may keep state about it)."""

    source: str   # "ngram" or "model", for statistics
    inline: bool  # cheap enough to run on the event loop

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``context`` (fewer, or none, when it has no guess)."""
        ...


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last
    ``n`` tokens (the longest ``n`` up to :data:`NGRAM_MAX` that occurred before, and at least
    ``min_n``), guessed one at a time so that a loop in the text is followed around."""

    source = "ngram"
    inline = True

    def __init__(self, max_n: int = NGRAM_MAX, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> the position just after its latest occurrence
        self._indexed: list[int] = []  # the context indexed so far

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        self._index(context)
        tokens = list(context)
        out: list[int] = []
        while len(out) < k:
            nxt = self._follow(tokens)
            if nxt is None:
                break
            out.append(nxt)
            tokens.append(nxt)
        return out

    def _follow(self, tokens: list[int]) -> int | None:
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            at = self._after.get(tuple(tokens[-n:]))
            if at is not None and at < len(self._indexed):
                return self._indexed[at]
        return None

    def _index(self, context: Sequence[int]) -> None:
        """Index the n-grams of ``context`` that end before its last token (the last is what is looked up)."""
        if list(context[: len(self._indexed)]) != self._indexed:  # another context: start over
            self._after.clear()
            self._indexed = []
        start = len(self._indexed)
        self._indexed.extend(int(t) for t in context[start:])
        for end in range(max(1, start), len(self._indexed)):
            for n in range(1, min(self.max_n, end) + 1):
                self._after[tuple(self._indexed[end - n : end])] = end


class DraftModel:
    """A small causal LM on the entry that drafts for models with the same tokenizer.

    Loaded once per peer; each session gets a :class:`ModelDrafter` with its own KV cache. Forwards
    run one at a time (a lock), in whatever thread asks: drafting is never done on the event loop.
    """

    def __init__(self, directory: Path, threads: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.directory = Path(directory)
        if not (self.directory / "config.json").is_file():
            raise ValueError(f"{self.directory} is not a model directory (no config.json)")
        self.model = AutoModelForCausalLM.from_pretrained(self.directory, dtype=torch.float32).eval()
        self.vocab = vocab_fingerprint(AutoTokenizer.from_pretrained(self.directory))
        self.threads = threads
        self.lock = threading.Lock()

    def matches(self, tokenizer: Any) -> bool:
        """Whether ``tokenizer`` (the served model's) is the draft model's own: ids mean the same tokens."""
        return vocab_fingerprint(tokenizer) == self.vocab

    def session(self) -> ModelDrafter:
        return ModelDrafter(self)


_FINGERPRINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def vocab_fingerprint(tokenizer: Any) -> str:
    """A hash of a tokenizer's vocabulary and special tokens: equal when token ids mean the same text.
    Kept per tokenizer object while it lives (hashing a vocabulary per request would cost milliseconds)."""
    known = _FINGERPRINTS.get(tokenizer)
    if known is None:
        vocab = sorted(tokenizer.get_vocab().items())
        specials = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
        known = _FINGERPRINTS[tokenizer] = hashlib.sha256(json.dumps([vocab, specials]).encode()).hexdigest()
    return known


class ModelDrafter:
    """Greedy guesses of the draft model for one session; its KV cache follows the session's context
    (cut back to the part of the context that is unchanged, then extended)."""

    source = "model"
    inline = False

    def __init__(self, model: DraftModel) -> None:
        self.model = model
        self._cache: Any = None
        self._cached: list[int] = []  # the tokens the cache holds

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        import torch
        from transformers import DynamicCache

        if k < 1 or not context:
            return []
        context = [int(t) for t in context]
        with self.model.lock, torch.inference_mode():
            same = 0
            limit = min(len(self._cached), len(context) - 1)  # the last token is always fed again
            while same < limit and self._cached[same] == context[same]:
                same += 1
            if self._cache is None or same == 0:
                self._cache, same = DynamicCache(), 0
            else:
                self._cache.crop(same - self._cache.get_seq_length())  # how many to drop, as a negative count
            self._cached = context[:same]
            feed = context[same:]
            out: list[int] = []
            for _ in range(k):
                ids = torch.tensor([feed], dtype=torch.long)
                logits = self.model.model(input_ids=ids, cache=self._cache, use_cache=True).logits
                self._cached.extend(feed)
                token = int(torch.argmax(logits[0, -1]).item())
                out.append(token)
                feed = [token]
            return out


class LookupThenModel:
    """N-gram lookup first, the draft model for the rest: a phrase repeated from its last
    :data:`LOOKUP_THEN_MODEL_MIN_N` tokens on is guessed for free and as far as it goes; elsewhere the
    model guesses (a shorter match is a weaker guess than the model's)."""

    source = "ngram+model"
    inline = False

    def __init__(self, model: DraftModel) -> None:
        self.lookup = NgramDrafter(min_n=LOOKUP_THEN_MODEL_MIN_N)
        self.model = ModelDrafter(model)

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        guesses = self.lookup.draft(context, k)
        if len(guesses) < k:
            guesses += self.model.draft([*context, *guesses], k - len(guesses))
        return guesses


@dataclass
class DraftStats:
    """What one source drafted and the tails accepted, over the sessions of this peer."""

    steps: int = 0      # steps that carried drafted tokens
    drafted: int = 0
    accepted: int = 0

    def summary(self) -> dict[str, float | int]:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": round(rate, 4)}


@dataclass
class DraftLength:
    """How many tokens the next step of one session should draft.

    The tail accepts a step's guesses up to the first wrong one. What a step of ``k`` guesses yields
    is measured per guess position: ``c[j]``, the share of steps whose ``j``-th guess was right
    among those whose guesses before it were (decayed counts over this session's steps; a position
    seldom reached is taken to be like the one before it), so a step yields
    ``1 + sum over j <= k of c[1] * ... * c[j]`` tokens. Guesses are often right in runs (a
    repeated phrase) or wrong from the start, which a single acceptance rate would misjudge. A step
    costs its round trip, its drafting, and per extra position what the hops compute for it (fitted
    to the measured step times by the number of positions). The chosen ``k`` maximises tokens per
    second; every few steps two more are tried, so that later positions and the cost of extra ones
    get measured, and when none pay, one guess is still tried now and then, so that a change in the
    text is noticed.
    """

    max_draft: int = 8
    _hits: list[float] = field(default_factory=lambda: [0.0] * MAX_DRAFT_TOKENS)
    _tries: list[float] = field(default_factory=lambda: [0.0] * MAX_DRAFT_TOKENS)
    _fit: list[float] = field(default_factory=lambda: [0.0] * 5)  # decayed n, Σx, Σy, Σx², Σxy
    _steps: int = 0
    _idle_steps: int = 0

    @property
    def acceptance(self) -> float:
        """The measured share of first guesses that were right."""
        return self._rates()[0]

    def _rates(self) -> list[float]:
        """Each position's share of right guesses; a position seldom reached leans on the one before
        it (and the first on :data:`PRIOR_ACCEPTANCE`), weighing as one step."""
        rates, prior = [], PRIOR_ACCEPTANCE
        for hits, tries in zip(self._hits, self._tries, strict=True):
            prior = (hits + prior) / (tries + 1.0)
            rates.append(prior)
        return rates

    def record(self, drafted: int, accepted: int, positions: int, seconds: float) -> None:
        """A step with ``drafted`` guesses, ``accepted`` of them right, took ``seconds`` for ``positions``."""
        if drafted:
            for j in range(min(drafted, accepted + 1)):  # guesses checked: every one up to the first wrong
                self._tries[j] = DECAY * self._tries[j] + 1.0
                self._hits[j] = DECAY * self._hits[j] + (1.0 if j < accepted else 0.0)
        n, sx, sy, sxx, sxy = (DECAY * v for v in self._fit)
        x = float(positions - 1)
        self._fit = [n + 1, sx + x, sy + seconds, sxx + x * x, sxy + x * seconds]

    def expected_tokens(self, k: int) -> float:
        """Tokens a step of ``k`` guesses yields, by the measured acceptance per position."""
        total, reach = 1.0, 1.0
        for rate in self._rates()[: min(k, MAX_DRAFT_TOKENS)]:
            reach *= rate
            total += reach
        return total

    def costs(self) -> tuple[float, float] | None:
        """(seconds of a step of one position, seconds per extra position), once a step was timed."""
        n, sx, sy, sxx, sxy = self._fit
        if n <= 0:
            return None
        mean_x, mean_y = sx / n, sy / n
        var = sxx / n - mean_x * mean_x
        if var > 0.25:  # several lengths seen: fit the line
            per = max(0.0, (sxy / n - mean_x * mean_y) / var)
            return max(1e-6, mean_y - per * mean_x), per
        base = mean_y / (1.0 + PRIOR_PER_POSITION * mean_x)  # one length only: assume the prior share per position
        return max(1e-6, base), PRIOR_PER_POSITION * base

    def choose(self, limit: int) -> int:
        """Guesses for the next step, at most ``limit``."""
        limit = max(0, min(limit, self.max_draft, MAX_DRAFT_TOKENS))
        costs = self.costs()
        if limit == 0:
            return 0
        self._steps += 1
        if costs is None:
            return min(limit, 4)
        base, per = costs
        best, best_rate = 0, 1.0 / base
        for k in range(1, limit + 1):
            rate = self.expected_tokens(k) / (base + per * k)
            if rate > best_rate * 1.02:
                best, best_rate = k, rate
        if best and self._steps % EXPLORE_EVERY == 0:  # now and then a longer step: what later guesses
            return min(limit, best + 2)               # and extra positions are worth is measured too
        if best == 0:
            self._idle_steps += 1
            if self._idle_steps >= 16:
                self._idle_steps = 0
                return 1
        else:
            self._idle_steps = 0
        return best
