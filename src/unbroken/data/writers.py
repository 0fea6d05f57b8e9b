"""Shard writers: the commit protocol shared by tar and token shards, and the tar writer.

:class:`IndexedFileWriter` publishes a data file and then its index (see its docstring);
:class:`TarShardWriter` builds WebDataset-layout tar shards (format and index: see
:mod:`unbroken.data.shards`) with ustar headers byte-equal to :mod:`tarfile`'s, computed for a
whole batch of members at once, plus the size arithmetic ``pack`` uses to plan shards.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import tarfile
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from unbroken._fs import HashingWriter, atomic_write_bytes, temp_sibling
from unbroken.data.shards import INDEX_SUFFIX, ShardIndex

__all__ = [
    "IndexedFileWriter",
    "TarShardWriter",
    "body_capacity",
    "buffer_nbytes",
    "member_tar_bytes",
    "sample_tar_bytes",
    "tar_end_bytes",
    "tar_header",
]

_BLOCK = 512
_RECORD = 10240  # tarfile pads archives to 20 blocks; we do too, for identical tools' output
_ZEROS = bytes(_RECORD + 2 * _BLOCK)  # the longest run of zeros a shard ends with
_MTIME = 0  # fixed so that the same input gives byte-identical shards
_FLUSH = 8 << 20


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
_SHIFT_SIZE = np.arange(30, -1, -3, dtype=np.int64)  # 11 octal digits
_SHIFT_CHK = np.arange(15, -1, -3, dtype=np.int64)  # 6 octal digits


def _headers(names: list[bytes], sizes: np.ndarray) -> tuple[list[Any], np.ndarray]:
    """ustar headers for many members at once, byte-equal to :func:`tar_header`.

    Vectorized with numpy (name, size and checksum fields filled for the whole batch) because
    per-member Python work dominates packing small samples.
    """
    m = len(names)
    arr = np.empty((m, _BLOCK), dtype=np.uint8)
    arr[:] = _TEMPLATE
    lens = np.fromiter(map(len, names), np.int64, m)
    short = (lens <= 100) & (sizes <= _MAX_USTAR_SIZE)
    padded = b"".join(n.ljust(100, b"\0") if len(n) <= 100 else bytes(100) for n in names)
    arr[:, :100] = np.frombuffer(padded, np.uint8).reshape(m, 100)
    arr[:, 124:135] = ((sizes[:, None] >> _SHIFT_SIZE) & 7) + 48
    arr[:, 135] = 0
    chk = arr.sum(axis=1, dtype=np.int64)
    arr[:, 148:154] = ((chk[:, None] >> _SHIFT_CHK) & 7) + 48
    arr[:, 154] = 0
    mv = memoryview(arr.tobytes())
    hdrs: list[Any] = [mv[i * _BLOCK : (i + 1) * _BLOCK] for i in range(m)]
    hlens = np.full(m, _BLOCK, dtype=np.int64)
    for i in np.flatnonzero(~short).tolist():
        hdrs[i] = tar_header(names[i].decode(), int(sizes[i]))
        hlens[i] = len(hdrs[i])
    return hdrs, hlens


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
        try:
            self._w.write(data)
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

    Headers come from a template (vectorized per batch), data is gathered into large writes
    and hashed as it is written (no second read); see :class:`IndexedFileWriter` for the
    commit order that makes a stale or partial shard detectable.
    """

    _BATCH = 1024

    def __init__(self, path: str, *, fsync: bool = True) -> None:
        super().__init__(path, path + INDEX_SUFFIX, fsync=fsync)
        self._buf: list[Any] = []
        self._buffered = 0
        self._pos = 0
        self._keys: list[bytes] = []
        self._nmem: list[int] = []
        self._exts: list[bytes] = []
        self._offs: list[int] = []
        self._sizes: list[int] = []
        self._finished = False

    def add(self, key: str, members: Sequence[tuple[str, Any]]) -> None:
        """Append one sample: ``members`` is ``[(ext, bytes-like), ...]`` in tar order."""
        self.add_many(((key, members),))

    def add_many(self, samples: Iterable[tuple[str, Sequence[tuple[str, Any]]]]) -> None:
        """Append samples ``[(key, [(ext, bytes-like), ...]), ...]`` in order."""
        if self._finished:
            raise RuntimeError(f"{self.path}: shard already finished; start a new writer")
        it = iter(samples)
        while True:
            names: list[bytes] = []
            datas: list[Any] = []
            for key, members in itertools.islice(it, self._BATCH):
                kb = key.encode()
                self._keys.append(kb)
                self._nmem.append(len(members))
                for ext, data in members:
                    eb = ext.encode()
                    self._exts.append(eb)
                    names.append(kb + b"." + eb)
                    datas.append(data)
            if not names:
                return
            self._append(names, datas)

    def _append(self, names: list[bytes], datas: list[Any]) -> None:
        sizes = np.fromiter(map(buffer_nbytes, datas), np.int64, len(datas))
        hdrs, hlens = _headers(names, sizes)
        pads = -sizes % _BLOCK
        totals = hlens + sizes + pads
        ends = self._pos + np.cumsum(totals)
        self._offs.extend((ends - totals + hlens).tolist())
        self._sizes.extend(sizes.tolist())
        buf = self._buf
        for h, d, p in zip(hdrs, datas, pads.tolist(), strict=True):
            buf.append(h)
            buf.append(d)
            if p:
                buf.append(_ZEROS[:p])
        added = int(ends[-1]) - self._pos
        self._pos += added
        self._buffered += added
        if self._buffered >= _FLUSH:
            self._flush()

    @property
    def bytes_written(self) -> int:
        return self._pos

    @property
    def num_samples(self) -> int:
        return len(self._keys)

    def _flush(self) -> None:
        if not self._buf:
            return
        data = b"".join(self._buf)
        self._buf.clear()
        self._buffered = 0
        self._write(data)

    def finish(self) -> None:
        """Write the end-of-archive blocks; no sample can be added after this."""
        if self._finished:
            return
        self._buf.append(_ZEROS[: tar_end_bytes(self._pos)])
        self._pos += tar_end_bytes(self._pos)
        self._flush()
        self._finished = True

    def commit(self) -> tuple[int, str, bytes]:
        """Finish, fsync and publish; returns ``(tar_bytes, tar_checksum, index_bytes)``."""
        self.finish()
        raw = ShardIndex.from_arrays(
            self._keys,
            self._nmem,
            self._exts,
            self._offs,
            self._sizes,
            self._pos,
            self._w.digest,
        ).to_bytes()
        self._publish(raw)
        return self.size, self.checksum, raw
