"""The node cache's shared table of units, ``<cache_dir>/.index``, and its fixed names.

``.index`` holds a header (magic, generation, count, xxh64 of the records) and one record per
cached unit of int64: (dataset id, shard, bytes, state, stamp). State 1 = ready (verified;
``stamp`` says which files were verified: a hash of their device, inode, size and mtime),
2 = reserved (a download in progress; its bytes count before they are written), 3 = found
(files on disk not yet verified: counted, never read before :func:`~.fetch.check_files`),
4 = indexed (the shard was evicted, its index file kept: verified, ``bytes`` and ``stamp``
those of the index alone; not ready - fetching the unit again downloads only its shard).
Every read-modify-write happens under ``flock(<cache_dir>/.lock)``; a missing or damaged
index is rebuilt from the directories (every complete unit then "found", an index file
alone deleted). Everything here is a fixed name in a private directory: opened without
following a symlink, created 0600.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import xxhash

from unbroken.common.fs import close_lock_fd, open_lock_fd, open_private, temp_sibling
from unbroken.data.manifest import MAX_MANIFEST_BYTES, DatasetManifest, read_bounded
from unbroken.data.stream.remote.locks import flock_within

__all__ = [
    "FOUND",
    "INDEXED",
    "READY",
    "RECORD_BYTES",
    "RESERVED",
    "SharedIndex",
    "dir_id",
    "dir_name",
    "load_manifest",
    "pack_index",
    "read_private",
    "stamp",
    "unpack_index",
    "write_private",
]

log = logging.getLogger(__name__)

_MAGIC = b"UBCACHE3"  # 2: records carry a file stamp; a state "found" (issue 20); 3: "indexed"
# Read as well: its records mean the same here. Written as 3 only: an older version would
# take an indexed record for a whole unit and count too few bytes for it; it rebuilds instead.
_OLDER = b"UBCACHE2"
HEADER = 32  # magic, generation, count, xxh64 of the records
_COLS = 5
RECORD_BYTES = 8 * _COLS
READY, RESERVED, FOUND, INDEXED = 1, 2, 3, 4


def pack_index(gen: int, rec: np.ndarray) -> bytes:
    body = np.ascontiguousarray(rec, dtype=np.int64).reshape(-1, _COLS).tobytes()
    head = np.array([gen, len(body) // RECORD_BYTES, xxhash.xxh64_intdigest(body) >> 1])
    return _MAGIC + head.astype(np.int64).tobytes() + body


def unpack_index(data: bytes) -> tuple[int, np.ndarray] | None:
    """(generation, records), or None for anything but a whole, intact index."""
    if len(data) < HEADER or data[:8] not in (_MAGIC, _OLDER):
        return None
    gen, n, digest = np.frombuffer(data[8:HEADER], dtype=np.int64).tolist()
    body = data[HEADER:]
    if n < 0 or len(body) != n * RECORD_BYTES or xxhash.xxh64_intdigest(body) >> 1 != digest:
        return None
    return gen, np.frombuffer(body, dtype=np.int64).reshape(n, _COLS).copy()


def stamp(files: list[tuple[str, int]]) -> int:
    """What a unit's files are now, as one positive int64: a hash of (device, inode, size,
    mtime) of each; 0 when one is missing, not a regular file or not of its recorded size.
    A file replaced or written since it was verified has another stamp."""
    parts = []
    for path, size in files:
        try:
            st = os.lstat(path)
        except OSError:
            return 0
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return 0
        parts += [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    return (xxhash.xxh64_intdigest(struct.pack(f"<{len(parts)}Q", *parts)) >> 1) or 1


def read_private(path: str, limit: int | None = None) -> bytes:
    """The bytes of a fixed name in the cache (no symlink followed), up to ``limit``."""
    fd = open_private(path, os.O_RDONLY)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read() if limit is None else read_bounded(f, limit)
    finally:
        os.close(fd)


def write_private(path: str, data: bytes) -> None:
    """Publish ``data`` at ``path`` atomically, mode 0600 (a temporary sibling, renamed)."""
    tmp = temp_sibling(path)
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load_manifest(local: str) -> DatasetManifest:
    """The manifest copy in a dataset directory of the cache."""
    path = os.path.join(local, "dataset.json")
    return DatasetManifest.parse(read_private(path, MAX_MANIFEST_BYTES + 1), source=path)


def dir_name(dir_id: int) -> str:
    return f"{dir_id & (2**64 - 1):016x}"


def dir_id(fingerprint: str) -> int:
    """The int64 id of a dataset directory (the first 16 hex digits of its fingerprint)."""
    return int(np.array([int(fingerprint[:16], 16)], dtype=np.uint64).view(np.int64)[0])


class _ProcessLock:
    """One ``.lock`` descriptor and one thread lock per (process, cache directory), shared by
    every object of this process that opens the cache: ``flock`` locks belong to an open file
    description, so two descriptors of one process on the same ``.lock`` exclude each other,
    and one object waiting for another object's lock of the same process never ends."""

    def __init__(self, path: str) -> None:
        self.pid = os.getpid()
        self.rlock = threading.RLock()
        self.fd = open_lock_fd(path)
        self.depth = 0  # nested holds by the thread that has the rlock: flock once


_PROCESS_LOCKS: dict[str, _ProcessLock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


def _process_lock(path: str) -> _ProcessLock:
    key = os.path.abspath(path)  # not realpath: a symlink planted at .lock must be refused
    with _PROCESS_LOCKS_GUARD:
        pl = _PROCESS_LOCKS.get(key)
        if pl is None or pl.pid != os.getpid():  # first use here, or after a fork
            pl = _PROCESS_LOCKS[key] = _ProcessLock(key)
        return pl


class SharedIndex:
    """``<cache_dir>/.index`` read and written under ``<cache_dir>/.lock`` (see the module
    docstring); ``rebuild()`` makes the records when it is missing or damaged."""

    def __init__(self, cache_dir: str, timeout: float, rebuild: Callable[[], np.ndarray]) -> None:
        self.cache_dir = cache_dir
        self.path = os.path.join(cache_dir, ".index")
        self.timeout = timeout
        self._rebuild = rebuild
        self._pid = -1  # per process (rebuilt after a fork): the descriptor and stamps below
        self._gen_fd = -1
        self._stamps: dict[tuple[int, int], int] = {}
        self._stamps_gen = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_stamps": {}}

    def _here(self) -> None:
        if self._pid != os.getpid():  # first use in this process
            self._gen_fd, self._stamps, self._stamps_gen = -1, {}, -1
            self._pid = os.getpid()

    @contextlib.contextmanager
    def locked(self) -> Iterator[tuple[int, np.ndarray]]:
        """(generation, records) under the node-wide lock; write them back with
        :meth:`write` inside the block."""
        self._here()
        pl = _process_lock(os.path.join(self.cache_dir, ".lock"))
        deadline = time.monotonic() + self.timeout
        if not pl.rlock.acquire(timeout=self.timeout):
            raise RuntimeError(
                f"{self.cache_dir}/.lock: held by another thread of this process for more "
                f"than {self.timeout:g}s; the cache cannot be updated"
            )
        try:
            left = deadline - time.monotonic()
            if pl.depth == 0 and not flock_within(pl.fd, fcntl.LOCK_EX, left):
                raise RuntimeError(
                    f"{self.cache_dir}/.lock: held by another process for more than "
                    f"{self.timeout:g}s (a reader stopped with SIGSTOP?); the cache "
                    "cannot be updated"
                )
            pl.depth += 1
            try:
                yield self._read()
            finally:
                pl.depth -= 1
                if pl.depth == 0:
                    fcntl.flock(pl.fd, fcntl.LOCK_UN)
        finally:
            pl.rlock.release()

    def _read(self) -> tuple[int, np.ndarray]:
        try:
            data = read_private(self.path)
        except FileNotFoundError:
            data = b""
        got = unpack_index(data)
        if got is None:
            if data:
                log.warning("%s: damaged cache index; rebuilding it from the files", self.path)
            got = (1, self._rebuild())
            self.write(*got)
        return got

    def write(self, gen: int, rec: np.ndarray) -> None:
        data = pack_index(gen, rec)
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)

    def generation(self) -> int:
        """The index's generation (0: no index), read through a descriptor kept per
        process: the index is rewritten in place; one that was removed is opened again."""
        self._here()
        try:
            if self._gen_fd < 0 or os.fstat(self._gen_fd).st_nlink == 0:
                if self._gen_fd >= 0:
                    close_lock_fd(self._gen_fd)
                    self._gen_fd = -1
                self._gen_fd = open_lock_fd(self.path, os.O_RDONLY)
            head = os.pread(self._gen_fd, 16, 0)
        except OSError:
            return 0
        return int.from_bytes(head[8:16], "little") if len(head) == 16 else 0

    def ready_stamps(self) -> dict[tuple[int, int], int]:
        """{(dataset id, shard): stamp} of the ready units, re-read when the index changed
        (its generation, 16 bytes, is read each time; the records only after a change)."""
        gen = self.generation()
        if gen == 0 or gen != self._stamps_gen:
            try:
                snap = unpack_index(read_private(self.path))
            except FileNotFoundError:
                snap = None
            if snap is None:  # missing, or caught mid-write: read it under the lock
                with self.locked() as got:
                    snap = got
            g, rec = snap
            ready = rec[rec[:, 3] == READY]
            self._stamps = {(a, b): c for a, b, c in ready[:, [0, 1, 4]].tolist()}
            self._stamps_gen = g
        return self._stamps
