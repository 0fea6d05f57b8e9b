"""Durable-file primitives shared by the data pipeline and the checkpointer.

One place for: telling a remote URL from a local path, checksums (xxh3-128, fast enough to compute inline at disk speed),
a writer that hashes while it writes, fsync of files *and* directories, and atomic
publication of a file (temp sibling -> write -> fsync -> rename -> fsync dir).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from typing import IO, Any

import xxhash

__all__ = [
    "CHECKSUM_ALGO",
    "HashingWriter",
    "atomic_write",
    "atomic_write_bytes",
    "checksum_bytes",
    "checksum_file",
    "fsync_dir",
    "ensure_out_dir",
    "hasher",
    "is_local_fs",
    "is_remote",
    "is_temp_name",
    "local_path",
    "temp_sibling",
]

CHECKSUM_ALGO = "xxh3_128"
_TEMP_MARK = ".tmp-"
_READ_CHUNK = 16 << 20
_IOV_MAX = 1024  # buffers per writev call (POSIX guarantees at least 16; Linux allows 1024)


_FILE_SCHEME = "file://"


def is_remote(url: str) -> bool:
    """True for a URL only fsspec can open (``s3://b/x``, ``gs://``, ``memory://x``); False
    for a plain path and for ``file://`` (a local path spelled as a URL)."""
    return "://" in url and not url.startswith(_FILE_SCHEME)


def local_path(url: str) -> str:
    """``file:///mnt/x`` -> ``/mnt/x``; a plain path is returned as is. The caller checks
    :func:`is_remote` first: a remote URL has no local path."""
    return url.removeprefix(_FILE_SCHEME)


def is_local_fs(fs: Any) -> bool:
    """Whether an fsspec filesystem (from ``fsspec.core.url_to_fs``) is the local disk or a
    mount, where ``os`` calls, in-kernel copies and rename-to-publish apply."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def hasher() -> Any:
    """A fresh incremental hasher for :data:`CHECKSUM_ALGO`."""
    return xxhash.xxh3_128()


def checksum_bytes(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def checksum_file(path: str, chunk: int = _READ_CHUNK) -> tuple[int, str]:
    """Return ``(size, hexdigest)`` of a local file, read in large chunks."""
    h = hasher()
    size = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems (e.g. certain FUSE mounts) refuse dir fsync
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def temp_sibling(path: str) -> str:
    """A unique temporary name next to ``path`` (same directory, so rename is atomic)."""
    d, base = os.path.split(path)
    return os.path.join(d, f"{_TEMP_MARK}{base}.{uuid.uuid4().hex[:8]}")


def is_temp_name(name: str) -> bool:
    return name.startswith(_TEMP_MARK)


class HashingWriter:
    """A binary file writer that computes size and checksum of everything written.

    The checksum is computed from the caller's buffer as it is written, never by a second
    read of the file. ``close()`` fsyncs when ``fsync=True``.
    """

    def __init__(self, path: str, *, fsync: bool = True) -> None:
        self.path = path
        self._f: IO[bytes] = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()
        self._h = hasher()
        self._fsync = fsync
        self.size = 0
        self.closed = False

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self._h.update(mv)
        n = 0
        while n < len(mv):  # unbuffered writes may be short
            n += self._f.write(mv[n:])
        self.size += n
        return n

    def writev(self, bufs: list[Any]) -> int:
        """Write byte buffers in order with few system calls (gather writes, no joining
        copy); each is hashed as it is. Returns the bytes written."""
        if not hasattr(os, "writev"):
            return sum(self.write(b) for b in bufs)
        collections.deque(map(self._h.update, bufs), maxlen=0)  # hash without a Python loop
        fd = self._f.fileno()
        total = 0
        for i in range(0, len(bufs), _IOV_MAX):
            group = bufs[i : i + _IOV_MAX]
            want = sum(map(len, group))
            n = os.writev(fd, group)
            if n < want:  # a short write: finish this group buffer by buffer
                done = n
                for b in group:
                    mv = memoryview(b).cast("B")
                    if done >= len(mv):
                        done -= len(mv)
                        continue
                    rest = mv[done:]
                    while rest:
                        k = self._f.write(rest)
                        rest = rest[k:]
                    done = 0
            total += want
        self.size += total
        return total

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self._f.fileno()

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    @property
    def digest(self) -> str:
        return self._h.hexdigest()

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._fsync:
                os.fsync(self._f.fileno())
        finally:
            self._f.close()
            self.closed = True

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def atomic_write(path: str, *, fsync: bool = True) -> Iterator[HashingWriter]:
    """Write ``path`` atomically: readers see the old file or the complete new one.

    Yields a :class:`HashingWriter`; after the block its ``size``/``digest`` describe the
    published file. On error the temporary file is removed and ``path`` is untouched.
    """
    tmp = temp_sibling(path)
    w = HashingWriter(tmp, fsync=fsync)
    try:
        yield w
        w.close()
        os.replace(tmp, path)
        if fsync:
            fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        w.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str, data: bytes, *, fsync: bool = True) -> str:
    """Atomically publish ``data`` at ``path``; returns its checksum."""
    with atomic_write(path, fsync=fsync) as w:
        w.write(data)
    return w.digest


def ensure_out_dir(out: str) -> None:
    """Create the output directory; an existing file (or other non-directory) there is an
    error naming it, not a traceback from ``os.makedirs``."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(
            f"{out}: the output path exists and is not a directory; pass a directory (it is "
            "created when missing)"
        )
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{out}: cannot create the output directory ({e.strerror})") from None
