"""Streaming a reply's text token by token gives what decoding the whole reply gives, at a cost per
token that does not grow with the reply."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from meshd.models.text import TextCodec
from meshd.session.detokenize import IncrementalDetokenizer

TEXT = ("The quick brown fox jumps over the lazy dog. Naïve café, 😀 and 日本語 too! "
        "Streams of tokens become words, words become sentences, sentences become replies.\n")


@pytest.fixture(scope="module")
def sentencepiece_style() -> PreTrainedTokenizerFast:
    """A tokenizer shaped like Llama 2's: word starts marked with U+2581 and a space in front of the
    text, byte tokens for characters outside its vocabulary, and the decoder dropping the first space.
    A token's text then depends on the token before it."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    chars = sorted({c for c in TEXT.replace(" ", "\u2581") if ord(c) < 0x2000} | {"\u2581"})
    merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("o", "r"), ("w", "or"), ("wor", "d"), ("\u2581", "word")]
    pieces = specials + byte_tokens + chars + ["".join(m) for m in merges]
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture
def tokenizers(tiny_model, sentencepiece_style):
    return {"byte-level BPE": TextCodec.load(tiny_model).tokenizer, "SentencePiece-style": sentencepiece_style}


def _streamed(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces, "".join(pieces)


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece-style"])
def test_the_streamed_text_is_the_whole_decoding(tokenizers, kind):
    tokenizer = tokenizers[kind]
    ids = tokenizer.encode(TEXT * 3, add_special_tokens=False)
    pieces, text = _streamed(tokenizer, ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert "café, 😀 and 日本語" in text
    assert not any("\ufffd" in p for p in pieces)
    assert " " in "".join(pieces[1:40])  # the word starts' spaces come out with the words after the first


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece-style"])
def test_arbitrary_token_sequences_stream_as_they_decode(tokenizers, kind):
    """Any ids at all: special tokens among them, words started anywhere, and for byte-level BPE bytes
    that never make a character. (A SentencePiece-style byte run that breaks changes letters already
    streamed; the next test covers that.)"""
    tokenizer = tokenizers[kind]
    ids_from = range(len(tokenizer))
    if kind == "SentencePiece-style":
        ids_from = [i for i in ids_from if not tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice(ids_from) for _ in range(rng.randrange(1, 60))]
        assert _streamed(tokenizer, ids)[1] == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_a_broken_byte_run_does_not_end_the_stream(sentencepiece_style):
    """Byte tokens that are not UTF-8 turn every byte of their run into U+FFFD, the letter streamed
    before them too; what was streamed stays, and the words after them stream."""
    tok = sentencepiece_style
    ids = [*tok.encode("the word", add_special_tokens=False), *tok.convert_tokens_to_ids(["<0x6C>", "<0xFF>"]),
           *tok.encode(" and the rest", add_special_tokens=False)]
    whole = tok.decode(ids, skip_special_tokens=True)
    _, text = _streamed(tok, ids)
    assert whole.startswith("the word\ufffd") and whole.endswith(" and the rest")  # the "l" changed
    assert text.startswith("the wordl") and text.endswith(" and the rest") and len(text) == len(whole)


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece-style"])
def test_special_tokens_in_the_middle_keep_the_space_before_the_next_word(tokenizers, kind):
    tokenizer = tokenizers[kind]
    words = tokenizer.encode("hello there friend", add_special_tokens=False)
    ids = [*words[:2], tokenizer.eos_token_id, tokenizer.eos_token_id, *words[2:]]
    assert _streamed(tokenizer, ids)[1] == "hello there friend"


class _Counting:
    """A tokenizer that records how many ids each decode was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece-style"])
def test_each_token_decodes_a_few_tokens_however_long_the_reply(tokenizers, kind):
    counting = _Counting(tokenizers[kind])
    ids = tokenizers[kind].encode(TEXT * 80, add_special_tokens=False)
    assert len(ids) > 1500
    _, text = _streamed(counting, ids)
    assert text == tokenizers[kind].decode(ids, skip_special_tokens=True)
    # a window is the last increment's tokens and the new one: longer only while tokens that split
    # characters between them (an emoji's bytes, say) wait for the character to end
    assert max(counting.lengths) <= 8
    assert sorted(counting.lengths)[len(counting.lengths) // 2] <= 2
