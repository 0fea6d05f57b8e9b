"""Tar shards in WebDataset layout: their per-shard offset index, indexing and the reader.

A shard is a plain (uncompressed) POSIX tar whose members are ``<key>.<ext>``; consecutive
members with the same key form one sample, exactly as ``webdataset`` groups them, so
``webdataset.WebDataset`` reads our shards unchanged and we read theirs.

Beside each shard lies ``<shard>.idx`` (:class:`ShardIndex`, format 2), so that sample
*i* is found in O(1) and read with one ``pread`` of its contiguous byte span
(:class:`ShardReader`, ``read_many`` for a batch), and every member handed out is checked
against its xxh3_64 (T-NO-WRONG-BYTE: a damaged member is a :class:`CorruptSampleError`
naming it). The tar's size and checksum in the index header tie an index to exactly one
shard. Format 1 (no member hashes) still reads, with one warning that its samples are
unverified. The writer lives in :mod:`unbroken.data.tar.writer`.

The index format: ARCHITECTURE.md, "Design notes" > data > shard formats.
"""

from __future__ import annotations

import contextlib
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
import xxhash

from unbroken.common.fs import checksum_bytes, checksum_file
from unbroken.data.manifest import open_regular

__all__ = [
    "INDEX_SUFFIX",
    "CorruptSampleError",
    "ShardError",
    "ShardIndex",
    "ShardReader",
    "cached_fix",
    "corrupt_sample",
    "index_format",
    "index_tar",
    "member_digests",
    "read_index_file",
    "split_member_name",
    "verify_shard",
    "warn_unverified",
]

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".idx"
_MAGIC = b"UBIDX\x02\x00\x00"
_MAGIC_V1 = b"UBIDX\x01\x00\x00"
_HEADER = struct.Struct("<8sQQQQ32s")
_HASH = 8  # bytes of one xxh3_64 (member hashes, the index's own trailer)
_BLOCK = 512
# read_many builds a shard's row table (~25-50 ns per sample of the shard) once the samples
# read without it (~1.5-2.5 us more each) have cost about as much: more than 1/_PLAN_AFTER of
# the shard's samples, and more than _FEW. A first batch touches many shards for a few samples
# each (a resume; each worker's first batch after its fork): none of them is planned for it.
_FEW = 8
_PLAN_AFTER = 64
# webdataset's rule: key = path prefix + basename up to its first dot, ext = the rest.
_NAME_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


class ShardError(ValueError):
    """A shard or index that is truncated, corrupt, mismatched or otherwise unusable."""


class CorruptSampleError(ShardError):
    """A sample whose bytes differ from the checksum recorded when it was packed.

    The message names the dataset (when known), the shard, the sample key and the member (or
    the token block); it is built from the message alone, because torch's DataLoader re-raises
    a worker's exception as ``type(message)``.
    """


def cached_fix(path: str) -> str:
    """What to do about a damaged file in a remote dataset's node cache."""
    return f"delete the cached file {path} (the next read downloads it again, verified)"


def corrupt_sample(
    path: str, what: str, *, dataset: str | None = None, cached: bool = False
) -> CorruptSampleError:
    """The error for damaged bytes: ``what`` is e.g. ``"sample 'k1' member 'jpg'"``;
    ``cached``: ``path`` is a node cache's copy of a remote shard."""
    fix = (
        cached_fix(path)
        if cached
        else "re-copy the shard (`unbroken data stage` re-fetches it) or re-create the dataset"
    )
    where = ""
    if dataset:
        where = f"dataset {dataset}: "
        if os.path.dirname(path) == dataset.rstrip("/"):
            path = os.path.basename(path)
    return CorruptSampleError(
        f"{where}shard {path}: {what} does not match the checksum recorded when it was "
        f"written (the shard is damaged: bit rot, a truncated or overwritten copy); {fix}"
    )


_warned: set[str] = set()


def warn_unverified(what: str, path: str) -> None:
    """One WARNING per ``what`` (a dataset root or a file) and process: its index predates
    per-sample checksums, so its bytes are read unverified."""
    if what in _warned:
        return
    _warned.add(what)
    log.warning(
        "%s: index %s has no per-sample checksums (written by an older unbroken): samples "
        "are read unverified; re-create the indexes (`unbroken data index DIR`, or re-run "
        "`unbroken data pack`/`unbroken data tokenize`) to verify every byte on read",
        what,
        path,
    )


def index_format(head: bytes) -> int:
    """The format of a shard or token index from its first 8 bytes: 1 (no checksums),
    2 (checksums), or 0 (not an unbroken index)."""
    if head[:5] not in (b"UBIDX", b"UBTOK") or head[6:8] != b"\x00\x00":
        return 0
    return {1: 1, 2: 2}.get(head[5], 0)


def member_digests(datas: Iterable[Any], count: int | None = None) -> np.ndarray:
    """xxh3_64 of each bytes-like in ``datas`` (uint64): the checksums the index records.
    ``count``: how many there are, when ``datas`` is an iterator (no list is built)."""
    n = len(datas) if count is None else count  # type: ignore[arg-type]
    return np.fromiter(map(xxhash.xxh3_64_intdigest, datas), np.uint64, n)


def read_index_file(
    path: str, checksum: str | None, *, dataset: str | None = None, cached: bool = False
) -> bytes:
    """The bytes of an index file; with ``checksum`` (dataset.json's ``index_checksum``) they
    must hash to it, so an index edited or swapped after packing is refused by name."""
    with os.fdopen(open_regular(path), "rb") as f:  # a regular file: read() ends at its size
        raw = f.read()
    if checksum is not None:
        got = checksum_bytes(raw)
        if got != checksum:
            where = f"dataset {dataset}: " if dataset else ""
            fix = (
                cached_fix(path)
                if cached
                else "re-copy the dataset or re-create its indexes (`unbroken data index DIR`)"
            )
            raise ShardError(
                f"{where}index {path} ({len(raw)} bytes, checksum {got}) is not the index "
                f"dataset.json records (checksum {checksum}); it is damaged or stale - {fix}"
            )
    return raw


def split_member_name(name: str) -> tuple[str, str] | None:
    """``"a/0001.seg.png" -> ("a/0001", "seg.png")``; None if there is no extension."""
    m = _NAME_RE.match(name)
    return (m.group(1), m.group(2)) if m else None


# --- the index ---------------------------------------------------------------------------


_Ints = Sequence[int] | np.ndarray


@dataclass(frozen=True, eq=False)
class ShardIndex:
    """Offsets of every sample's members in one tar shard (see the module docstring).

    The integer tables are lists when built by a writer and int64 numpy arrays when loaded
    from an index file: read-only views of its bytes (no per-entry Python objects, no copy:
    loading a 64 MB shard's index costs ~0.1 ms, not ~3 ms).
    """

    member_start: _Ints
    key_off: _Ints
    data_offset: _Ints
    data_size: _Ints
    ext_off: _Ints
    strings: bytes
    tar_bytes: int
    tar_checksum: str
    member_hash: np.ndarray | None = None
    """uint64 xxh3_64 of each member's data; None for a format-1 index (unverified)."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardIndex):
            return NotImplemented
        return (
            self.strings == other.strings
            and self.tar_bytes == other.tar_bytes
            and self.tar_checksum == other.tar_checksum
            and (
                self.member_hash is None
                if other.member_hash is None
                else self.member_hash is not None
                and np.array_equal(self.member_hash, other.member_hash)
            )
            and all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(self._tables(), other._tables(), strict=True)
            )
        )

    __hash__ = None  # type: ignore[assignment]

    def _tables(self) -> tuple[_Ints, ...]:
        return (self.member_start, self.key_off, self.data_offset, self.data_size, self.ext_off)

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
        member_hash: np.ndarray | None = None,
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
            member_hash,
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
        member_hash: np.ndarray | None = None,
    ) -> ShardIndex:
        """From flat per-sample and per-member columns (what the writer accumulates);
        ``member_hash``: :func:`member_digests` of the members' data (None: format 1)."""
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
            member_hash=None if member_hash is None else np.asarray(member_hash, np.uint64),
        )

    def to_bytes(self) -> bytes:
        """Format 2, or format 1 for an index without member hashes (see the module doc)."""
        u64 = np.uint64
        head = _HEADER.pack(
            _MAGIC_V1 if self.member_hash is None else _MAGIC,
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
        if self.member_hash is None:
            return b"".join([head, *arrays, self.strings])
        hashes = np.asarray(self.member_hash, dtype="<u8").tobytes()
        body = b"".join([head, *arrays, hashes, self.strings])
        return body + xxhash.xxh3_64_intdigest(body).to_bytes(_HASH, "little")

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str, trusted: bool = False) -> ShardIndex:
        """Parse and validate (format 2 checks its own hash first, then the structure).

        The tables are read-only views of ``data`` (no copy). ``trusted``: ``data`` already
        matched the checksum dataset.json records for it (:func:`read_index_file`), which
        covers every byte, so the index's own hash is not computed again."""
        fix = "rebuild it with `unbroken data index DIR` (or re-copy the dataset)"
        magic = bytes(data[:8])
        if len(data) < _HEADER.size or magic not in (_MAGIC, _MAGIC_V1):
            raise ShardError(
                f"{source}: not an unbroken shard index (bad magic or too short); {fix}"
            )
        hashed = magic == _MAGIC
        if hashed and not trusted:
            body = memoryview(data)[: len(data) - _HASH]
            if xxhash.xxh3_64_intdigest(body) != int.from_bytes(data[-_HASH:], "little"):
                raise ShardError(
                    f"{source}: index checksum does not match its content (damaged or "
                    f"truncated); {fix}"
                )
        _, n, m, s, tar_bytes, chk = _HEADER.unpack_from(data)
        want = _HEADER.size + 8 * (2 * (n + 1) + 2 * m + (m + 1)) + s
        if hashed:
            want += 8 * m + _HASH
        if len(data) != want:
            raise ShardError(
                f"{source}: index is {len(data)} bytes, its header says {want} "
                f"(truncated or damaged); {fix}"
            )
        pos = _HEADER.size
        out: list[np.ndarray] = []
        for count in (n + 1, n + 1, m, m, m + 1):
            raw = np.frombuffer(data, dtype="<u8", count=count, offset=pos)
            if count and int(raw.max()) >= 1 << 63:
                raise ShardError(f"{source}: index holds an offset >= 2**63 (damaged); {fix}")
            out.append(raw.view("<i8"))  # int64 (on any host), a view: no copy to fault in
            pos += 8 * count
        hashes = None
        if hashed:
            hashes = np.frombuffer(data, dtype="<u8", count=m, offset=pos)
            pos += 8 * m
        strings = bytes(data[pos : pos + s])
        ms, ko, do, ds, eo = out
        # Structure a reader relies on: every sample has a member, string offsets ascend
        # inside the string table, member data lies inside the tar, in order. A format-1 index has no
        # hash of its own, so this is all that stands between a damaged one and a reader.
        ok = ms[0] == 0 and ms[-1] == m and not bool((ms[1:] <= ms[:-1]).any())
        ok = ok and ko[0] == 0 and ko[-1] == eo[0] and eo[-1] == s
        ok = ok and not bool((np.diff(ko) < 0).any()) and not bool((np.diff(eo) < 0).any())
        # members lie in the tar in order, so a sample's span (first member's start to last
        # member's end) is never negative
        ok = ok and not bool((np.diff(do) < 0).any())
        # offset <= tar and size <= tar - offset: the sum of two int64s can wrap negative
        tb = min(int(tar_bytes), 2**63 - 1)
        ok = ok and not bool((do > tb).any()) and not bool((ds > tb - do).any())
        if not ok:
            raise ShardError(f"{source}: index tables are inconsistent (damaged); {fix}")
        if not strings.isascii():  # every key and extension must decode on its own
            cuts = np.concatenate((ko, eo[1:])).tolist()
            try:
                for a, b in zip(cuts[:-1], cuts[1:], strict=False):
                    strings[a:b].decode()
            except UnicodeDecodeError:
                raise ShardError(f"{source}: index keys are not UTF-8 (damaged); {fix}") from None
        tar_checksum = chk.decode("ascii", "replace")
        return cls(ms, ko, do, ds, eo, strings, int(tar_bytes), tar_checksum, hashes)

    @classmethod
    def load(cls, path: str) -> ShardIndex:
        with os.fdopen(open_regular(path), "rb") as f:
            return cls.from_bytes(f.read(), source=path)


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
        with (
            os.fdopen(open_regular(path), "rb") as f,
            tarfile.open(fileobj=_Capped(f, size), mode="r:") as tf,
        ):
            for ti in tf:
                if not ti.isreg():
                    continue
                name = ti.name
                try:
                    name.encode()
                except UnicodeEncodeError:  # tarfile keeps undecodable bytes as surrogates
                    raise ShardError(
                        f"{path}: member {ascii(name)} at byte {ti.offset} has a name that is "
                        "not UTF-8; keys must be text - rename it and re-create the tar"
                    ) from None
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
    hashes = np.zeros(0, np.uint64)
    if size:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            mv = memoryview(mm)
            try:
                spans = [mv[o : o + n] for _, ms in samples for _, o, n in ms]
                hashes = member_digests(spans)
            finally:
                del spans
                mv.release()
    return ShardIndex.build(samples, size, digest, hashes)


class _Capped:
    """A file for ``tarfile`` whose ``read(n)`` never asks for more than the bytes left:
    tarfile reads a GNU long name or a PAX record with one read of the size its header
    claims, and a buffered read allocates that size up front (T-BOUNDED)."""

    def __init__(self, f: Any, size: int) -> None:
        self._f, self._size = f, size

    def read(self, n: int = -1) -> bytes:
        left = max(self._size - self._f.tell(), 0)
        return bytes(self._f.read(left if n is None or n < 0 else min(n, left)))

    def seek(self, pos: int, whence: int = 0) -> int:
        return int(self._f.seek(pos, whence))

    def tell(self) -> int:
        return int(self._f.tell())

    def write(self, b: bytes) -> int:
        raise OSError("read-only")  # tarfile's file protocol; "r:" never writes

    def close(self) -> None:
        pass  # the caller's ``with`` closes the file


def verify_shard(path: str, index_path: str | None = None, *, checksum: str | None = None) -> None:
    """Full check: the tar's size and checksum match its index (and ``checksum`` if given)."""
    index_path = index_path or path + INDEX_SUFFIX
    idx = ShardIndex.load(index_path)
    size, digest = checksum_file(path)
    if size != idx.tar_bytes or digest != idx.tar_checksum:
        raise ShardError(
            f"{path}: content (size {size}, checksum {digest}) does not match its index "
            f"{index_path} (size {idx.tar_bytes}, checksum {idx.tar_checksum}); the shard is "
            "damaged or the index is stale - re-copy the shard or run `unbroken data index`"
        )
    if checksum is not None and digest != checksum:
        raise ShardError(
            f"{path}: checksum {digest} differs from the manifest's {checksum}; re-copy it"
        )


_HIGH = bytes(range(128, 256))


def _tar_number(field: bytes) -> int:
    """A numeric tar header field: NUL/space-padded octal, or GNU base-256 (raises
    ValueError for anything else) - what ``tarfile`` reads."""
    if field[:1] in (b"\x80", b"\xff"):
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0xFF else n
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _header_size(block: bytes) -> int | None:
    """The size field of a tar header block whose checksum holds (as ``tarfile`` accepts it:
    unsigned or signed byte sum); None for anything else. Parses only those two fields:
    ``TarInfo.frombuf`` parses every field, 3x the time of a shard's other opening checks."""
    if len(block) != _BLOCK:
        return None
    try:
        chk, size = _tar_number(block[148:156]), _tar_number(block[124:136])
    except ValueError:
        return None
    unsigned = 256 + sum(block) - sum(block[148:156])
    signed = unsigned - 256 * (_BLOCK - len(block.translate(None, _HIGH)))
    return size if chk in (unsigned, signed) else None


# --- reading -------------------------------------------------------------------------------


class ShardReader:
    """Read one tar shard: ``reader[i]`` in O(1) via the index, or iterate sequentially.

    A sample is ``{"__key__": key, ext: bytes, ...}``. Without an index file the tar is
    scanned once on open (as ``unbroken data index`` would). Opening checks the index against the
    shard's size and the tar headers of its first and last members, so a mismatched index
    fails loudly instead of returning garbage; :meth:`verify` checks every byte of the file.

    With ``verify`` (default) every member handed out is checked against the index's
    checksum for it (:class:`CorruptSampleError` names shard, key and member); an index of
    format 1 has none and is read unverified, with one WARNING. ``index_checksum`` (what
    dataset.json records) refuses an index that is not the recorded one; ``dataset`` names
    the dataset in errors and keys that warning; ``cached``: the files are a node cache's
    copies (an error then says to delete them).
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
        if index_path is None:
            cand = path + INDEX_SUFFIX
            index_path = cand if os.path.exists(cand) else None
        self.index_path = index_path
        if index_path is None:
            log.warning("%s: no index file; scanning the tar (run `unbroken data index`)", path)
            self.index = index_tar(path)
        else:
            checked = index_checksum if verify else None
            raw = read_index_file(index_path, checked, dataset=dataset, cached=cached)
            self.index = ShardIndex.from_bytes(raw, source=index_path, trusted=checked is not None)
        self._init = (verify, index_checksum)
        self.verifies = verify and self.index.member_hash is not None
        """whether members are checked on read (``verify`` and an index with checksums)"""
        if verify and not self.verifies:
            warn_unverified(dataset or path, index_path or path)
        self._hashes: list[int] | None = None
        self._lists: tuple[list[int], ...] | None = None
        # read_many's map and row table (made on first use)
        self._mm: mmap.mmap | bytes | None = None
        self._exts: tuple[str, ...] | None = None
        self._text = ""  # uniform layout: the keys, decoded
        # uniform layout, per sample: key start, key end (in `_text`), each member's data
        # start and end, then (verifying) each member's checksum; uint64: tolist() gives ints
        self._rows: np.ndarray | None = None
        self._planned = False
        self._unplanned = 0  # samples read before the table (see _PLAN_AFTER)
        self._fd = open_regular(path)
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
                "truncated - run `unbroken data index` or re-copy the shard"
            )
        m = len(idx.data_offset)
        for j in {0, m - 1} if m else ():
            off = idx.data_offset[j]
            block = os.pread(self._fd, _BLOCK, off - _BLOCK) if off >= _BLOCK else b""
            ok = _header_size(block) == idx.data_size[j]
            if not ok:
                s = int(np.searchsorted(np.asarray(idx.member_start), j, side="right")) - 1
                raise ShardError(
                    f"{self.path}: member {idx.key(s)}.{idx.ext(j)} is not where the index "
                    f"{self.index_path} says (offset {off}); the index does not match this "
                    "shard - run `unbroken data index` or re-copy both files"
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
        start, end = (int(x) for x in self.index.span(i))
        data = os.pread(self._fd, end - start, start)
        if len(data) != end - start:
            raise ShardError(
                f"{self.path}: short read of sample {self.index.key(i)!r} (the file shrank); "
                "re-copy the shard"
            )
        return self._sample(self._tables(), i, data, start)

    def _tables(self) -> tuple[list[int], ...]:
        # Python ints for per-sample loops (indexing a numpy array per field costs more);
        # made on first use, so opening a shard stays cheap.
        if self._lists is None:
            self._lists = tuple(
                x.tolist() if isinstance(x, np.ndarray) else list(x) for x in self.index._tables()
            )
            if self.verifies and self.index.member_hash is not None:
                self._hashes = self.index.member_hash.tolist()
        return self._lists

    def _sample(self, t: tuple[list[int], ...], i: int, data: Any, base: int) -> dict[str, Any]:
        ms, ko, off, size, eo = t
        strings, hashes = self.index.strings, self._hashes
        key = strings[ko[i] : ko[i + 1]].decode()
        out: dict[str, Any] = {"__key__": key}
        bad = None
        with memoryview(data) as mv:  # released before raising: the caller closes its mmap
            for j in range(ms[i], ms[i + 1]):
                a = off[j] - base
                ext = strings[eo[j] : eo[j + 1]].decode()
                v = bytes(mv[a : a + size[j]])
                if len(v) != size[j] or (
                    hashes is not None and xxhash.xxh3_64_intdigest(v) != hashes[j]
                ):
                    bad = ext
                    break
                out[ext] = v
        if bad is not None:
            raise corrupt_sample(
                self.path,
                f"sample {key!r} member {bad!r}",
                dataset=self.dataset,
                cached=self.cached,
            )
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """All samples in order, reading the file front to back through one mmap."""
        n = self.index.num_samples
        if n == 0:
            return
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_SEQUENTIAL)
            t = self._tables()
            for i in range(n):
                yield self._sample(t, i, mm, 0)

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

    # --- many samples at once, through a map of the shard (the dataset's read path) -----

    def _map(self) -> mmap.mmap | bytes:
        """The shard mapped read-only (made on first use; b"" for an empty file)."""
        if self._mm is None:
            size = os.fstat(self._fd).st_size
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ) if size else b""
        return self._mm

    def _plan_rows(self) -> None:
        """Decide the layout and build the row table (or, for any other layout, the index as
        lists): 0.3-1 ms for a shard of 11k samples, made once the reads without it have cost
        about as much (``_PLAN_AFTER``)."""
        self._planned = True
        idx = self.index
        ms = np.asarray(idx.member_start, dtype=np.int64)
        eo = np.asarray(idx.ext_off, dtype=np.int64)
        n = ms.size - 1
        k = int(ms[1]) if n > 0 else 0
        if k > 0 and bool((np.diff(ms) == k).all()):
            first = self.index.strings[eo[0] : eo[k]]
            lens = np.diff(eo).reshape(n, k)
            if self.index.strings[eo[0] :] == first * n and bool((lens == lens[0]).all()):
                self._exts = tuple(self.index.strings[eo[j] : eo[j + 1]].decode() for j in range(k))
                ko = np.asarray(idx.key_off, dtype=np.int64)
                # Keys are sliced from one str (one object per key instead of a bytes slice
                # and its decode): offsets in characters, i.e. bytes minus the UTF-8
                # continuation bytes before them (ShardIndex checked that every key decodes).
                keys = self.index.strings[: int(ko[-1])]
                self._text = keys.decode()
                if not keys.isascii():
                    cont = (np.frombuffer(keys, np.uint8) & 0xC0) == 0x80
                    ko = ko - np.concatenate(([0], np.cumsum(cont)))[ko]
                off = np.asarray(idx.data_offset, dtype=np.int64).reshape(n, k)
                rows = np.empty((n, 2 + 2 * k + (k if self.verifies else 0)), dtype=np.uint64)
                rows[:, 0] = ko[:-1]
                rows[:, 1] = ko[1:]
                rows[:, 2 : 2 + 2 * k : 2] = off
                rows[:, 3 : 2 + 2 * k : 2] = off + np.asarray(idx.data_size).reshape(n, k)
                if self.verifies:
                    rows[:, 2 + 2 * k :] = np.asarray(idx.member_hash).reshape(n, k)
                self._rows = rows
                return
        self._tables()  # Python ints for _read_any's per-member lookups

    def read_many(self, local: np.ndarray, *, skip: bool = False) -> list[Any]:  # noqa: C901 - the hot path, kept in one frame
        """Samples ``local`` of this shard (indexes, in the order given), as ``self[i]``
        gives them, with every member a slice of a map of the shard: no syscall, no tar
        parsing (slicing costs ~1 us where a ``pread`` per sample costs several, most of a
        DataLoader worker's time at 4 KB samples). A damaged sample raises
        :class:`CorruptSampleError` naming its first damaged member; with ``skip`` it is
        logged and None takes its place.

        When every sample has the same extensions in the same order (the usual case), their
        names are decoded once and one row per sample - key span, each member's data span
        and, when verifying, each member's xxh3_64 - is gathered for a whole group with a
        single numpy indexing; each member is hashed right after it is sliced, in the same
        loop (a separate pass cost as much again as the hashing; measured in RESULTS.md)."""
        rows, exts = self._rows, self._exts
        if rows is None or exts is None:
            if not self._planned:
                self._unplanned += len(local)
                if self._unplanned > max(_FEW, self.index.num_samples // _PLAN_AFTER):
                    self._plan_rows()
                    return self.read_many(local, skip=skip)
            return self._read_any(local.tolist(), skip)
        mm, text, h = self._map(), self._text, xxhash.xxh3_64_intdigest
        out: list[Any] = []
        bad: list[int] = []  # positions in `out` whose bytes do not match their checksums
        if not self.verifies and len(exts) <= 2:
            if len(exts) == 1:
                (x,) = exts
                for a, b, o, e in rows.take(local, 0).tolist():
                    out.append({"__key__": text[a:b], x: mm[o:e]})
            else:
                x, y = exts
                for a, b, o, e, p, q in rows.take(local, 0).tolist():
                    out.append({"__key__": text[a:b], x: mm[o:e], y: mm[p:q]})
        elif len(exts) == 1:
            (x,) = exts
            for a, b, o, e, w in rows.take(local, 0).tolist():
                v = mm[o:e]
                if h(v) != w:
                    bad.append(len(out))
                out.append({"__key__": text[a:b], x: v})
        elif len(exts) == 2:
            x, y = exts
            for a, b, o, e, p, q, w, z in rows.take(local, 0).tolist():
                v, u = mm[o:e], mm[p:q]
                if h(v) != w or h(u) != z:
                    bad.append(len(out))
                out.append({"__key__": text[a:b], x: v, y: u})
        else:
            k = len(exts)
            cols = [(x, 2 + 2 * j, 3 + 2 * j, 2 + 2 * k + j) for j, x in enumerate(exts)]
            verify = self.verifies
            for r in rows.take(local, 0).tolist():
                d: dict[str, Any] = {"__key__": text[r[0] : r[1]]}
                ok = True
                for x, s, t, c in cols:
                    v = d[x] = mm[r[s] : r[t]]
                    if verify and ok and h(v) != r[c]:
                        ok = False
                if not ok:
                    bad.append(len(out))
                out.append(d)
        return self._damaged(out, bad, local, skip) if bad else out

    def _read_any(self, local: list[int], skip: bool) -> list[Any]:
        """Any layout: members and extensions looked up per sample."""
        # lists once planned; before, the index's numpy views (a few samples: no tables)
        lists = self._lists
        ms, ko, off, size, eo = lists if lists is not None else self.index._tables()
        hashes = None
        if self.verifies:
            hashes = self._hashes if lists is not None else self.index.member_hash
        mm, strings, h = self._map(), self.index.strings, xxhash.xxh3_64_intdigest
        cache: dict[bytes, str] = {}
        out: list[Any] = []
        bad: list[int] = []
        for i in local:
            d: dict[str, Any] = {"__key__": strings[ko[i] : ko[i + 1]].decode()}
            ok = True
            for j in range(ms[i], ms[i + 1]):
                raw = strings[eo[j] : eo[j + 1]]
                ext = cache.get(raw)
                if ext is None:
                    ext = cache[raw] = raw.decode()
                o = off[j]
                v = d[ext] = mm[o : o + size[j]]
                if hashes is not None and ok and h(v) != hashes[j]:
                    ok = False
            if not ok:
                bad.append(len(out))
            out.append(d)
        return self._damaged(out, bad, local, skip) if bad else out

    def _damaged(self, out: list[Any], bad: list[int], local: Any, skip: bool) -> list[Any]:
        """Raise for the first damaged sample, naming its first damaged member, or (when
        skipping) log each and put None in its place."""
        idx, mm = self.index, self._map()
        for p in bad:
            i = int(local[p])
            a, b = int(idx.member_start[i]), int(idx.member_start[i + 1])
            wrong = [
                idx.ext(j)
                for j in range(a, b)
                if xxhash.xxh3_64_intdigest(
                    mm[int(idx.data_offset[j]) : int(idx.data_offset[j] + idx.data_size[j])]
                )
                != int(idx.member_hash[j])  # type: ignore[index]
            ]
            err = corrupt_sample(
                self.path,
                f"sample {out[p]['__key__']!r} member {wrong[0]!r}"
                if wrong
                else f"sample {out[p]['__key__']!r} (its bytes changed while it was read)",
                dataset=self.dataset,
                cached=self.cached,
            )
            if not skip:
                raise err
            log.warning("%s; skipped (on_corrupt='skip')", err)
            out[p] = None
        return out

    def close(self) -> None:
        if isinstance(self._mm, mmap.mmap):
            self._mm.close()
        self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # The shard's descriptor is a bare int (os.open, for pread): nothing else closes it
        # when a dataset drops its readers, and a long-lived process would collect one per
        # shard it ever read. Not set when __init__ failed before opening.
        if getattr(self, "_fd", -1) >= 0:
            with contextlib.suppress(Exception):
                self.close()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # An fd does not survive pickling into a DataLoader worker; reopen there.
        verify, index_checksum = self._init
        return {
            "path": self.path,
            "index_path": self.index_path,
            "verify": verify,
            "index_checksum": index_checksum,
            "dataset": self.dataset,
            "cached": self.cached,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["path"],
            state["index_path"],
            verify=state.get("verify", True),
            index_checksum=state.get("index_checksum"),
            dataset=state.get("dataset"),
            cached=state.get("cached", False),
        )
