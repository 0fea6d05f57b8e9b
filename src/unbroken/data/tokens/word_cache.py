"""Exact word-level caching for byte-level BPE: encode each distinct pre-token once.

A GPT-2-style tokenizer (no normalizer, ``ByteLevel`` pre-tokenizer with its regex and no
prefix space, BPE without dropout) splits a text into pre-tokens with one regex and runs
BPE on each pre-token on its own, so the ids of a text are the concatenation of the ids of
its pre-tokens. :class:`WordCacheEncoder` splits with the same regex in Python, asks the
tokenizer once per distinct pre-token, and gathers ids with numpy. Most of the library's time
per call goes into its per-character alignment bookkeeping, so this is several times faster
on natural text, where a few thousand words make up most of the corpus.

Exactness is kept by construction, not by hope: the word cache is used only for tokenizers
whose configuration is exactly the one above, and the Python regex only on runs of printable
ASCII plus ``\\t\\n\\v\\f\\r``, where it and the library's Unicode regex classify every
character identically (``\\p{L}`` is ``[A-Za-z]``, ``\\p{N}`` is ``[0-9]``, ``\\s`` is
``[\\t-\\r ]``). A stretch around any other character, between two boundaries that hold under
both regexes (see :func:`_split_mixed`), is encoded whole by the tokenizer (and cached too);
documents containing an added token's text go to the tokenizer entirely. A pre-token
encoded alone gives the same pieces as in context because it is a whole match of the
leftmost-first regex (the only look-ahead, ``\\s+(?!\\S)``, also holds at the end of the
string).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from unbroken.data.tar.ragged import concat_ranges

__all__ = ["WordCacheEncoder", "encode_exact"]

# GPT-2's pattern with the Unicode classes spelt out for the ASCII subset we admit.
_SPLIT = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\t-\r A-Za-z0-9]+"
    r"|[\t-\r ]+(?![^\t-\r ])|[\t-\r ]+"
)
_OUTSIDE = re.compile(r"[^\t-\r -~]")  # any character the fast path does not admit
_BOUNDARY = re.compile(r"(?<=[!-~]) ")  # see _split_mixed
_MAX_WORDS = 1 << 20  # distinct pre-tokens kept; the cache starts over beyond (bounded memory)
_MAX_IDS = 1 << 24  # ids kept (64 MiB); long mixed stretches are cached too


def encode_exact(tok: Any, texts: list[str]) -> list[list[int]]:
    """The tokenizer's own ids for ``texts`` (no special tokens added)."""
    enc = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in enc(texts, add_special_tokens=False)]


def _fast_path_config(tok: Any) -> re.Pattern[str] | None:
    """For a tokenizer the fast path is exact for: a regex of its added tokens' texts
    (documents containing one go to the tokenizer); None when the fast path does not apply."""
    try:
        cfg = json.loads(tok.to_str())
    except (ValueError, TypeError, AttributeError):
        return None
    pre = cfg.get("pre_tokenizer") or {}
    model = cfg.get("model") or {}
    post = cfg.get("post_processor")
    ok = (
        cfg.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("add_prefix_space") is False
        and pre.get("use_regex", True) is True
        and model.get("type") == "BPE"
        and model.get("dropout") is None
        and (post is None or post.get("type") == "ByteLevel")
    )
    if not ok:
        return None
    added = sorted({a["content"] for a in cfg.get("added_tokens") or [] if a.get("content")})
    if not added:
        return re.compile(r"(?!)")  # matches nothing
    return re.compile("|".join(map(re.escape, added)))


class WordCacheEncoder:
    """Token ids for batches of documents, byte-identical to ``tok.encode(text).ids``."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self._added = _fast_path_config(tok)
        self._reset()

    @property
    def fast(self) -> bool:
        """Whether this tokenizer's configuration admits the word cache at all."""
        return self._added is not None

    def _reset(self) -> None:
        self._wid: dict[str, int] = {}
        self._start = np.zeros(1024, np.int64)  # per word: first id in _flat
        self._len = np.zeros(1024, np.int64)
        self._flat = np.zeros(8192, np.uint32)
        self._nflat = 0

    def _learn(self, words: list[str]) -> None:
        """Encode pre-tokens not seen yet, in one tokenizer call, and append them."""
        n0 = len(self._wid)
        ids = encode_exact(self._tok, words)
        lens = np.fromiter(map(len, ids), np.int64, len(ids))
        need = n0 + len(words)
        if need > self._start.size:
            grow = max(need, 2 * self._start.size)
            self._start = np.resize(self._start, grow)
            self._len = np.resize(self._len, grow)
        end = self._nflat + int(lens.sum())
        if end > self._flat.size:
            self._flat = np.resize(self._flat, max(end, 2 * self._flat.size))
        self._flat[self._nflat : end] = np.fromiter(
            itertools.chain.from_iterable(ids), np.uint32, end - self._nflat
        )
        self._start[n0:need] = self._nflat + np.cumsum(lens) - lens
        self._len[n0:need] = lens
        self._nflat = end
        self._wid.update(zip(words, range(n0, need), strict=True))

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, lens)``: the ids of all ``texts`` concatenated (uint32) and per-text lengths."""
        texts = list(texts)
        if self._added is None:
            return _pack_lists(encode_exact(self._tok, texts))
        joined = "\n".join(texts)  # one scan of the chunk; per document only on a hit
        slow: list[int] = []
        if self._added.search(joined) is not None:
            slow = [i for i, t in enumerate(texts) if self._added.search(t) is not None]
        fast_texts = texts
        if slow:
            skip = set(slow)
            fast_texts = [t for i, t in enumerate(texts) if i not in skip]
        if _OUTSIDE.search(joined) is None:
            words_per_doc = [_SPLIT.findall(t) for t in fast_texts]
        else:
            words_per_doc = [
                _SPLIT.findall(t) if _OUTSIDE.search(t) is None else _split_mixed(t)
                for t in fast_texts
            ]
        ids, lens = self._encode_words(words_per_doc)
        if not slow:
            return ids, lens
        # Merge the tokenizer's ids for the other documents back in input order.
        s_ids, s_lens = _pack_lists(encode_exact(self._tok, [texts[i] for i in slow]))
        all_lens = np.empty(len(texts), np.int64)
        is_slow = np.zeros(len(texts), bool)
        is_slow[slow] = True
        all_lens[is_slow] = s_lens
        all_lens[~is_slow] = lens
        out = np.empty(int(all_lens.sum()), np.uint32)
        ends = np.cumsum(all_lens)
        starts = ends - all_lens
        out[concat_ranges(starts[~is_slow], lens)] = ids
        out[concat_ranges(starts[is_slow], s_lens)] = s_ids
        return out, all_lens

    def _encode_words(self, words_per_doc: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
        words = list(itertools.chain.from_iterable(words_per_doc))
        new = set(words).difference(self._wid)
        if len(self._wid) + len(new) > _MAX_WORDS or self._nflat > _MAX_IDS:
            self._reset()
            new = set(words)
        if new:
            self._learn(sorted(new))
        wid = np.fromiter(map(self._wid.__getitem__, words), np.int64, len(words))
        wlen = self._len[wid]
        ids = self._flat[concat_ranges(self._start[wid], wlen)]
        nwords = np.fromiter(map(len, words_per_doc), np.int64, len(words_per_doc))
        tok_end = np.concatenate(([0], np.cumsum(wlen)))
        word_end = np.concatenate(([0], np.cumsum(nwords)))
        return ids, np.diff(tok_end[word_end])


def _split_mixed(t: str) -> list[str]:
    """Pieces of a text that has characters outside the admitted set: runs of admitted text
    are split with the regex; each stretch around other characters, from one *sure
    boundary* to the next, stays whole and goes to the tokenizer (and into the cache).

    A sure boundary is a space preceded by a printable non-space ASCII character: under
    both regexes no pre-token continues across it (a space can only open a pre-token or sit
    in a whitespace run, and the character before is not whitespace under any Unicode
    table), and matching after it never looks back. So encoding such a stretch alone gives
    the ids it gets in context.
    """
    words: list[str] = []
    pos = 0
    m = _OUTSIDE.search(t)
    while m is not None:
        q = m.start()
        a = t.rfind(" ", pos, q)
        while a > pos and not "!" <= t[a - 1] <= "~":
            a = t.rfind(" ", pos, a)
        a = max(a, pos)  # pos is itself a sure boundary (or the start)
        nb = _BOUNDARY.search(t, q + 1)
        b = nb.start() if nb is not None else len(t)
        words += _SPLIT.findall(t, pos, a)
        words.append(t[a:b])
        pos = b
        m = _OUTSIDE.search(t, b)
    words += _SPLIT.findall(t, pos)
    return words


def _pack_lists(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter(map(len, ids), np.int64, len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), np.uint32, int(lens.sum()))
    return flat, lens
