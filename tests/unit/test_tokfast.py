"""The word-cache encoder gives exactly the tokenizer's own ids, on any text."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.data.tokens import word_cache as _tokfast
from unbroken.data.tokens.tokenizer import train_bpe
from unbroken.data.tokens.word_cache import WordCacheEncoder

_TRAIN = [
    "The quick brown fox doesn't jump; it's 42 times lazier than you'd think!",
    "Numbers 123 4567 89, punctuation ?!... and   spaces\tand\ttabs\nnew lines.",
    "I'm sure they've said we'll see, she'd be there. 'Quoted' words...",
    "it's he's that's what's, don't can't won't ; wait ... what ?! ( yes ) 's 't",
    "café naïve déjà vu über 日本語 ｶﾀｶﾅ x\u3000 y\u3000\u3000z a\u00a0 b\u00a0\u00a0c é é é p\u3000  q r\u00a0  s",
] * 30

_CASES = [
    "",
    " ",
    "   ",
    "\n",
    "hello world",
    " leading space",
    "trailing space ",
    "trailing spaces   ",
    "a   b    c",
    "a \nb",
    "a\t\t\n  \nb",
    "  \n  x",
    "don't it's they're we've I'm you'll he'd",
    "'s's't 're",
    "DON'T IT'S",  # upper-case contractions are not in the pattern
    "12345 6 7.5 1,000,000",
    "a1b2c3 x9",
    "!!! ?!. ... --- (parens) [brackets] {braces}",
    "mixed,punct.and words!",
    "ctl\x0bvt\x0cff\rcr",
    "ctl\x1cfs\x1fus",  # not whitespace for the library: left to the tokenizer
    "del\x7f char",
    "naïve café",
    "日本語のテキスト and English",
    "emoji 😀😀 here",
    "nbsp\u00a0between",
    "ideographic\u3000space",
    "an <|endoftext|> inside",
    "<|endoftext|>",
    "a\u00a0 b",
    "x \u3000 y  z",
    "x\u3000  z a\u00a0  b",
    "end é",
    "é start",
    "mid é word and more words",
    "dé jà vu, it's 'ça' 12é3 !é?",
    "a.\u00a0b c\u2028 d\x85 e",
    "spaces   é   after",
    "e\u0301 combining",
    "tab\té\tnewline\né\n",
    "word" * 200,
    "x " * 300,
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> object:
    path = os.path.join(tmp_path_factory.mktemp("tok"), "tokenizer.json")
    return train_bpe(_TRAIN, 600, path)


def _check(enc: WordCacheEncoder, tok: object, texts: list[str]) -> None:
    ids, lens = enc.encode(texts)
    assert ids.dtype == np.uint32
    assert lens.tolist() == [len(tok.encode(t, add_special_tokens=False).ids) for t in texts]  # type: ignore[attr-defined]
    ends = np.cumsum(lens)
    for t, a, b in zip(texts, ends - lens, ends, strict=True):
        assert ids[a:b].tolist() == tok.encode(t, add_special_tokens=False).ids, repr(t)  # type: ignore[attr-defined]


def test_fast_path_applies_to_byte_level_bpe_and_matches_encode(tok: object) -> None:
    enc = WordCacheEncoder(tok)
    assert enc.fast
    _check(enc, tok, _CASES)
    _check(enc, tok, list(reversed(_CASES)))  # second pass: every word from the cache


def test_other_configurations_fall_back_and_stay_identical(tok: object) -> None:
    from tokenizers import Tokenizer, normalizers, pre_tokenizers

    other = Tokenizer.from_str(tok.to_str())  # type: ignore[attr-defined]
    other.normalizer = normalizers.NFKC()
    enc = WordCacheEncoder(other)
    assert not enc.fast
    _check(enc, other, _CASES)
    prefixed = Tokenizer.from_str(tok.to_str())  # type: ignore[attr-defined]
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not WordCacheEncoder(prefixed).fast


def test_cache_starts_over_when_full(tok: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_tokfast, "_MAX_WORDS", 8)
    enc = WordCacheEncoder(tok)
    _check(enc, tok, _CASES)
    _check(enc, tok, _CASES[::-1])


_ASCII = "abcXYZsdtlmrve019 '\t\n\x0b\r.,!?-_()\""
_OTHER = "éü日😀\u00a0\x1c\x85\u2028\u3000\u180e\u200b\u0301"
_TEXT = st.one_of(
    st.text(alphabet=_ASCII, max_size=40),
    st.text(alphabet=_ASCII + _OTHER, max_size=40),
    st.text(alphabet=_ASCII * 4 + _OTHER, max_size=80),  # mostly ASCII, some other
)


@pytest.mark.slow  # issue 24 item 10: out of `make unit`, still in `make test`
@settings(max_examples=300, deadline=None)
@given(st.lists(_TEXT, min_size=1, max_size=6))
def test_random_text_matches_encode(tok: object, texts: list[str]) -> None:
    _check(WordCacheEncoder(tok), tok, texts)
