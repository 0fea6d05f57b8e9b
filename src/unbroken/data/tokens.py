"""Token shards: flat uint16/uint32 token arrays + a document-offset index, memory-mapped.

On disk, per shard (the nanoGPT/Megatron idea; ``np.memmap(bin, dtype)`` reads the tokens)::

    tokens-000000.bin      raw little-endian token ids, every document followed by EOS
    tokens-000000.bin.idx  header (72 bytes): magic b"UBTOK\\x01\\x00\\x00", itemsize (u64),
                           num_documents N (u64), num_tokens T (u64), eos_id (i64),
                           checksum of the .bin (32 ASCII hex, xxh3_128)
                           then offsets[N+1] (u64): document d is tokens[off[d]:off[d+1]-1],
                           its EOS is tokens[off[d+1]-1]; off[N] == T

A shard holds whole documents only. Sequences for language-model training are cut from a
shard's token stream as consecutive non-overlapping windows: sequence ``i`` at length ``L``
is ``tokens[i*L : i*L + L + 1]`` (inputs ``x = s[:-1]``, targets ``y = s[1:]``), so windows
cross document boundaries (the EOS tells the model) and the *last partial window* of a shard,
fewer than ``L + 1`` tokens, is not a sequence: at most ``L`` tokens per shard go unused.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

from unbroken._fs import (
    checksum_file,
)
from unbroken.data.shards import ShardError
from unbroken.data.writers import IndexedFileWriter

__all__ = [
    "TOKEN_INDEX_SUFFIX",
    "TokenShard",
    "TokenShardWriter",
    "dtype_for_vocab",
    "num_sequences",
]

TOKEN_INDEX_SUFFIX = ".idx"
_MAGIC = b"UBTOK\x01\x00\x00"
_HEADER = struct.Struct("<8sQQQq32s")
_DTYPES: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_FLUSH = 8 << 20


def dtype_for_vocab(vocab_size: int, requested: str | None = None) -> str:
    """``"uint16"`` when every id fits (vocab <= 65,536), else ``"uint32"``.

    An explicit ``requested="uint16"`` with a larger vocabulary is an error, not a silent
    truncation of ids.
    """
    if requested not in (None, "uint16", "uint32"):
        raise ValueError(f"dtype={requested!r} is not supported; pass uint16 or uint32")
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


class TokenShardWriter(IndexedFileWriter):
    """Append documents (EOS added) to a temporary sibling; :meth:`commit` publishes the .bin
    and then its index (the commit order of :class:`IndexedFileWriter`)."""

    def __init__(self, path: str, dtype: str, eos_id: int, *, fsync: bool = True) -> None:
        super().__init__(path, path + TOKEN_INDEX_SUFFIX, fsync=fsync)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.eos_id = int(eos_id)
        self._eos = np.array([eos_id], dtype=self.dtype)
        self._offsets = [0]
        self._pending: list[np.ndarray] = []
        self._pending_bytes = 0

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    def add(self, ids: Any) -> None:
        """One document's token ids (without EOS)."""
        arr = np.asarray(ids, dtype=self.dtype)
        self._pending.append(arr)
        self._pending.append(self._eos)
        self._offsets.append(self._offsets[-1] + arr.size + 1)
        self._pending_bytes += (arr.size + 1) * self.dtype.itemsize
        if self._pending_bytes >= _FLUSH:
            self._flush()

    def add_many(self, ids: np.ndarray, lens: np.ndarray) -> None:
        """Several documents at once: ``ids`` concatenated, ``lens`` their lengths."""
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
            self._write(data)

    def commit(self) -> tuple[int, str, bytes]:
        """Publish; returns ``(bin_bytes, bin_checksum, index_bytes)``."""
        self._flush()
        head = _HEADER.pack(
            _MAGIC,
            self.dtype.itemsize,
            self.num_documents,
            self.num_tokens,
            self.eos_id,
            self._w.digest.encode(),
        )
        raw = head + np.asarray(self._offsets, dtype="<u8").tobytes()
        self._publish(raw)
        return self.size, self.checksum, raw


class TokenShard:
    """A memory-mapped token shard: slice by document or by fixed-length sequence."""

    def __init__(self, path: str, index_path: str | None = None) -> None:
        self.path = path
        self.index_path = index_path or path + TOKEN_INDEX_SUFFIX
        try:
            with open(self.index_path, "rb") as f:
                head = f.read(_HEADER.size)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.index_path}: token index missing next to {path}; re-run "
                "`unbroken tokenize` (it resumes) or re-copy the dataset"
            ) from None
        if len(head) < _HEADER.size or head[:8] != _MAGIC:
            raise ShardError(f"{self.index_path}: not an unbroken token index; re-create it")
        _, itemsize, n_docs, n_tokens, eos, chk = _HEADER.unpack(head)
        if itemsize not in _DTYPES:
            raise ShardError(f"{self.index_path}: unknown token size {itemsize}; re-create it")
        self.dtype = _DTYPES[itemsize]
        self.eos_id = int(eos)
        self.checksum = chk.decode("ascii", "replace")
        want_idx = _HEADER.size + 8 * (n_docs + 1)
        idx_size = os.path.getsize(self.index_path)
        bin_size = os.path.getsize(path)
        if idx_size != want_idx:
            raise ShardError(
                f"{self.index_path}: {idx_size} bytes, header says {want_idx} (truncated); "
                "re-create or re-copy it"
            )
        if bin_size != n_tokens * itemsize:
            raise ShardError(
                f"{path}: {bin_size} bytes but its index describes {n_tokens} tokens of "
                f"{itemsize} bytes; the shard is truncated or the index is stale - re-copy"
            )
        self.offsets = np.memmap(
            self.index_path, dtype="<u8", mode="r", offset=_HEADER.size, shape=(n_docs + 1,)
        )
        if int(self.offsets[-1]) != n_tokens:
            raise ShardError(
                f"{self.index_path}: offsets end at {int(self.offsets[-1])}, not {n_tokens}"
            )
        self.tokens: np.ndarray = (
            np.memmap(path, dtype=self.dtype, mode="r", shape=(n_tokens,))
            if n_tokens
            else np.zeros(0, dtype=self.dtype)
        )

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
        return self.tokens[int(self.offsets[i]) : int(self.offsets[i + 1]) - 1]

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
        return self.tokens[i * seq_len : i * seq_len + seq_len + 1]

    def verify(self, checksum: str | None = None) -> None:
        """Read every byte: the .bin must match the checksum its index recorded."""
        _, digest = checksum_file(self.path)
        if digest != self.checksum or (checksum is not None and digest != checksum):
            raise ShardError(
                f"{self.path}: checksum {digest} does not match the recorded "
                f"{checksum or self.checksum}; the shard is damaged - re-copy it"
            )
