"""Flat token files (nanoGPT's ``train.bin``, many forks' ``*.bin``) as token datasets, in place.

A flat token file is a bare little-endian ``uint16`` or ``uint32`` array of token ids, no
header, no document index - the layout of a token shard's ``.bin``. :func:`index_flat` writes
two small files beside it and never copies or changes the tokens::

    train.bin                the user's tokens, read in place through np.memmap
    train.bin.idx            a token index (format 2): the file's xxh3_128 checksum and an
                             xxh3_64 per block of 64 Ki tokens (checked on first touch)
    train.bin.dataset.json   a one-shard dataset manifest: dtype, vocab_size, fingerprint

``StreamingDataset("data/train.bin", seq_len=...)`` then reads it as any token dataset
(``windows="fixed"``: the exact-resume epoch stream; ``"random"``: nanoGPT's random
``get_batch`` windows). There are no documents: the index holds one, and ``eos_id`` is -1.

The vocabulary size comes from ``--vocab-size`` or from nanoGPT's ``meta.pkl``. That file is a
pickle, and a pickle is code: :func:`read_vocab_size` never unpickles it with ``pickle.load``;
it runs a restricted unpickler that resolves no global at all (no class, no function, no
extension code: plain dicts, lists, strings and numbers only), reads at most
:data:`MAX_META_BYTES`, and returns the one integer ``vocab_size``.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from unbroken.common.fs import atomic_write_bytes, checksum_bytes, hasher, local_path, path_str
from unbroken.common.text import printable
from unbroken.data.manifest import (
    MAX_VOCAB,
    DatasetManifest,
    ManifestError,
    ShardInfo,
    open_regular,
    read_bounded,
)
from unbroken.data.tokens.shard import (
    BLOCK_TOKENS,
    TOKEN_INDEX_SUFFIX,
    TokenShardWriter,
    dtype_for_vocab,
    encode_index,
)

__all__ = [
    "FLAT_MANIFEST_SUFFIX",
    "MAX_META_BYTES",
    "flat_manifest",
    "flat_to_shards",
    "index_flat",
    "read_vocab_size",
]

log = logging.getLogger(__name__)

FLAT_MANIFEST_SUFFIX = ".dataset.json"
MAX_META_BYTES = 64 << 20  # a char-level meta.pkl is ~1 KB; a 256k-entry itos/stoi ~20 MB
NO_EOS = -1  # a flat file records no document ends
_CHUNK_BLOCKS = 128  # blocks hashed per read (16 or 32 MiB)


class _NoGlobals(pickle.Unpickler):
    """An unpickler that resolves nothing by name: GLOBAL, STACK_GLOBAL, EXT*, persistent ids
    and therefore REDUCE/BUILD of any callable all fail before anything runs."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it refers to {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it refers to a persistent id")


def read_vocab_size(meta_path: str) -> int:
    """``vocab_size`` from a nanoGPT ``meta.pkl``, without running code from it (module
    docstring): a file larger than :data:`MAX_META_BYTES`, one that names any global, or
    one without a positive integer ``vocab_size`` is refused with an error naming it."""
    path = local_path(path_str(meta_path))
    fix = "pass the vocabulary size yourself (--vocab-size N / vocab_size=N)"
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            raw = read_bounded(f, MAX_META_BYTES + 1)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        raise ValueError(f"{path}: cannot be read as a meta.pkl ({e.strerror}); {fix}") from None
    if len(raw) > MAX_META_BYTES:
        raise ValueError(f"{path}: larger than {MAX_META_BYTES:,} bytes: not read; {fix}")
    try:
        meta = _NoGlobals(io.BytesIO(raw)).load()
    except Exception as e:  # noqa: BLE001 - any malformed pickle: one message, no traceback from inside
        raise ValueError(
            f"{path}: refused as a meta.pkl ({e}): only plain dicts, lists, strings and numbers "
            f"are read, nothing that names code; {fix}"
        ) from None
    v = meta.get("vocab_size") if isinstance(meta, dict) else None
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_VOCAB:
        raise ValueError(
            f"{path}: no positive integer 'vocab_size' up to {MAX_VOCAB:,} (uint32 ids) in "
            f"it (got {printable(repr(v))[:80]}); {fix}"
        )
    return v


def _sidecars(path: str) -> tuple[str, str]:
    return path + TOKEN_INDEX_SUFFIX, path + FLAT_MANIFEST_SUFFIX


def flat_manifest(path: str) -> DatasetManifest:
    """The manifest :func:`index_flat` wrote for the flat token file ``path``; a missing one
    is an error that says how to write it."""
    _, man = _sidecars(path)
    try:
        with os.fdopen(open_regular(man), "rb") as f:
            raw = read_bounded(f, 1 << 20)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: a flat token file without its index; write it once (the tokens are not "
            f"copied): `unbroken data index {path} --meta meta.pkl` (or --vocab-size N), or "
            f"unbroken.data.index_flat({path!r}, meta=...)"
        ) from None
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        raise ManifestError(
            f"{man}: {e.strerror}; delete it and re-run `unbroken data index {path}`"
        ) from None
    m = DatasetManifest.parse(raw, source=man)
    name = os.path.basename(path)
    if m.kind != "tokens" or len(m.shards) != 1 or m.shards[0].name != name:
        raise ManifestError(
            f"{man}: not the manifest of the flat token file {name} (kind {m.kind}, shards "
            f"{[s.name for s in m.shards][:3]}); delete it and re-run `unbroken data index {path}`"
        )
    return m


def _blocks(path: str, itemsize: int) -> Iterator[np.ndarray]:
    """The file's tokens, ``_CHUNK_BLOCKS`` blocks at a time (whole blocks but the last)."""
    step = BLOCK_TOKENS * itemsize * _CHUNK_BLOCKS
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(step):
            yield np.frombuffer(chunk, dtype=np.uint8)


def _scan(path: str, dtype: np.dtype[Any], vocab: int | None) -> tuple[int, str, list[int]]:
    """(tokens, file checksum, block hashes); an id >= ``vocab`` is refused."""
    whole, hashes, tokens = hasher(), [], 0
    block_bytes = BLOCK_TOKENS * dtype.itemsize
    for chunk in _blocks(path, dtype.itemsize):
        whole.update(chunk.data)
        for b in range(0, len(chunk), block_bytes):
            hashes.append(xxhash.xxh3_64_intdigest(chunk[b : b + block_bytes].data))
        if vocab is not None and len(chunk) >= dtype.itemsize:
            ids = chunk[: len(chunk) // dtype.itemsize * dtype.itemsize].view(dtype)
            if int(ids.max()) >= vocab:
                k = int(np.flatnonzero(ids >= vocab)[0])
                raise ValueError(
                    f"{path}: token {tokens + k} is id {int(ids[k])}, outside a vocabulary of "
                    f"{vocab}; pass the right --vocab-size / meta.pkl, or --dtype (uint32?)"
                )
        tokens += len(chunk) // dtype.itemsize
    return tokens, whole.hexdigest(), hashes


def index_flat(
    path: str,
    *,
    vocab_size: int | None = None,
    meta: str | None = None,
    dtype: str | None = None,
    fsync: bool = True,
) -> DatasetManifest:
    """Index the flat token file ``path`` in place (module docstring); returns its manifest.

    The vocabulary: ``vocab_size``, else read from ``meta`` (nanoGPT's ``meta.pkl``, safely),
    else unknown (then ``dtype`` says the width, default ``uint16``). Idempotent: when the
    manifest beside the file records the same size, modification time, dtype and vocabulary,
    it is returned without reading the tokens again (one call per rank is fine).
    """
    path = path_str(path)
    path = local_path(path)
    if vocab_size is None and meta is not None:
        vocab_size = read_vocab_size(meta)
    if vocab_size is not None and (isinstance(vocab_size, bool) or vocab_size < 1):
        raise ValueError(f"vocab_size={vocab_size!r} must be a positive integer")
    dt = np.dtype(dtype_for_vocab(vocab_size, dtype) if vocab_size else dtype or "uint16")
    dt = dt.newbyteorder("<")
    st = os.stat(path)
    if st.st_size % dt.itemsize:
        raise ValueError(
            f"{path}: {st.st_size} bytes is not a whole number of {dt.name} tokens; is it "
            "the right file and dtype (--dtype uint16 / uint32)?"
        )
    stamp = {"source": "flat", "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    idx, man = _sidecars(path)
    try:
        old = flat_manifest(path)
        if old.extra.get("stamp") == stamp and (old.dtype, old.vocab_size) == (dt.name, vocab_size):
            return old
    except (FileNotFoundError, ManifestError):
        pass
    tokens, digest, hashes = _scan(path, dt, vocab_size)
    raw = encode_index(dt.itemsize, [0, tokens], NO_EOS, digest, BLOCK_TOKENS, hashes)
    atomic_write_bytes(idx, raw, fsync=fsync)
    name = os.path.basename(path)
    shard = ShardInfo(
        name,
        1,  # samples of a token shard without a seq_len: its documents (one)
        st.st_size,
        digest,
        os.path.basename(idx),
        len(raw),
        checksum_bytes(raw),
        documents=1,
        tokens=tokens,
    )
    m = DatasetManifest.create(
        "tokens",
        [shard],
        dtype=dt.name,
        eos_id=NO_EOS,
        vocab_size=vocab_size,
        extra={"tool": "unbroken data index (flat token file)", "stamp": stamp},
    )
    atomic_write_bytes(man, m.dumps().encode(), fsync=fsync)
    log.info("indexed %s: %d %s tokens in place (%s)", path, tokens, dt.name, m.fingerprint)
    return m


def flat_to_shards(
    path: str,
    out: str,
    *,
    seq_len: int | None = None,
    shard_size: int = 256 << 20,
    fsync: bool = True,
) -> DatasetManifest:
    """Copy an indexed flat token file into token shards under ``out`` (``dataset.json``,
    ``tokens-NNNNNN.bin`` + index): for stores and tools that take a dataset directory.

    Cuts fall on multiples of ``seq_len`` tokens (when given), and each shard but the last
    starts one token before the previous one ends, so the epoch stream at ``seq_len`` is the
    flat file's, window for window. The source is verified against its index first.
    """
    from unbroken.data.tokens.shard import TokenShard

    m = flat_manifest(local_path(path))
    ts = TokenShard(path, verify=True, index_checksum=m.shards[0].index_checksum, dataset=path)
    ts.verify(m.shards[0].checksum)
    os.makedirs(out, exist_ok=True)
    step = max(1, shard_size // ts.dtype.itemsize)
    if seq_len:
        step = max(seq_len, step // seq_len * seq_len)
    n, shards = ts.num_tokens, []
    for i, lo in enumerate(range(0, max(n - 1, 1), step)):
        hi = min(n, lo + step + 1)  # one token of overlap: the last window's target
        name = os.path.join(out, f"tokens-{i:06d}.bin")
        w = TokenShardWriter(name, ts.dtype.name, NO_EOS, fsync=fsync)
        w.add_raw(np.asarray(ts.tokens[lo:hi]))
        shards.append(w.commit_info(seq_len))
    m2 = DatasetManifest.create(
        "tokens",
        shards,
        dtype=ts.dtype.name,
        eos_id=NO_EOS,
        seq_len=seq_len,
        vocab_size=m.vocab_size,
        extra={"tool": "unbroken data tokenize --from-bin", "source": os.path.basename(path)},
    )
    m2.save(out)
    return m2
