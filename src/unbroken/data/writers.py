"""Shard writers: the commit protocol shared by tar and token shards, and the tar writer.

:class:`IndexedFileWriter` publishes a data file and then its index (see its docstring);
:class:`TarShardWriter` builds WebDataset-layout tar shards (format and index: see
:mod:`unbroken.data.shards`) with ustar headers byte-equal to :mod:`tarfile`'s, computed for a
whole batch of members at once, plus the size arithmetic ``pack`` uses to plan shards.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import os
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from unbroken._fs import HashingWriter, atomic_write_bytes, hasher, temp_sibling
from unbroken.data._ragged import concat_ranges
from unbroken.data.shards import INDEX_SUFFIX, ShardIndex, member_digests

__all__ = [
    "IndexedFileWriter",
    "MemberBatch",
    "TarShardWriter",
    "body_capacity",
    "buffer_nbytes",
    "member_tar_bytes",
    "sample_tar_bytes",
    "tar_checksum",
    "tar_end_bytes",
    "tar_header",
    "tar_pieces",
]

_BLOCK = 512
_RECORD = 10240  # tarfile pads archives to 20 blocks; we do too, for identical tools' output
_ZEROS = bytes(_RECORD + 2 * _BLOCK)  # the longest run of zeros a shard ends with
_MTIME = 0  # fixed so that the same input gives byte-identical shards


# --- tar headers -------------------------------------------------------------------------


def _template() -> tuple[bytes, bytes, bytes, int]:
    """The constant parts of a ustar regular-file header and their byte sum."""
    ti = tarfile.TarInfo("x")
    ti.mode, ti.uid, ti.gid, ti.mtime, ti.uname, ti.gname = 0o644, 0, 0, _MTIME, "", ""
    buf = ti.tobuf(format=tarfile.USTAR_FORMAT)
    p1, p2, p3 = buf[100:124], buf[136:148], buf[156:512]
    return p1, p2, p3, sum(p1) + sum(p2) + sum(p3) + 8 * 32  # chksum counted as spaces


_P1, _P2, _P3, _BASE_SUM = _template()
_MAX_USTAR_SIZE = 0o77777777777


def tar_header(name: str, size: int) -> bytes:
    """The header block(s) of a regular file member; byte-equal to tarfile's ustar output.

    Built from a precomputed template (a few concatenations, no TarInfo object) because pack
    writes one per member; names over 100 bytes or huge sizes fall back to tarfile's PAX.
    """
    bname = name.encode()
    if len(bname) <= 100 and size <= _MAX_USTAR_SIZE:
        sz = b"%011o\0" % size
        chk = _BASE_SUM + sum(bname) + sum(sz)
        return b"".join((bname.ljust(100, b"\0"), _P1, sz, _P2, b"%06o\0 " % chk, _P3))
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.uid, ti.gid, ti.mtime, ti.uname, ti.gname = size, 0o644, 0, 0, 0, "", ""
    return ti.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def buffer_nbytes(data: Any) -> int:
    t = type(data)
    return len(data) if t is bytes or t is bytearray else memoryview(data).nbytes


def member_tar_bytes(key: str, ext: str, size: int) -> int:
    """Bytes one member occupies in a tar: header(s) + data + padding (for shard planning)."""
    if len(key) + len(ext) < 100 and key.isascii() and ext.isascii():
        hdr = _BLOCK  # fits the ustar name field: no string building on the hot path
    else:
        name = f"{key}.{ext}"
        hdr = _BLOCK if len(name.encode()) <= 100 else len(tar_header(name, size))
    return hdr + size + (-size % _BLOCK)


def sample_tar_bytes(key: str, members: Sequence[tuple[str, int]]) -> int:
    """Bytes a sample occupies in a tar (``members``: ``[(ext, size), ...]``)."""
    return sum(member_tar_bytes(key, ext, size) for ext, size in members)


def tar_end_bytes(body: int) -> int:
    """Bytes after the last member: two zero blocks, then padding to a full tar record."""
    return 2 * _BLOCK + (-(body + 2 * _BLOCK) % _RECORD)


def body_capacity(shard_size: int) -> int:
    """The largest member total ``body`` with ``body + tar_end_bytes(body) <= shard_size``."""
    return (shard_size // _RECORD) * _RECORD - 2 * _BLOCK


def _header_template() -> np.ndarray:
    t = np.zeros(_BLOCK, dtype=np.uint8)
    t[100:124] = np.frombuffer(_P1, np.uint8)
    t[136:148] = np.frombuffer(_P2, np.uint8)
    t[148:156] = ord(" ")  # the checksum field counts as spaces while summing
    t[156:512] = np.frombuffer(_P3, np.uint8)
    return t


_TEMPLATE = _header_template()
# the template's byte sum without its name and size fields (they change per member)
_BASE_FIELDS_SUM = int(
    _TEMPLATE.sum(dtype=np.int64) - _TEMPLATE[:100].sum() - _TEMPLATE[124:136].sum()
)
_SHIFT_SIZE = np.arange(30, -1, -3, dtype=np.int64)  # 11 octal digits
_SHIFT_CHK = np.arange(15, -1, -3, dtype=np.int64)  # 6 octal digits


def _name_fields(b: MemberBatch) -> np.ndarray:
    """The 100-byte name field of every member (zeros where a PAX header is needed)."""
    m = len(b.datas)
    klen = np.fromiter(map(len, b.keys), np.int64, len(b.keys))
    if b.schema is not None and klen.size and (klen == klen[0]).all():
        # Uniform keys and extensions: place key and ".ext" bytes column-wise, no per-member
        # string building.
        lk = int(klen[0])
        if lk + 1 + max(map(len, b.schema)) <= 100:
            n, e = len(b.keys), len(b.schema)
            arr = np.zeros((n, e, 100), np.uint8)
            arr[:, :, :lk] = np.frombuffer(b"".join(b.keys), np.uint8).reshape(n, 1, lk)
            for j, ext in enumerate(b.schema):
                arr[:, j, lk] = ord(".")
                arr[:, j, lk + 1 : lk + 1 + len(ext)] = np.frombuffer(ext, np.uint8)
            return arr.reshape(m, 100)
    names = b.names()
    padded = b"".join(n.ljust(100, b"\0") if len(n) <= 100 else bytes(100) for n in names)
    return np.frombuffer(padded, np.uint8).reshape(m, 100)


def _put_ustar_headers(
    blocks: np.ndarray, rows: np.ndarray, b: MemberBatch, which: np.ndarray | slice
) -> None:
    """Write the ustar headers of members ``which`` into ``blocks[rows]`` (512-byte rows),
    byte-equal to :func:`tar_header`. Vectorized over the batch, because per-member Python
    work dominates packing small samples: the template is copied, only the name and size
    fields change, and the checksum is the template's sum plus those fields' sums."""
    names = _name_fields(b)[which]
    digits = ((b.sizes[which, None] >> _SHIFT_SIZE) & 7) + 48
    blocks[rows] = _TEMPLATE
    blocks[rows, :100] = names
    blocks[rows, 124:135] = digits
    chk = _BASE_FIELDS_SUM + names.sum(axis=1, dtype=np.int64) + digits.sum(axis=1)
    blocks[rows, 148:154] = ((chk[:, None] >> _SHIFT_CHK) & 7) + 48
    blocks[rows, 154] = 0


@dataclass(frozen=True)
class MemberBatch:
    """Samples in columns: what the pack planner cuts into shards and the tar writer writes.

    Members are in tar order (sample after sample); ``schema`` is set when every sample has
    exactly those extensions in that order (the common case, which enables column-wise work).
    """

    keys: list[bytes]
    """per sample: the UTF-8 key"""
    nmem: np.ndarray
    """per sample: number of members (int64)"""
    exts: list[bytes]
    """per member: the extension"""
    datas: list[Any]
    """per member: the bytes-like content"""
    sizes: np.ndarray
    """per member: content bytes (int64)"""
    hlens: np.ndarray
    """per member: header bytes (512, or more for a PAX header)"""
    schema: tuple[bytes, ...] | None = None

    @classmethod
    def build(
        cls,
        keys: list[bytes],
        nmem: np.ndarray,
        exts: list[bytes],
        datas: list[Any],
        schema: tuple[bytes, ...] | None = None,
        *,
        all_bytes: bool = False,
    ) -> MemberBatch:
        """``all_bytes``: the caller checked that every data is ``bytes`` (len is its size)."""
        m = len(datas)
        sizes = np.fromiter(map(len if all_bytes else buffer_nbytes, datas), np.int64, m)
        klen = np.repeat(np.fromiter(map(len, keys), np.int64, len(keys)), nmem)
        elen = np.fromiter(map(len, exts), np.int64, m)
        hlens = np.full(m, _BLOCK, np.int64)
        long = (klen + 1 + elen > 100) | (sizes > _MAX_USTAR_SIZE)
        if long.any():
            names = cls(keys, nmem, exts, datas, sizes, hlens).names()
            for j in np.flatnonzero(long).tolist():
                hlens[j] = len(tar_header(names[j].decode(), int(sizes[j])))
        return cls(keys, nmem, exts, datas, sizes, hlens, schema)

    @classmethod
    def from_samples(cls, samples: Iterable[tuple[str, Sequence[tuple[str, Any]]]]) -> MemberBatch:
        """From ``[(key, [(ext, bytes-like), ...]), ...]`` (one Python step per member)."""
        keys: list[bytes] = []
        nmem: list[int] = []
        exts: list[bytes] = []
        datas: list[Any] = []
        for key, members in samples:
            keys.append(key.encode())
            nmem.append(len(members))
            for ext, data in members:
                exts.append(ext.encode())
                datas.append(data)
        return cls.build(keys, np.asarray(nmem, np.int64), exts, datas)

    def __len__(self) -> int:
        return len(self.keys)

    def names(self) -> list[bytes]:
        """Per member: ``<key>.<ext>``."""
        per_member = (
            k for k, n in zip(self.keys, self.nmem.tolist(), strict=True) for _ in range(n)
        )
        return [k + b"." + e for k, e in zip(per_member, self.exts, strict=True)]

    def tar_bytes(self) -> np.ndarray:
        """Per sample: bytes it occupies in a tar (headers, data, padding)."""
        per_member = self.hlens + self.sizes + (-self.sizes % _BLOCK)
        if self.schema is not None:
            return per_member.reshape(len(self.keys), len(self.schema)).sum(axis=1)
        out = np.zeros(len(self.keys), np.int64)
        np.add.at(out, np.repeat(np.arange(len(self.keys)), self.nmem), per_member)
        return out

    def slice(self, a: int, b: int) -> MemberBatch:
        """Samples ``a:b``."""
        if a == 0 and b == len(self.keys):
            return self
        starts = np.concatenate(([0], np.cumsum(self.nmem)))
        ma, mb = int(starts[a]), int(starts[b])
        return MemberBatch(
            self.keys[a:b],
            self.nmem[a:b],
            self.exts[ma:mb],
            self.datas[ma:mb],
            self.sizes[ma:mb],
            self.hlens[ma:mb],
            self.schema,
        )


_INLINE = 1024  # members up to this size are copied next to their header (fewer buffers)


def tar_pieces(b: MemberBatch, pos: int) -> tuple[list[Any], np.ndarray, int]:
    """The tar bytes of a batch starting at offset ``pos``, as buffers to write in order.

    Returns ``(buffers, data offsets of the members, total bytes)``. Large members are
    referenced, not copied; everything else (headers, small members, zero padding) is laid
    out in one array of 512-byte blocks, so a shard is written with a few gather writes and
    each byte is copied once. Every header and small member starts a block, as in the tar
    itself; after each large member one extra zero block supplies its padding (its tail is
    the start of the next buffer), which keeps every header block-aligned in the array.
    """
    m = len(b.datas)
    sizes, hlens = b.sizes, b.hlens
    big = sizes > _INLINE
    hblocks = hlens // _BLOCK
    dblocks = np.where(big, 0, -(-sizes // _BLOCK))
    after_big = np.zeros(m, np.int64)
    after_big[1:] = big[:-1]
    nblocks = after_big + hblocks + dblocks
    first = np.cumsum(nblocks) - nblocks  # each member's first block in the array
    hrow = first + after_big
    total_rows = int(first[-1] + nblocks[-1]) + int(big[-1]) if m else 0
    blocks = np.zeros((total_rows, _BLOCK), np.uint8)
    ustar = hblocks == 1
    if ustar.all():
        _put_ustar_headers(blocks, hrow, b, slice(None))
    else:
        _put_ustar_headers(blocks, hrow[ustar], b, np.flatnonzero(ustar))
        names = b.names()
        for j in np.flatnonzero(~ustar).tolist():
            h = np.frombuffer(tar_header(names[j].decode(), int(sizes[j])), np.uint8)
            blocks[hrow[j] : hrow[j] + hblocks[j]] = h.reshape(-1, _BLOCK)
    flat = blocks.reshape(-1)
    small = np.flatnonzero(~big & (sizes > 0))
    if small.size:
        raw = b"".join(map(b.datas.__getitem__, small.tolist()))
        flat[concat_ranges((hrow[small] + hblocks[small]) * _BLOCK, sizes[small])] = np.frombuffer(
            raw, np.uint8
        )
    large = np.flatnonzero(big)
    pads = -sizes[large] % _BLOCK
    ends = (hrow[large] + hblocks[large]) * _BLOCK  # a large member's data follows its header
    # after large member j: its padding is the tail of the extra block opening member j+1
    nxt = np.append(first, total_rows - 1)[large + 1]
    starts = np.concatenate(([0], (nxt + 1) * _BLOCK - pads)).tolist()
    stops = [*ends.tolist(), total_rows * _BLOCK]
    mv: memoryview = flat.data
    pieces: list[Any] = [None] * (2 * large.size + 1)
    pieces[0::2] = list(map(mv.__getitem__, map(slice, starts, stops)))
    pieces[1::2] = list(map(b.datas.__getitem__, large.tolist()))
    tar_sizes = hlens + sizes + (-sizes % _BLOCK)
    data_off = pos + np.cumsum(tar_sizes) - tar_sizes + hlens
    return pieces, data_off, int(tar_sizes.sum())


class IndexedFileWriter:
    """A data file plus its index, published with the commit protocol both shard kinds use.

    Data goes to a temporary sibling through a :class:`HashingWriter` (checksum computed
    while writing); :meth:`_publish` fsyncs it, renames it into place and only then writes
    the index atomically, so an index exists only next to a complete data file and names
    its checksum. A full disk becomes a RuntimeError naming the file, the temporary file is
    removed, and the published path is never left half-written.
    """

    def __init__(self, path: str, index_path: str, *, fsync: bool = True) -> None:
        self.path = path
        self.index_path = index_path
        self._tmp = temp_sibling(path)
        self._w = HashingWriter(self._tmp, fsync=fsync)
        self._fsync = fsync
        self._done = False

    def _disk_full(self, path: str, e: OSError) -> RuntimeError:
        return RuntimeError(
            f"{path}: disk full after writing {self._w.size} bytes "
            f"({os.strerror(e.errno or 0)}); free space on "
            f"{os.path.dirname(os.path.abspath(path))} or write elsewhere, then re-run the "
            "same command to resume"
        )

    def _write(self, data: Any) -> None:
        self._write_many([data])

    def _write_many(self, bufs: list[Any]) -> None:
        try:
            if len(bufs) == 1:
                self._w.write(bufs[0])
            else:
                self._w.writev(bufs)
        except OSError as e:
            self.abort()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._disk_full(self.path, e) from e
            raise

    def _publish(self, index: bytes) -> None:
        try:
            self._w.close()
            os.replace(self._tmp, self.path)
            self._done = True
            atomic_write_bytes(self.index_path, index, fsync=self._fsync)
        except OSError as e:
            self.abort()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._disk_full(self.index_path if self._done else self.path, e) from e
            raise

    @property
    def size(self) -> int:
        return self._w.size

    @property
    def checksum(self) -> str:
        return str(self._w.digest)

    def abort(self) -> None:
        """Drop the temporary file; the published path is left untouched."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):
            self._w.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.abort()


class TarShardWriter(IndexedFileWriter):
    """Writes one tar shard and its ``.idx``; :meth:`commit` publishes both.

    Samples arrive in column batches (:class:`MemberBatch`); headers come from a template
    (vectorized per batch) and everything is written with gather writes and hashed as it is
    written (no second read); see :class:`IndexedFileWriter` for the commit order that makes
    a stale or partial shard detectable.
    """

    _BATCH = 1024

    def __init__(self, path: str, *, fsync: bool = True) -> None:
        super().__init__(path, path + INDEX_SUFFIX, fsync=fsync)
        self._pos = 0
        self._keys: list[bytes] = []
        self._nmem: list[np.ndarray] = []
        self._exts: list[bytes] = []
        self._offs: list[np.ndarray] = []
        self._sizes: list[np.ndarray] = []
        self._hashes: list[np.ndarray] = []
        self._finished = False

    def add(self, key: str, members: Sequence[tuple[str, Any]]) -> None:
        """Append one sample: ``members`` is ``[(ext, bytes-like), ...]`` in tar order."""
        self.add_many(((key, members),))

    def add_many(self, samples: Iterable[tuple[str, Sequence[tuple[str, Any]]]]) -> None:
        """Append samples ``[(key, [(ext, bytes-like), ...]), ...]`` in order."""
        it = iter(samples)
        while chunk := list(itertools.islice(it, self._BATCH)):
            self.add_batch(MemberBatch.from_samples(chunk))

    def add_batch(self, b: MemberBatch) -> None:
        """Append a batch of samples in order."""
        if self._finished:
            raise RuntimeError(f"{self.path}: shard already finished; start a new writer")
        if not len(b):
            return
        pieces, offs, n = tar_pieces(b, self._pos)
        self._write_many(pieces)
        self._pos += n
        self._keys.extend(b.keys)
        self._nmem.append(b.nmem)
        self._exts.extend(b.exts)
        self._offs.append(offs)
        self._sizes.append(b.sizes)
        # per-member checksums for the index (T-NO-WRONG-BYTE); the bytes are hot in cache
        self._hashes.append(member_digests(b.datas))

    @property
    def bytes_written(self) -> int:
        return self._pos

    @property
    def num_samples(self) -> int:
        return len(self._keys)

    def finish(self) -> None:
        """Write the end-of-archive blocks; no sample can be added after this."""
        if self._finished:
            return
        end = tar_end_bytes(self._pos)
        self._write(_ZEROS[:end])
        self._pos += end
        self._finished = True

    def commit(self) -> tuple[int, str, bytes]:
        """Finish, fsync and publish; returns ``(tar_bytes, tar_checksum, index_bytes)``."""
        self.finish()

        def cat(parts: list[np.ndarray]) -> list[int]:
            return np.concatenate(parts).tolist() if parts else []

        raw = ShardIndex.from_arrays(
            self._keys,
            cat(self._nmem),
            self._exts,
            cat(self._offs),
            cat(self._sizes),
            self._pos,
            self._w.digest,
            np.concatenate(self._hashes) if self._hashes else np.zeros(0, np.uint64),
        ).to_bytes()
        self._publish(raw)
        return self.size, self.checksum, raw


def tar_checksum(batches: Iterable[MemberBatch]) -> tuple[int, str]:
    """``(bytes, checksum)`` of the shard :class:`TarShardWriter` would write from these
    batches, computed without writing (to decide whether a committed shard can be kept)."""
    h = hasher()
    pos = 0
    for b in batches:
        if len(b):
            pieces, _, n = tar_pieces(b, pos)
            collections.deque(map(h.update, pieces), maxlen=0)
            pos += n
    end = tar_end_bytes(pos)
    h.update(_ZEROS[:end])
    return pos + end, str(h.hexdigest())
