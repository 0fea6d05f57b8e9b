"""Token shards: flat uint16/uint32 token arrays + a document-offset index, memory-mapped.

Per shard, ``tokens-NNNNNN.bin`` holds the raw little-endian token ids, every document
followed by EOS (``np.memmap(bin, dtype)`` reads them), and ``tokens-NNNNNN.bin.idx`` the
document offsets, the checksum of the ``.bin`` and one xxh3_64 per block of ``B`` tokens.
Every block is verified the first time a reader touches it (T-NO-WRONG-BYTE); a damaged one
is a :class:`~unbroken.data.tar.reader.CorruptSampleError` naming the shard and the block.
Format 1 (no block hashes) still reads, unverified, with one warning.

A shard holds whole documents only. Sequence ``i`` at length ``L`` is
``tokens[i*L : i*L + L + 1]`` (inputs ``x = s[:-1]``, targets ``y = s[1:]``): windows cross
document boundaries (the EOS tells the model), and the last partial window of a shard
(fewer than ``L + 1`` tokens) is not a sequence, so at most ``L`` tokens per shard go
unused.

The index format: ARCHITECTURE.md, "Design notes" > data > shard formats.
"""

from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple

import numpy as np
import xxhash

from unbroken.common.fs import (
    checksum_bytes,
    checksum_file,
)
from unbroken.data.manifest import MAX_VOCAB, ShardInfo
from unbroken.data.tar.reader import (
    CorruptSampleError,
    ShardError,
    corrupt_sample,
    read_index_file,
    warn_unverified,
)
from unbroken.data.tar.writer import IndexedFileWriter

__all__ = [
    "BLOCK_TOKENS",
    "TOKEN_INDEX_SUFFIX",
    "TokenShard",
    "TokenShardWriter",
    "dtype_for_vocab",
    "encode_index",
    "num_sequences",
]

TOKEN_INDEX_SUFFIX = ".idx"
BLOCK_TOKENS = 1 << 16
_MAGIC = b"UBTOK\x02\x00\x00"
_MAGIC_V1 = b"UBTOK\x01\x00\x00"
_HEADER = struct.Struct("<8sQQQq32sQ")
_HEADER_V1 = struct.Struct("<8sQQQq32s")
_HASH = 8
_DTYPES: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_FLUSH = 8 << 20
# block states of a reader
_UNCHECKED, _GOOD, _BAD = 0, 1, 2


def dtype_for_vocab(vocab_size: int, requested: str | None = None) -> str:
    """``"uint16"`` when every id fits (vocab <= 65,536), else ``"uint32"``.

    An explicit ``requested="uint16"`` with a larger vocabulary is an error, not a silent
    truncation of ids.
    """
    if requested not in (None, "uint16", "uint32"):
        raise ValueError(f"dtype={requested!r} is not supported; pass uint16 or uint32")
    if vocab_size > MAX_VOCAB:
        raise ValueError(
            f"vocabulary of {vocab_size} tokens is too large for uint32 token ids (max "
            f"{MAX_VOCAB:,}); is the vocab_size right?"
        )
    if requested == "uint16" and vocab_size > 1 << 16:
        raise ValueError(
            f"vocabulary of {vocab_size} tokens is too large for uint16 (max 65,536 ids); "
            "pass --dtype uint32 or omit --dtype"
        )
    if requested:
        return requested
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def num_sequences(num_tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens stepping by ``seq_len`` (see the module docstring)."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    return max(0, (num_tokens - 1) // seq_len)


def encode_index(
    itemsize: int,
    offsets: Any,
    eos_id: int,
    checksum: str,
    block_tokens: int,
    block_hashes: Any,
) -> bytes:
    """The bytes of a token index (format 2, the module docstring) for a ``.bin`` of
    ``offsets[-1]`` tokens: a shard being written, or a flat token file indexed in place."""
    head = _HEADER.pack(
        _MAGIC,
        itemsize,
        len(offsets) - 1,
        int(offsets[-1]),
        eos_id,
        checksum.encode(),
        block_tokens,
    )
    body = b"".join(
        (
            head,
            np.asarray(offsets, dtype="<u8").tobytes(),
            np.asarray(block_hashes, dtype="<u8").tobytes(),
        )
    )
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(_HASH, "little")


class _Header(NamedTuple):
    hashed: bool  # format 2: block hashes and the index's own hash
    size: int  # bytes of the header
    itemsize: int
    docs: int
    tokens: int
    eos_id: int
    checksum: str  # of the .bin
    block: int  # tokens per hashed block (0: format 1)
    blocks: int


def _parse_header(raw: bytes, index_path: str, fix: str) -> _Header:
    """The header of a token index, once the index has been checked whole: its magic, its
    own hash (format 2), known sizes, and a length that matches what the header says."""
    magic = raw[:8]
    hashed = magic == _MAGIC
    head = _HEADER if hashed else _HEADER_V1
    if len(raw) < head.size or magic not in (_MAGIC, _MAGIC_V1):
        raise ShardError(f"{index_path}: not an unbroken token index; {fix}")
    if hashed and xxhash.xxh3_64_intdigest(memoryview(raw)[:-_HASH]) != int.from_bytes(
        raw[-_HASH:], "little"
    ):
        raise ShardError(
            f"{index_path}: index checksum does not match its content (damaged or truncated); {fix}"
        )
    fields = head.unpack_from(raw)
    _, itemsize, n_docs, n_tokens, eos, chk = fields[:6]
    block = int(fields[6]) if hashed else 0
    if itemsize not in _DTYPES or (hashed and block < 1):
        raise ShardError(f"{index_path}: unknown token size or block size; {fix}")
    n_blocks = -(-n_tokens // block) if hashed else 0
    want_idx = head.size + 8 * (n_docs + 1) + (8 * n_blocks + _HASH if hashed else 0)
    if len(raw) != want_idx:
        raise ShardError(
            f"{index_path}: {len(raw)} bytes, header says {want_idx} (truncated); {fix}"
        )
    checksum = chk.decode("ascii", "replace")
    return _Header(
        hashed, head.size, itemsize, n_docs, n_tokens, int(eos), checksum, block, n_blocks
    )


class TokenShardWriter(IndexedFileWriter):
    """Append documents (EOS added) to a temporary sibling; :meth:`commit` publishes the .bin
    and then its index (the commit order of :class:`IndexedFileWriter`)."""

    def __init__(
        self,
        path: str,
        dtype: str,
        eos_id: int,
        *,
        fsync: bool = True,
        block_tokens: int = BLOCK_TOKENS,
    ) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens} must be >= 1")
        super().__init__(path, path + TOKEN_INDEX_SUFFIX, fsync=fsync)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.eos_id = int(eos_id)
        # eos_id -1: no end-of-document token (a flat token file's ids, added with add_raw)
        self._eos = np.array([max(eos_id, 0)], dtype=self.dtype)
        self._offsets = [0]
        self._pending: list[np.ndarray] = []
        self._pending_bytes = 0
        self.block_tokens = block_tokens
        self._block_bytes = block_tokens * self.dtype.itemsize
        self._block = xxhash.xxh3_64()  # the block being written
        self._block_fill = 0
        self._block_hashes: list[int] = []

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    def add(self, ids: Any) -> None:
        """One document's token ids (without EOS)."""
        self._need_eos()
        arr = np.asarray(ids, dtype=self.dtype)
        self._pending.append(arr)
        self._pending.append(self._eos)
        self._offsets.append(self._offsets[-1] + arr.size + 1)
        self._pending_bytes += (arr.size + 1) * self.dtype.itemsize
        if self._pending_bytes >= _FLUSH:
            self._flush()

    def _need_eos(self) -> None:
        if self.eos_id < 0:
            raise ValueError(f"{self.path}: written without an EOS id (eos_id=-1): use add_raw")

    def add_raw(self, ids: np.ndarray) -> None:
        """Tokens as they are, one document with no EOS added (a flat token file's stretch:
        its last token is no end of document)."""
        arr = np.asarray(ids, dtype=self.dtype)
        self._pending.append(arr)
        self._offsets.append(self._offsets[-1] + arr.size)
        self._pending_bytes += arr.nbytes
        if self._pending_bytes >= _FLUSH:
            self._flush()

    def add_many(self, ids: np.ndarray, lens: np.ndarray) -> None:
        """Several documents at once: ``ids`` concatenated, ``lens`` their lengths."""
        self._need_eos()
        arr = np.insert(ids.astype(self.dtype, copy=False), np.cumsum(lens), self.eos_id)
        self._offsets.extend((self._offsets[-1] + np.cumsum(lens + 1)).tolist())
        self._pending.append(arr)
        self._pending_bytes += arr.nbytes
        if self._pending_bytes >= _FLUSH:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            data = np.concatenate(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
            self._hash_blocks(data)
            self._write(data)

    def _hash_blocks(self, data: np.ndarray) -> None:
        """Feed the block hashes while writing (no second read of the shard)."""
        mv = data.view(np.uint8).data
        pos, n = 0, len(mv)
        while pos < n:
            take = min(self._block_bytes - self._block_fill, n - pos)
            self._block.update(mv[pos : pos + take])
            self._block_fill += take
            pos += take
            if self._block_fill == self._block_bytes:
                self._block_hashes.append(self._block.intdigest())
                self._block.reset()
                self._block_fill = 0

    def commit(self) -> tuple[int, str, bytes]:
        """Publish; returns ``(bin_bytes, bin_checksum, index_bytes)``."""
        self._flush()
        if self._block_fill:
            self._block_hashes.append(self._block.intdigest())
            self._block_fill = 0
        raw = encode_index(
            self.dtype.itemsize,
            self._offsets,
            self.eos_id,
            self._w.digest,
            self.block_tokens,
            self._block_hashes,
        )
        self._publish(raw)
        return self.size, self.checksum, raw

    def commit_info(self, seq_len: int | None) -> ShardInfo:
        """:meth:`commit`, returning the shard's ``dataset.json`` record: its samples are
        sequences of ``seq_len`` (documents when None), its index the ``.idx`` beside it."""
        size, digest, raw = self.commit()
        name = os.path.basename(self.path)
        return ShardInfo(
            name,
            num_sequences(self.num_tokens, seq_len) if seq_len else self.num_documents,
            size,
            digest,
            name + TOKEN_INDEX_SUFFIX,
            len(raw),
            checksum_bytes(raw),
            documents=self.num_documents,
            tokens=self.num_tokens,
        )


class TokenShard:
    """A memory-mapped token shard: slice by document or by fixed-length sequence.

    With ``verify`` (default) each block of tokens is checked against the index's hash of it
    the first time :meth:`document`, :meth:`sequence` or :meth:`damaged` touches it;
    ``tokens`` itself is the raw map (a caller that slices it checks with :meth:`damaged`).
    ``index_checksum`` (dataset.json's) refuses an index that is not the recorded one;
    ``dataset`` names the dataset in errors and keys the warning for a format-1 index;
    ``cached``: the files are a node cache's copies (an error then says to delete them).
    """

    def __init__(
        self,
        path: str,
        index_path: str | None = None,
        *,
        verify: bool = True,
        index_checksum: str | None = None,
        dataset: str | None = None,
        cached: bool = False,
    ) -> None:
        self.path = path
        self.dataset = dataset
        self.cached = cached
        self.index_path = index_path or path + TOKEN_INDEX_SUFFIX
        fix = "re-run `unbroken data tokenize` (it resumes) or re-copy the dataset"
        try:
            raw = read_index_file(
                self.index_path,
                index_checksum if verify else None,
                dataset=dataset,
                cached=cached,
            )
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.index_path}: token index missing next to {path}; {fix}"
            ) from None
        h = _parse_header(raw, self.index_path, fix)
        hashed, itemsize, n_docs, n_tokens, block = h.hashed, h.itemsize, h.docs, h.tokens, h.block
        self.dtype = _DTYPES[itemsize]
        self.eos_id = h.eos_id
        self.checksum = h.checksum
        try:
            bin_size = os.path.getsize(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: token shard missing; {fix}") from None
        if bin_size != n_tokens * itemsize:
            raise ShardError(
                f"{path}: {bin_size} bytes but its index describes {n_tokens} tokens of "
                f"{itemsize} bytes; the shard is truncated or the index is stale - re-copy"
            )
        self.offsets = np.frombuffer(raw, dtype="<u8", count=n_docs + 1, offset=h.size)
        off = self.offsets
        if int(off[0]) != 0 or int(off[-1]) != n_tokens or bool((off[1:] < off[:-1]).any()):
            raise ShardError(
                f"{self.index_path}: document offsets do not run from 0 to {n_tokens} tokens "
                f"in order (damaged); {fix}"
            )
        self.tokens: np.ndarray = (
            np.memmap(path, dtype=self.dtype, mode="r", shape=(n_tokens,))
            if n_tokens
            else np.zeros(0, dtype=self.dtype)
        )
        self.block_tokens = block
        self._block_hash: list[int] = []
        self._state = bytearray()  # per block: _UNCHECKED, _GOOD or _BAD
        self._unchecked = 0
        if verify and hashed:
            pos = h.size + 8 * (n_docs + 1)
            self._block_hash = np.frombuffer(raw, "<u8", count=h.blocks, offset=pos).tolist()
            self._state = bytearray(h.blocks)
            self._unchecked = h.blocks
        elif verify:
            warn_unverified(dataset or path, self.index_path)
        self._any_bad = False

    def close(self) -> None:
        """Let the map go (a reader keeps a bounded number of shards open): unmapped once
        no row sliced from it is alive."""
        self.tokens = np.zeros(0, dtype=self.dtype)

    # --- verification ----------------------------------------------------------------------

    def _check_block(self, b: int) -> None:
        B = self.block_tokens
        data = self.tokens[b * B : (b + 1) * B]
        ok = xxhash.xxh3_64_intdigest(np.ascontiguousarray(data).data) == self._block_hash[b]
        self._state[b] = _GOOD if ok else _BAD
        self._unchecked -= 1
        self._any_bad |= not ok

    def damaged(self, starts: np.ndarray, length: int) -> np.ndarray | None:
        """Verify the blocks under the token ranges ``[s, s + length)``, each once per reader.

        Returns None when every range is intact, else a bool mask of the ranges that touch a
        damaged block (see :meth:`error` for the exception naming it).
        """
        if not self._unchecked and not self._any_bad:
            return None  # every block verified and intact: the steady state costs nothing
        B, last = self.block_tokens, len(self._state) - 1
        span = max(length, 1) - 1
        state = self._state
        mask = None
        # A plain loop: a batch holds a few ranges of one or two blocks each, fewer Python
        # steps than the numpy calls that would find its unchecked blocks.
        for k, s in enumerate(np.asarray(starts).tolist()):
            for b in range(max(s // B, 0), min((s + span) // B, last) + 1):
                if state[b] == _UNCHECKED:
                    self._check_block(b)
                if state[b] == _BAD:
                    if mask is None:
                        mask = np.zeros(len(starts), dtype=bool)
                    mask[k] = True
        return mask

    def error(self, start: int, length: int) -> CorruptSampleError:
        """The error for the token range ``[start, start + length)`` (it touches a bad block)."""
        B = self.block_tokens
        bad = [
            b
            for b in range(start // B, (start + max(length, 1) - 1) // B + 1)
            if self._state[b] == _BAD
        ]
        b = bad[0] if bad else start // B
        hi = min((b + 1) * B, self.num_tokens) - 1
        return corrupt_sample(
            self.path,
            f"token block {b} (tokens {b * B}..{hi}, read for tokens {start}.."
            f"{start + length - 1})",
            dataset=self.dataset,
            cached=self.cached,
        )

    def _guard(self, start: int, length: int) -> None:
        if self.damaged(np.array([start]), length) is not None:
            raise self.error(start, length)

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def document(self, i: int) -> np.ndarray:
        """Token ids of document ``i`` without its EOS (a read-only view)."""
        n = self.num_documents
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{self.path}: document {i} out of range (0..{n - 1})")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        self._guard(a, b - a)
        return self.tokens[a : b - 1]

    def num_sequences(self, seq_len: int) -> int:
        return num_sequences(self.num_tokens, seq_len)

    def sequence(self, i: int, seq_len: int) -> np.ndarray:
        """``seq_len + 1`` tokens starting at ``i * seq_len`` (inputs + shifted target)."""
        n = self.num_sequences(seq_len)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(
                f"{self.path}: sequence {i} out of range (0..{n - 1}) at seq_len={seq_len}"
            )
        self._guard(i * seq_len, seq_len + 1)
        return self.tokens[i * seq_len : i * seq_len + seq_len + 1]

    def verify(self, checksum: str | None = None) -> None:
        """Read every byte: the .bin must match the checksum its index recorded."""
        _, digest = checksum_file(self.path)
        if digest != self.checksum or (checksum is not None and digest != checksum):
            raise ShardError(
                f"{self.path}: checksum {digest} does not match the recorded "
                f"{checksum or self.checksum}; the shard is damaged - re-copy it"
            )
