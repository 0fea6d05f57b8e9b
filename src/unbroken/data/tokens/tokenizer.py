"""`unbroken data tokenize`: text -> token shards (see :mod:`unbroken.data.tokens.shard` for the format).

Inputs, in a deterministic order: a ``.jsonl`` file (one document per line, text in
``field``), a ``.txt`` file (one document), a directory of those (sorted walk), or a packed tar
dataset (text in member ``member``, or in the ``json`` member's ``field``). The main process
reads documents and sends ~1 MiB chunks to worker processes that run the tokenizer; results come
back in input order and the main process cuts shards at document boundaries, so the output is
byte-identical for any number of workers. After every committed shard,
``.unbroken-tokenize.json`` records the shards and the number of documents they hold; a re-run
with the same inputs and options verifies those shards and resumes at the next document.
Workers encode through :class:`~unbroken.data.tokens.word_cache.WordCacheEncoder`: for GPT-2-style
byte-level BPE each distinct pre-token is encoded once (ids identical to ``encode``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from unbroken.common.fs import (
    atomic_write_bytes,
    checksum_file,
    ensure_out_dir,
    hasher,
    is_temp_name,
    path_str,
)
from unbroken.common.progress import progress_bar
from unbroken.common.workpool import process_pool, worker_died
from unbroken.data.manifest import MANIFEST_NAME, DatasetManifest, ShardInfo
from unbroken.data.tar.reader import ShardReader, index_format
from unbroken.data.tokens.shard import (
    TOKEN_INDEX_SUFFIX,
    TokenShardWriter,
    dtype_for_vocab,
    num_sequences,
)
from unbroken.data.tokens.word_cache import WordCacheEncoder

__all__ = ["TokenizeResult", "load_tokenizer", "tokenize", "train_bpe"]

log = logging.getLogger(__name__)

_STATE = ".unbroken-tokenize.json"
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_CHUNK_CHARS = 1 << 20
_CHUNK_DOCS = 2048


@dataclass(frozen=True)
class TokenizeResult:
    """What a tokenize run produced; ``seconds`` is the wall time of the whole run."""

    manifest: DatasetManifest
    seconds: float
    documents: int
    tokens: int
    shards_written: int
    shards_reused: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def _input_files(src: str) -> list[str]:
    if os.path.isfile(src):
        return [src]
    if not os.path.isdir(src):
        raise FileNotFoundError(f"{src}: tokenize input not found (a .jsonl/.txt file or dir)")
    out = []
    for d, dirs, files in os.walk(src):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith((".jsonl", ".txt"))]
    if not out:
        raise ValueError(f"{src}: no .jsonl or .txt files (nor a dataset.json) to tokenize")
    return out


def _iter_docs(src: str, field: str, member: str) -> Iterator[tuple[str, str]]:
    """``(where, text)`` in a deterministic order; ``where`` names file and line/key."""
    if os.path.isdir(src) and os.path.exists(os.path.join(src, MANIFEST_NAME)):
        m = DatasetManifest.load(src)
        if m.kind != "tar":
            raise ValueError(f"{src}: a {m.kind} dataset cannot be tokenized; pass tar shards")
        for i in range(len(m.shards)):
            info = m.shards[i]
            with ShardReader(
                m.shard_path(src, i),
                m.index_path(src, i),
                index_checksum=info.index_checksum,
                dataset=src,
            ) as r:
                for s in r:
                    where = f"{r.path}:{s['__key__']}"
                    if member in s:
                        yield where, s[member].decode("utf-8")
                    elif "json" in s and field in (obj := json.loads(s["json"])):
                        yield where, str(obj[field])
                    else:
                        raise ValueError(
                            f"{where}: sample has no {member!r} member nor a json {field!r} "
                            "field; pass --member/--field naming the text"
                        )
        return
    for path in _input_files(src):
        if path.endswith(".txt"):
            with open(path, encoding="utf-8") as f:
                yield path, f.read()
            continue
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{lineno}", json.loads(line)[field]
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(
                        f"{path}:{lineno}: no JSON string field {field!r} ({e!r}); fix the "
                        "line or pass --field NAME"
                    ) from None


def _input_digest(src: str) -> str:
    h = hasher()
    paths = [src] if os.path.isfile(src) else []
    if os.path.isdir(src):
        for d, dirs, files in os.walk(src):
            dirs.sort()
            paths += [os.path.join(d, f) for f in sorted(files) if not f.startswith(".")]
    for p in paths:
        st = os.stat(p)
        h.update(f"{p}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return str(h.hexdigest())


def load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: tokenizer file not found; pass --tokenizer PATH to a HF tokenizers "
            "tokenizer.json, or --train-bpe VOCAB to train a BPE tokenizer on the corpus"
        )
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{path}: not a valid tokenizer.json ({e}); re-export it") from None


def train_bpe(texts: Iterable[str], vocab_size: int, path: str) -> Any:
    """Train a byte-level BPE tokenizer (with ``<|endoftext|>``) and save it atomically."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 256 < vocab_size <= 1 << 20:
        raise ValueError(f"--train-bpe {vocab_size}: pick a vocabulary in (256, 1,048,576]")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[_EOS_CANDIDATES[0]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    atomic_write_bytes(path, tok.to_str().encode())
    return tok


_worker_enc: WordCacheEncoder | None = None


def _worker_init(path: str) -> None:
    global _worker_enc
    _worker_enc = WordCacheEncoder(load_tokenizer(path))


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a chunk concatenated (uint32) plus per-document lengths."""
    if _worker_enc is None:
        raise RuntimeError("tokenize worker used before its initializer ran")
    return _worker_enc.encode(texts)


def _chunks(docs: Iterator[tuple[str, str]], skip: int) -> Iterator[tuple[list[str], list[str]]]:
    """Batches of ~1 MiB of text; the first ``skip`` documents (already in shards) dropped."""
    texts: list[str] = []
    wheres: list[str] = []
    size = 0
    for i, (where, text) in enumerate(docs):
        if i < skip:
            continue
        texts.append(text)
        wheres.append(where)
        size += len(text)
        if size >= _CHUNK_CHARS or len(texts) >= _CHUNK_DOCS:
            yield texts, wheres
            texts, wheres, size = [], [], 0
    if texts:
        yield texts, wheres


def _ordered_map(
    fn: Any, items: Iterator[Any], workers: int, init: Any, initargs: tuple[Any, ...]
) -> Iterator[tuple[Any, Any]]:
    """``(item, fn(item[0]))`` in input order with at most 2*workers chunks in flight
    (``item[1]``: where each document of the chunk came from, for errors)."""
    if workers <= 1:
        init(*initargs)
        for it in items:
            yield it, fn(it[0])
        return
    # Workers are forked after this process may have used the tokenizer's thread pool;
    # TOKENIZERS_PARALLELISM=false in the forked env keeps each worker single-threaded
    # (one process per core) and silences the library's fork warning.
    pending: collections.deque[tuple[Any, Any]] = collections.deque()
    with process_pool(workers, init, initargs, env={"TOKENIZERS_PARALLELISM": "false"}) as pool:
        try:
            for it in items:
                pending.append((it, pool.submit(fn, it[0])))
                if len(pending) >= 2 * workers:
                    item, fut = pending[0]
                    yield item, fut.result()
                    pending.popleft()
            while pending:
                item, fut = pending[0]
                yield item, fut.result()
                pending.popleft()
        except BrokenProcessPool as e:
            raise worker_died(_span(pending[0][0][1]) if pending else "tokenize", e) from None


def _span(wheres: list[str]) -> str:
    """The documents of a chunk, for an error: ``a.jsonl:1`` or ``a.jsonl:1 to a.jsonl:900``."""
    return wheres[0] if len(wheres) == 1 else f"{wheres[0]} to {wheres[-1]}"


def _too_small(shard_size: int, dt: str) -> NoReturn:
    least = 2 * np.dtype(dt).itemsize
    raise ValueError(
        f"shard_size={shard_size} bytes (--shard-size) holds fewer than 2 {dt} tokens: no "
        f"document and its end-of-text token fit; pass --shard-size {least} or more (the "
        "default is 256MiB)"
    )


def tokenize(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    train_bpe_vocab: int | None = None,
    field: str = "text",
    member: str = "txt",
    seq_len: int | None = None,
    shard_size: int = 256 << 20,
    dtype: str | None = None,
    eos_token: str | None = None,
    workers: int | None = None,
    fsync: bool = True,
    progress: bool = True,
) -> TokenizeResult:
    """Tokenize ``src`` (JSONL field, .txt files, or tar shards) into token shards in ``out``.

    Output is identical for any ``workers``; a re-run after an interruption keeps verified
    shards and resumes at the first document not yet in one. ``shard_size`` is the maximum
    bytes of token data per shard (whole documents only).
    """
    src, out, tokenizer = path_str(src), path_str(out), path_str(tokenizer)
    t0 = time.perf_counter()
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1 (or omitted for no packing)")
    if shard_size < 4:  # two tokens of the narrowest dtype: found before any training
        _too_small(shard_size, "uint16")
    ensure_out_dir(out)
    tok_path, vocab, dt, eos_id = _tokenizer_for(
        src, out, tokenizer, train_bpe_vocab, field, member, dtype, eos_token
    )
    capacity = shard_size // np.dtype(dt).itemsize
    if capacity < 2:
        _too_small(shard_size, dt)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(out, MANIFEST_NAME))
    config = {
        "input": _input_digest(src),
        "tokenizer": checksum_file(tok_path)[1],
        "field": field,
        "member": member,
        "dtype": dt,
        "eos_id": eos_id,
        "shard_size": shard_size,
    }
    shards, docs_done = _kept_shards(out, config, seq_len)
    reused = len(shards)
    filler = _ShardFiller(out, config, shards, docs_done, capacity, seq_len, fsync)
    chunks = _chunks(_iter_docs(src, field, member), docs_done)
    _fill(filler, chunks, tok_path, workers or min(os.cpu_count() or 1, 8), shard_size, progress)
    _cleanup(out, {s.name for s in shards})
    manifest = DatasetManifest.create(
        "tokens",
        shards,
        dtype=dt,
        eos_id=eos_id,
        seq_len=seq_len,
        vocab_size=vocab,
        extra={"tool": "unbroken tokenize", "tokenizer_checksum": config["tokenizer"]},
    )
    manifest.save(out)
    res = TokenizeResult(
        manifest,
        time.perf_counter() - t0,
        filler.docs,
        filler.tokens,
        len(shards) - reused,
        reused,
    )
    log.info(
        "tokenized %d documents, %d tokens into %d shards in %.2fs (%.0f tokens/s)",
        res.documents,
        res.tokens,
        len(shards),
        res.seconds,
        res.tokens_per_s,
    )
    return res


def _kept_shards(
    out: str, config: dict[str, Any], seq_len: int | None
) -> tuple[list[ShardInfo], int]:
    """The shards an earlier run with the same config left that still verify, and the
    documents they hold."""
    shards, docs_done = _resume(out, config)
    # seq_len only changes how a shard is counted, not its bytes: kept shards are recounted.
    shards = [
        dataclasses.replace(s, samples=num_sequences(s.tokens or 0, seq_len))
        if seq_len
        else dataclasses.replace(s, samples=s.documents or 0)
        for s in shards
    ]
    return shards, docs_done


def _fill(
    filler: _ShardFiller,
    chunks: Iterator[tuple[list[str], list[str]]],
    tok_path: str,
    workers: int,
    shard_size: int,
    progress: bool,
) -> None:
    """Encode ``chunks`` in ``workers`` processes, in order, into the filler's shards, and
    commit them; any error aborts the filler's open shard."""
    bar = progress_bar("tokenize", unit="tok", enabled=progress)
    try:
        for (_, wheres), (ids, lens) in _ordered_map(
            _encode_chunk, chunks, workers, _worker_init, (tok_path,)
        ):
            big = np.nonzero(lens + 1 > filler.capacity)[0]
            if big.size:
                raise ValueError(
                    f"{wheres[int(big[0])]}: document of {int(lens[big[0]])} tokens exceeds "
                    f"shard_size={shard_size} bytes; pass a larger --shard-size"
                )
            bar.update(filler.add(ids, lens))
        filler.commit()
    except BaseException:
        filler.abort()
        raise
    finally:
        bar.close()


def _tokenizer_for(
    src: str,
    out: str,
    tokenizer: str | None,
    train_bpe_vocab: int | None,
    field: str,
    member: str,
    dtype: str | None,
    eos_token: str | None,
) -> tuple[str, int, str, int]:
    """(tokenizer path, vocabulary size, token dtype, end-of-text id); trains a BPE first
    when asked and none exists yet."""
    if tokenizer is None and train_bpe_vocab is None:
        raise ValueError("pass a tokenizer (--tokenizer PATH) or --train-bpe VOCAB")
    tok = None
    if train_bpe_vocab is not None:
        named, tokenizer = tokenizer is not None, tokenizer or os.path.join(out, "tokenizer.json")
        tok = load_tokenizer(tokenizer) if os.path.exists(tokenizer) else None
        had = None if tok is None else int(tok.get_vocab_size(with_added_tokens=True))
        # a smaller one may be this very request on a corpus with fewer merges: kept
        if had is not None and had > train_bpe_vocab:
            if named:
                raise ValueError(
                    f"{tokenizer}: a tokenizer of vocabulary {had} is there, --train-bpe asks "
                    f"for {train_bpe_vocab}; it is not overwritten: drop --train-bpe to use it, "
                    "or name another --tokenizer path to train into"
                )
            log.info(
                "%s: vocabulary %d, --train-bpe %d: training again", tokenizer, had, train_bpe_vocab
            )
            tok = None
        if tok is None:  # none yet, or one of a larger vocabulary
            tok = train_bpe(
                (t for _, t in _iter_docs(src, field, member)), train_bpe_vocab, tokenizer
            )
    tok_path = str(tokenizer)
    if tok is None:
        tok = load_tokenizer(tok_path)
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    dt = dtype_for_vocab(vocab, dtype)
    cands = (eos_token,) if eos_token else _EOS_CANDIDATES
    eos_id = next((tok.token_to_id(c) for c in cands if tok.token_to_id(c) is not None), None)
    if eos_id is None:
        raise ValueError(
            f"{tok_path}: no end-of-text token among {list(cands)}; pass --eos-token TOKEN"
        )
    return tok_path, vocab, dt, int(eos_id)


class _ShardFiller:
    """Fills token shards with whole documents in order; each full shard is committed, added
    to ``shards`` and recorded in the resume state before the next one starts."""

    def __init__(
        self,
        out: str,
        config: dict[str, Any],
        shards: list[ShardInfo],
        docs_done: int,
        capacity: int,
        seq_len: int | None,
        fsync: bool,
    ) -> None:
        self.out, self.config, self.shards = out, config, shards
        self.capacity, self.seq_len, self.fsync = capacity, seq_len, fsync
        self.docs = docs_done
        self.tokens = sum(s.tokens or 0 for s in shards)
        self.writer: TokenShardWriter | None = None

    def add(self, ids: np.ndarray, lens: np.ndarray) -> int:
        """Append documents (``ids`` concatenated, ``lens`` each); returns tokens written."""
        written = 0
        start = 0
        while start < lens.size:
            if self.writer is None:
                path = os.path.join(self.out, f"tokens-{len(self.shards):06d}.bin")
                self.writer = TokenShardWriter(
                    path, self.config["dtype"], self.config["eos_id"], fsync=self.fsync
                )
            cum = np.cumsum(lens[start:] + 1)
            k = int(np.searchsorted(cum, self.capacity - self.writer.num_tokens, side="right"))
            if k == 0:
                self.commit()
                continue
            a = int(lens[:start].sum())
            self.writer.add_many(ids[a : a + int(cum[k - 1]) - k], lens[start : start + k])
            self.docs += k
            self.tokens += int(cum[k - 1])
            written += int(cum[k - 1])
            start += k
        return written

    def commit(self) -> None:
        w = self.writer
        if w is None:
            return
        self.shards.append(w.commit_info(self.seq_len))
        self.writer = None
        _save_state(self.out, self.config, self.shards, self.docs)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


def _save_state(out: str, config: dict[str, Any], shards: list[ShardInfo], docs: int) -> None:
    st = {
        "version": 1,
        "config": config,
        "documents": docs,
        "shards": [s.to_json() for s in shards],
    }
    atomic_write_bytes(os.path.join(out, _STATE), json.dumps(st, sort_keys=True).encode())


def _resume(out: str, config: dict[str, Any]) -> tuple[list[ShardInfo], int]:
    """Committed shards of an earlier run with the same config that still verify."""
    try:
        with open(os.path.join(out, _STATE), "rb") as f:
            st = json.load(f)
        if not isinstance(st, dict) or st.get("config") != config:
            log.info("%s: earlier tokenize state has other inputs/options; starting over", out)
            return [], 0
        shards = [ShardInfo.from_json(s) for s in st["shards"]]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # a damaged state file
        return [], 0
    for k, s in enumerate(shards):
        try:
            ok = checksum_file(os.path.join(out, s.name)) == (s.bytes, s.checksum)
            ok = ok and checksum_file(os.path.join(out, s.index))[1] == s.index_checksum
            with open(os.path.join(out, s.index), "rb") as f:
                ok = ok and index_format(f.read(8)) == 2  # older: no block checksums
        except OSError:
            ok = False
        if not ok:
            log.warning("%s: shard %s does not verify; re-tokenizing from it on", out, s.name)
            shards = shards[:k]
            break
    return shards, sum(s.documents or 0 for s in shards)


def _cleanup(out: str, keep: set[str]) -> None:
    for name in os.listdir(out):
        base = name.removesuffix(TOKEN_INDEX_SUFFIX)
        stale = base.startswith("tokens-") and base.endswith(".bin") and base not in keep
        if is_temp_name(name) or stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(out, name))
