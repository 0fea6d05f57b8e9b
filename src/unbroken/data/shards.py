"""Tar shards in WebDataset layout, their per-shard offset index, a fast writer and a reader.

A shard is a plain (uncompressed) POSIX tar whose members are ``<key>.<ext>``; consecutive
members with the same key form one sample, exactly as ``webdataset`` groups them, so
``webdataset.WebDataset`` reads our shards unchanged and we read theirs.

Beside each shard lies ``<shard>.idx``, a little-endian binary offset index (all integers
unsigned 64-bit)::

    header (72 bytes): magic b"UBIDX\\x01\\x00\\x00", num_samples N, num_members M,
                       strings_bytes S, tar_bytes, tar checksum (32 ASCII hex, xxh3_128)
    member_start[N+1]  first member of sample i is member_start[i]
    key_off[N+1]       key of sample i is strings[key_off[i]:key_off[i+1]] (UTF-8)
    data_offset[M]     byte offset of member j's data inside the tar
    data_size[M]       byte length of member j's data
    ext_off[M+1]       extension of member j is strings[ext_off[j]:ext_off[j+1]]
    strings[S]

so sample *i* is found in O(1) and read with one ``pread`` of its contiguous byte span.
The tar size and checksum in the header tie an index to exactly one shard.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import mmap
import os
import re
import struct
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from unbroken._fs import (
    HashingWriter,
    atomic_write_bytes,
    checksum_file,
    temp_sibling,
)

__all__ = [
    "INDEX_SUFFIX",
    "IndexedFileWriter",
    "ShardError",
    "ShardIndex",
    "ShardReader",
    "TarShardWriter",
    "body_capacity",
    "index_tar",
    "member_tar_bytes",
    "sample_tar_bytes",
    "split_member_name",
    "tar_end_bytes",
    "tar_header",
    "verify_shard",
]

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".idx"
_MAGIC = b"UBIDX\x01\x00\x00"
_HEADER = struct.Struct("<8sQQQQ32s")
_BLOCK = 512
_RECORD = 10240  # tarfile pads archives to 20 blocks; we do too, for identical tools' output
_ZEROS = bytes(_RECORD + 2 * _BLOCK)  # the longest run of zeros a shard ends with
_MTIME = 0  # fixed so that the same input gives byte-identical shards
_FLUSH = 8 << 20
# webdataset's rule: key = path prefix + basename up to its first dot, ext = the rest.
_NAME_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


class ShardError(ValueError):
    """A shard or index that is truncated, corrupt, mismatched or otherwise unusable."""


def split_member_name(name: str) -> tuple[str, str] | None:
    """``"a/0001.seg.png" -> ("a/0001", "seg.png")``; None if there is no extension."""
    m = _NAME_RE.match(name)
    return (m.group(1), m.group(2)) if m else None


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


# --- the index ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardIndex:
    """Offsets of every sample's members in one tar shard (see the module docstring)."""

    member_start: Sequence[int]
    key_off: Sequence[int]
    data_offset: Sequence[int]
    data_size: Sequence[int]
    ext_off: Sequence[int]
    strings: bytes
    tar_bytes: int
    tar_checksum: str

    @property
    def num_samples(self) -> int:
        return len(self.member_start) - 1

    def key(self, i: int) -> str:
        return self.strings[self.key_off[i] : self.key_off[i + 1]].decode()

    def ext(self, j: int) -> str:
        return self.strings[self.ext_off[j] : self.ext_off[j + 1]].decode()

    def span(self, i: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` covering all data of sample ``i`` (headers between)."""
        a, b = self.member_start[i], self.member_start[i + 1]
        return self.data_offset[a], self.data_offset[b - 1] + self.data_size[b - 1]

    @classmethod
    def build(
        cls,
        samples: Sequence[tuple[str, Sequence[tuple[str, int, int]]]],
        tar_bytes: int,
        tar_checksum: str,
    ) -> ShardIndex:
        """From ``[(key, [(ext, data_offset, data_size), ...]), ...]``."""
        members = [m for _, ms in samples for m in ms]
        return cls.from_arrays(
            [k.encode() for k, _ in samples],
            [len(ms) for _, ms in samples],
            [e.encode() for e, _, _ in members],
            [o for _, o, _ in members],
            [n for _, _, n in members],
            tar_bytes,
            tar_checksum,
        )

    @classmethod
    def from_arrays(
        cls,
        keys: Sequence[bytes],
        members_per_sample: Sequence[int],
        exts: Sequence[bytes],
        offsets: Sequence[int],
        sizes: Sequence[int],
        tar_bytes: int,
        tar_checksum: str,
    ) -> ShardIndex:
        """From flat per-sample and per-member columns (what the writer accumulates)."""
        # Keys and extensions are stored in two separate runs so that each offset array is
        # monotone and its own sentinel ends the last string.
        kb = b"".join(keys)
        key_off = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, keys), np.int64, len(keys)), out=key_off[1:])
        ext_off = np.full(len(exts) + 1, len(kb), dtype=np.int64)
        ext_off[1:] += np.cumsum(np.fromiter(map(len, exts), np.int64, len(exts)))
        member_start = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(np.asarray(members_per_sample, dtype=np.int64), out=member_start[1:])
        return cls(
            member_start=member_start.tolist(),
            key_off=key_off.tolist(),
            data_offset=list(offsets),
            data_size=list(sizes),
            ext_off=ext_off.tolist(),
            strings=kb + b"".join(exts),
            tar_bytes=tar_bytes,
            tar_checksum=tar_checksum,
        )

    def to_bytes(self) -> bytes:
        u64 = np.uint64
        head = _HEADER.pack(
            _MAGIC,
            self.num_samples,
            len(self.data_offset),
            len(self.strings),
            self.tar_bytes,
            self.tar_checksum.encode().ljust(32, b"0")[:32],
        )
        arrays = [
            np.asarray(a, dtype=u64).astype("<u8", copy=False).tobytes()
            for a in (
                self.member_start,
                self.key_off,
                self.data_offset,
                self.data_size,
                self.ext_off,
            )
        ]
        return b"".join([head, *arrays, self.strings])

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str) -> ShardIndex:
        if len(data) < _HEADER.size or data[:8] != _MAGIC:
            raise ShardError(
                f"{source}: not an unbroken shard index (bad magic or too short); "
                "rebuild it with `unbroken index DIR`"
            )
        _, n, m, s, tar_bytes, chk = _HEADER.unpack_from(data)
        want = _HEADER.size + 8 * (2 * (n + 1) + 2 * m + (m + 1)) + s
        if len(data) != want:
            raise ShardError(
                f"{source}: index is {len(data)} bytes, its header says {want} "
                "(truncated or damaged); rebuild it with `unbroken index DIR`"
            )
        pos = _HEADER.size
        out: list[list[int]] = []
        for count in (n + 1, n + 1, m, m, m + 1):
            out.append(np.frombuffer(data, dtype="<u8", count=count, offset=pos).tolist())
            pos += 8 * count
        strings = bytes(data[pos : pos + s])
        ms, ko, do, ds, eo = out
        if ms[0] != 0 or ms[-1] != m or any(a > b for a, b in zip(ms, ms[1:], strict=False)):
            raise ShardError(f"{source}: index member table is inconsistent; rebuild it")
        return cls(ms, ko, do, ds, eo, strings, int(tar_bytes), chk.decode("ascii", "replace"))

    @classmethod
    def load(cls, path: str) -> ShardIndex:
        with open(path, "rb") as f:
            return cls.from_bytes(f.read(), source=path)


# --- writing -------------------------------------------------------------------------------


def _nbytes(data: Any) -> int:
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
        sizes = np.fromiter(map(_nbytes, datas), np.int64, len(datas))
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


# --- indexing foreign shards -------------------------------------------------------------


def index_tar(path: str) -> ShardIndex:
    """Scan a tar (ours or webdataset's) and build its index, grouping like webdataset.

    Raises :class:`ShardError` naming the file (and member) for a truncated or corrupt tar,
    a compressed one, or a duplicate extension within a sample.
    """
    size = os.path.getsize(path)
    samples: list[tuple[str, list[tuple[str, int, int]]]] = []
    skipped = 0
    try:
        with tarfile.open(path, "r:") as tf:
            for ti in tf:
                if not ti.isreg():
                    continue
                name = ti.name
                if "/" not in name and name.startswith("__") and name.endswith("__"):
                    continue  # webdataset metadata member
                kv = split_member_name(name)
                if kv is None:
                    skipped += 1
                    continue
                key, ext = kv
                if ti.offset_data + ti.size > size:
                    raise ShardError(
                        f"{path}: member {name!r} needs bytes up to {ti.offset_data + ti.size} "
                        f"but the file has {size} (truncated tar); re-create or re-copy it"
                    )
                if samples and samples[-1][0] == key:
                    if any(e == ext for e, _, _ in samples[-1][1]):
                        raise ShardError(
                            f"{path}: sample {key!r} has extension {ext!r} twice; every "
                            "member of a sample needs a distinct extension"
                        )
                    samples[-1][1].append((ext, ti.offset_data, ti.size))
                else:
                    samples.append((key, [(ext, ti.offset_data, ti.size)]))
            end = tf.offset
    except tarfile.TarError as e:
        raise ShardError(
            f"{path}: corrupt, truncated or compressed tar ({e}); shards must be plain "
            "uncompressed tar - re-create or re-copy it"
        ) from None
    with open(path, "rb") as f:
        f.seek(end)
        tail = f.read(_BLOCK)
    if len(tail) < _BLOCK or tail.count(0) != _BLOCK:
        raise ShardError(
            f"{path}: no valid member header or end-of-archive marker at byte {end} (the "
            "tar is truncated or corrupt there); re-create or re-copy it"
        )
    if skipped:
        log.warning("%s: skipped %d members without a <key>.<ext> name", path, skipped)
    _, digest = checksum_file(path)
    return ShardIndex.build(samples, size, digest)


def verify_shard(path: str, index_path: str | None = None, *, checksum: str | None = None) -> None:
    """Full check: the tar's size and checksum match its index (and ``checksum`` if given)."""
    index_path = index_path or path + INDEX_SUFFIX
    idx = ShardIndex.load(index_path)
    size, digest = checksum_file(path)
    if size != idx.tar_bytes or digest != idx.tar_checksum:
        raise ShardError(
            f"{path}: content (size {size}, checksum {digest}) does not match its index "
            f"{index_path} (size {idx.tar_bytes}, checksum {idx.tar_checksum}); the shard is "
            "damaged or the index is stale - re-copy the shard or run `unbroken index`"
        )
    if checksum is not None and digest != checksum:
        raise ShardError(
            f"{path}: checksum {digest} differs from the manifest's {checksum}; re-copy it"
        )


# --- reading -------------------------------------------------------------------------------


class ShardReader:
    """Read one tar shard: ``reader[i]`` in O(1) via the index, or iterate sequentially.

    A sample is ``{"__key__": key, ext: bytes, ...}``. Without an index file the tar is
    scanned once on open (as ``unbroken index`` would). Opening checks the index against the
    shard's size and the tar headers of its first and last members, so a mismatched index
    fails loudly instead of returning garbage; :meth:`verify` checks every byte.
    """

    def __init__(self, path: str, index_path: str | None = None) -> None:
        self.path = path
        if index_path is None:
            cand = path + INDEX_SUFFIX
            index_path = cand if os.path.exists(cand) else None
        self.index_path = index_path
        if index_path is None:
            log.warning("%s: no index file; scanning the tar (run `unbroken index`)", path)
            self.index = index_tar(path)
        else:
            self.index = ShardIndex.load(index_path)
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self._check()
        except BaseException:
            os.close(self._fd)
            raise

    def _check(self) -> None:
        size = os.fstat(self._fd).st_size
        idx = self.index
        if size != idx.tar_bytes:
            raise ShardError(
                f"{self.path}: shard is {size} bytes but its index {self.index_path} describes "
                f"{idx.tar_bytes}; the index belongs to another shard or the shard is "
                "truncated - run `unbroken index` or re-copy the shard"
            )
        m = len(idx.data_offset)
        for j in {0, m - 1} if m else ():
            off = idx.data_offset[j]
            block = os.pread(self._fd, _BLOCK, off - _BLOCK) if off >= _BLOCK else b""
            try:
                ti = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
                ok = ti.size == idx.data_size[j]
            except (tarfile.HeaderError, ValueError):
                ok = False
            if not ok:
                s = int(np.searchsorted(np.asarray(idx.member_start), j, side="right")) - 1
                raise ShardError(
                    f"{self.path}: member {idx.key(s)}.{idx.ext(j)} is not where the index "
                    f"{self.index_path} says (offset {off}); the index does not match this "
                    "shard - run `unbroken index` or re-copy both files"
                )

    def __len__(self) -> int:
        return self.index.num_samples

    def key(self, i: int) -> str:
        return self.index.key(i)

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = self.index.num_samples
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{self.path}: sample {i} out of range (0..{n - 1})")
        start, end = self.index.span(i)
        data = os.pread(self._fd, end - start, start)
        if len(data) != end - start:
            raise ShardError(
                f"{self.path}: short read of sample {self.index.key(i)!r} (the file shrank); "
                "re-copy the shard"
            )
        return self._sample(i, data, start)

    def _sample(self, i: int, data: Any, base: int) -> dict[str, Any]:
        idx = self.index
        out: dict[str, Any] = {"__key__": idx.key(i)}
        mv = memoryview(data)
        for j in range(idx.member_start[i], idx.member_start[i + 1]):
            a = idx.data_offset[j] - base
            out[idx.ext(j)] = bytes(mv[a : a + idx.data_size[j]])
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """All samples in order, reading the file front to back through one mmap."""
        n = self.index.num_samples
        if n == 0:
            return
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_SEQUENTIAL)
            for i in range(n):
                yield self._sample(i, mm, 0)

    def verify(self, checksum: str | None = None) -> None:
        """Read every byte: the shard must match its index (and ``checksum`` if given)."""
        size, digest = checksum_file(self.path)
        if size != self.index.tar_bytes or digest != self.index.tar_checksum:
            raise ShardError(
                f"{self.path}: checksum {digest} does not match its index "
                f"({self.index.tar_checksum}); the shard is damaged - re-copy it"
            )
        if checksum is not None and digest != checksum:
            raise ShardError(f"{self.path}: checksum {digest} != manifest {checksum}; re-copy it")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # An fd does not survive pickling into a DataLoader worker; reopen there.
        return {"path": self.path, "index_path": self.index_path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["index_path"])  # type: ignore[misc]
