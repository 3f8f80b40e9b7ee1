"""Deterministic byte-level BPE tokenizers for the built-in models, built without downloads.

The vocabulary is the 256 byte symbols of GPT-2-style byte-level BPE, a handful of special tokens,
and, for larger vocabularies, merges generated in a fixed order (character bigrams, then trigrams,
then four-grams over a fixed alphabet). The result is an ordinary ``tokenizers`` BPE model that
``transformers.AutoTokenizer`` loads like any other. Models trained on the machine learn their merges
from their training text instead (:func:`train_tokenizer`), with the same byte symbols, special tokens
and pre-tokenizer, so the chat template and the stop tokens work alike.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|pad|>")
BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _byte_symbols() -> list[str]:
    """The byte-to-unicode table of byte-level BPE, in byte order."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table: dict[int, str] = {b: chr(b) for b in visible}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _merges(count: int, byte_symbols: list[str]) -> list[tuple[str, str]]:
    if count <= 0:
        return []
    space = byte_symbols[ord(" ")]
    lower = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    printable = [byte_symbols[b] for b in range(32, 127)]
    merges: list[tuple[str, str]] = []
    merges += list(itertools.product(printable, printable))
    words = [space, *lower]
    merges += [(a + b, c) for a, b, c in itertools.product(words, words, words)]
    merges += [(a + b + c, d) for a, b, c, d in itertools.product(lower, lower, lower, lower)]
    if count > len(merges):
        raise ValueError(f"cannot build {count} merges (at most {len(merges)})")
    return merges[:count]


@dataclass(frozen=True)
class TokenizerLayout:
    """Where a family keeps its special tokens and template, so that written models look like its own."""

    specials: tuple[tuple[str, int], ...]  # (token, id)
    bos: str
    eos: str
    pad: str
    chat_template: str
    template_file: bool = False         # in chat_template.jinja rather than in tokenizer_config.json
    stop_tokens: tuple[str, ...] = ()   # generation_config.json's eos_token_id list (default: eos alone)


BUILTIN_LAYOUT = TokenizerLayout(specials=tuple((t, i) for i, t in enumerate(SPECIAL_TOKENS)), bos=BOS, eos=EOS,
                                 pad=PAD, chat_template=CHAT_TEMPLATE)


def build_tokenizer(vocab_size: int, layout: TokenizerLayout = BUILTIN_LAYOUT) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids, its special tokens at their ids."""
    byte_symbols = _byte_symbols()
    n_merges = vocab_size - len(byte_symbols) - len(layout.specials)
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} is below the {len(byte_symbols) + len(layout.specials)} base ids")
    taken = {i for _, i in layout.specials}
    if len(taken) != len(layout.specials) or not all(0 <= i < vocab_size for i in taken):
        raise ValueError("special token ids must be distinct and inside the vocabulary")
    free = (i for i in range(vocab_size) if i not in taken)
    vocab: dict[str, int] = dict(layout.specials)
    for symbol in byte_symbols:
        vocab[symbol] = next(free)
    merges = _merges(n_merges, byte_symbols)
    for a, b in merges:
        vocab[a + b] = next(free)
    tok = _byte_level(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.add_special_tokens(_specials_in_id_order(layout))
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    return tok


def train_tokenizer(texts: Sequence[str], vocab_size: int, layout: TokenizerLayout = BUILTIN_LAYOUT) -> Tokenizer:
    """A byte-level BPE tokenizer whose merges are learnt from ``texts``: the special tokens first (ids
    0..n-1, so the layout must number them so), the 256 byte symbols, then merges up to ``vocab_size``.

    The trainer is deterministic for byte-level BPE: its alphabet is sorted and equal pair counts are
    broken by pair ids, which follow from that order; the same texts give the same file."""
    specials = _specials_in_id_order(layout)
    if [i for _, i in sorted(layout.specials, key=lambda s: s[1])] != list(range(len(specials))):
        raise ValueError("a trained tokenizer keeps its special tokens at ids 0..n-1")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok = _byte_level(models.BPE(fuse_unk=False))
    tok.train_from_iterator(list(texts), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the text yields {tok.get_vocab_size()} ids, not {vocab_size}: too little text")
    return tok


def _byte_level(model: models.Model) -> Tokenizer:
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _specials_in_id_order(layout: TokenizerLayout) -> list[str]:
    return [t for t, _ in sorted(layout.specials, key=lambda s: s[1])]


def write_tokenizer(out_dir: Path, vocab_size: int, max_length: int, layout: TokenizerLayout = BUILTIN_LAYOUT,
                    tokenizer: Tokenizer | None = None) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json``, with the chat template in it or beside it.

    ``tokenizer`` is one built elsewhere (a trained one) with ``vocab_size`` ids and the layout's special
    tokens at their ids; by default the generated one of :func:`build_tokenizer`."""
    tok = tokenizer or build_tokenizer(vocab_size, layout)
    if tok.get_vocab_size() != vocab_size or any(tok.token_to_id(t) != i for t, i in layout.specials):
        raise ValueError(f"the tokenizer must have {vocab_size} ids and the layout's special tokens at their ids")
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=False), encoding="utf-8")
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": layout.bos,
        "eos_token": layout.eos,
        "pad_token": layout.pad,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    if layout.template_file:
        (out_dir / "chat_template.jinja").write_text(layout.chat_template)
    else:
        config["chat_template"] = layout.chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
