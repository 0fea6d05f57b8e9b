"""Durable-file primitives shared by the data pipeline and the checkpointer.

One place for: telling a remote URL from a local path, checksums (xxh3-128, fast enough to compute inline at disk speed),
a writer that hashes while it writes (and one that also writes past the page cache,
``O_DIRECT``), fsync of files *and* directories, and atomic publication of a file (temp
sibling -> write -> fsync -> rename -> fsync dir).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any, TypeVar, overload

import xxhash

__all__ = [
    "CHECKSUM_ALGO",
    "DirectWriter",
    "HashingWriter",
    "PrivateDirError",
    "atomic_write",
    "address_of",
    "atomic_write_bytes",
    "checksum_bytes",
    "checksum_file",
    "close_lock_fd",
    "fsync_dir",
    "ensure_out_dir",
    "hasher",
    "is_local_fs",
    "is_remote",
    "is_temp_name",
    "local_path",
    "open_lock_fd",
    "open_private",
    "private_dir",
    "pwrite_all",
    "takes_direct_io",
    "temp_sibling",
]

CHECKSUM_ALGO = "xxh3_128"
_TEMP_MARK = ".tmp-"
_READ_CHUNK = 16 << 20
_IOV_MAX = 1024  # buffers per writev call (POSIX guarantees at least 16; Linux allows 1024)


_FILE_SCHEME = "file://"


_T = TypeVar("_T")


@overload
def path_str(p: os.PathLike[str]) -> str: ...
@overload
def path_str(p: _T) -> _T: ...
def path_str(p: Any) -> Any:
    """``p`` as a string when it is an ``os.PathLike`` (``pathlib.Path``), else unchanged
    (a str, a URL, or a wrong type for the caller's own check to name)."""
    return os.fspath(p) if isinstance(p, os.PathLike) else p


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


_Writer = TypeVar("_Writer", bound="HashingWriter")


class HashingWriter:
    """A binary file writer that computes size and checksum of everything written.

    The checksum is computed from the caller's buffer as it is written, never by a second
    read of the file. ``close()`` fsyncs when ``fsync=True``.
    """

    def __init__(self, path: str, *, fsync: bool = True, mode: int = 0o666) -> None:
        self.path = path
        # O_NOFOLLOW: a symlink planted at the (temporary) name is refused, never written
        # through to wherever it points (T-SHARED-NODE).
        flags = os.O_NOFOLLOW | os.O_CLOEXEC
        self._f: IO[bytes] = open(  # noqa: SIM115 - closed in close()
            path, "wb", buffering=0, opener=lambda p, f: os.open(p, f | flags, mode)
        )
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

    def __enter__(self: _Writer) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pwrite_all(fd: int, buf: Any, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (``os.pwrite`` may write less than asked)."""
    view = memoryview(buf).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


_DIRECT_ALIGN = 4096
"""File offsets and lengths of ``O_DIRECT`` writes are multiples of this: every logical
block size in use (512 or 4096 bytes). The buffers are page-aligned (anonymous mappings)."""
_DIRECT_SMALL = 1 << 20
"""A :class:`DirectWriter` write shorter than this goes through the page cache, at close."""
_DEFERRED_MAX = 64 << 20
"""... while the bytes kept for close stay under this (memory); past it, by ``O_DIRECT``."""
_THROUGH_REQUEST = 64 << 20
"""The largest request :meth:`DirectWriter.write_through` sends: from a trained model's
tensors, 64 MiB requests wrote 2 GiB in 1.14 s against 1.30 s in 8 MiB ones (the pages of
such memory are scattered, and a request carries at most a device's segment count of them)."""
_HASH_PIECE = 8 << 20
"""Bytes hashed per call by :meth:`DirectWriter.write_through` (each piece in the CPU cache
for its second hasher)."""


class DirectWriter(HashingWriter):
    """A :class:`HashingWriter` whose bytes go to the disk with ``O_DIRECT``, past the page
    cache: what it is given is hashed, copied into a ring of ``ring`` page-aligned buffers of
    ``buffer`` bytes, and each full buffer is written at its offset by a background thread
    while the next one fills; :meth:`write_through` writes large aligned spans with no copy.
    ``close()`` writes the tail padded to :data:`_DIRECT_ALIGN`, truncates the file back to
    its size, and fsyncs it when ``fsync=True``.

    Why: buffered writes on this project's benchmark disk ran at 0.9-1.4 GB/s and cost
    0.7-1.6 CPU-seconds per GiB (the kernel's copy into the page cache, its write-back and
    dirty-page throttling); ``O_DIRECT`` from aligned buffers ran at 2.2-2.4 GB/s for 0.03
    (``RESULTS.md``, issue 23), and leaves the page cache to the data pipeline. Where the
    filesystem refuses ``O_DIRECT``, at open or on a write (``EINVAL``), the writer goes on
    through the page cache from that byte: ``direct`` then says False. An error of a
    background write (``ENOSPC``...) is raised by the next :meth:`write` or by
    :meth:`close`."""

    def __init__(
        self,
        path: str,
        *,
        fsync: bool = True,
        mode: int = 0o666,
        buffer: int = 16 << 20,
        ring: int = 4,
    ) -> None:
        if buffer <= 0 or buffer % _DIRECT_ALIGN or ring < 2:
            raise ValueError(
                f"DirectWriter({path!r}): buffer={buffer} must be a positive multiple of "
                f"{_DIRECT_ALIGN} and ring={ring} at least 2"
            )
        super().__init__(path, fsync=fsync, mode=mode)
        self.direct = _set_direct(self.fileno(), True)
        self._bufs: list[mmap.mmap] = []
        self._size, self._ring = buffer, ring
        self._written: list[Future[None] | None] = [None] * ring
        self._slot = 0  # the buffer being filled: self._bufs[self._slot]
        self._fill = 0  # bytes in it
        self._at = 0  # its offset in the file
        # writes straight from the caller's memory (write_through), oldest first
        self._through: collections.deque[Future[None]] = collections.deque()
        self._small_fd: int | None = None  # see _small
        self._deferred: list[tuple[int, bytes]] = []  # (offset, bytes): short writes, at close
        self._deferred_bytes = 0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="unbroken-direct-write")

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self._h.update(mv)
        self._copy_in(mv)
        self.size += len(mv)
        return len(mv)

    def write_through(self, b: Any, each: Callable[[memoryview], object] | None = None) -> int:
        """:meth:`write`, but the aligned middle of ``b`` goes to the disk straight from the
        caller's memory, with no copy, in requests of up to :data:`_THROUGH_REQUEST`, when
        its address and the file position agree modulo :data:`_DIRECT_ALIGN`
        (:meth:`through_gap` says how to lay a file out so). ``b`` must then stay alive and
        unchanged until :meth:`close` returns. ``b`` is hashed in :data:`_HASH_PIECE` pieces,
        each also handed to ``each`` while it is in the CPU cache."""
        mv = memoryview(b).cast("B")
        for i in range(0, len(mv), _HASH_PIECE):
            piece = mv[i : i + _HASH_PIECE]
            self._h.update(piece)
            if each is not None:
                each(piece)
        lead = -self.size % _DIRECT_ALIGN
        body = (len(mv) - lead) // _DIRECT_ALIGN * _DIRECT_ALIGN
        if not self.direct or body <= 0 or self.through_gap(address_of(mv), self.size):
            self._copy_in(mv)
            self.size += len(mv)
            return len(mv)
        self._copy_in(mv[:lead])
        if self._fill:  # the buffer now ends on an aligned file offset
            self._send(self._fill)
        while self._through and self._through[0].done():  # an error surfaces here, early
            self._through.popleft().result()
        for i in range(lead, lead + body, _THROUGH_REQUEST):
            span = mv[i : min(i + _THROUGH_REQUEST, lead + body)]
            self._through.append(self._io.submit(self._put, span, self._at))
            self._at += len(span)
        self._copy_in(mv[lead + body :])
        self.size += len(mv)
        return len(mv)

    def through_gap(self, address: int, position: int) -> int:
        """Bytes to put before file offset ``position`` so that memory at ``address`` lands
        where :meth:`write_through` writes it without a copy (0 when not by ``O_DIRECT``)."""
        return (address - position) % _DIRECT_ALIGN if self.direct else 0

    def _copy_in(self, mv: memoryview) -> None:
        done = 0
        while done < len(mv):
            buf = self._free()
            k = min(len(mv) - done, self._size - self._fill)
            buf[self._fill : self._fill + k] = mv[done : done + k]
            self._fill += k
            done += k
            if self._fill == self._size:
                self._send(self._size)

    def writev(self, bufs: list[Any]) -> int:
        return sum(self.write(b) for b in bufs)

    def _free(self) -> mmap.mmap:
        """The buffer being filled, once its last write landed (raising that write's error)."""
        pending = self._written[self._slot]
        if pending is not None:
            self._written[self._slot] = None
            pending.result()
        if self._slot == len(self._bufs):
            self._bufs.append(mmap.mmap(-1, self._size))
        return self._bufs[self._slot]

    def _send(self, length: int) -> None:
        """Hand the first ``length`` bytes of the buffer being filled to the writing thread;
        a short one (the bytes between two spans written through, the tail) is kept, to go
        through the page cache at close (:meth:`_small`)."""
        view = memoryview(self._bufs[self._slot])[:length]
        if self._defers(length):
            self._deferred.append((self._at, bytes(view)))
            self._deferred_bytes += length
        else:
            self._written[self._slot] = self._io.submit(self._put, view, self._at)
        self._at += self._fill
        self._slot = (self._slot + 1) % self._ring
        self._fill = 0

    def _defers(self, length: int) -> bool:
        """Whether a write of ``length`` bytes is kept for close (:meth:`_small`)."""
        return (
            length < _DIRECT_SMALL
            and self._deferred_bytes + length <= _DEFERRED_MAX
            and self._small() is not None
        )

    def _small(self) -> int | None:
        """A second descriptor of the file, without ``O_DIRECT``, for the short writes:
        queued between the long ones they waited 0.4-3.7 ms each for the device (0.1-0.45 s
        per 1 GiB file of tensors), and written through the page cache while an ``O_DIRECT``
        write extends the file they wait for its inode lock, stalling the caller. So they
        are kept and written at close, after the last ``O_DIRECT`` write, in microseconds;
        the closing fsync makes them durable. Whole pages or the file's tail only, so no
        page is shared with an ``O_DIRECT`` range. None where the file cannot be reopened."""
        if self._small_fd is None:
            try:
                self._small_fd = os.open(
                    f"/proc/self/fd/{self.fileno()}", os.O_WRONLY | os.O_CLOEXEC
                )
            except OSError:
                self._small_fd = -1
        return self._small_fd if self._small_fd >= 0 else None

    def _put(self, view: memoryview, offset: int) -> None:
        fd = self.fileno()
        while view:
            try:
                n = os.pwrite(fd, view, offset)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self.direct = _set_direct(fd, False)  # refused here: the page cache from now
                continue
            if n == 0:
                raise OSError(errno.EIO, f"{self.path}: the write at offset {offset} wrote nothing")
            view, offset = view[n:], offset + n

    def _drain(self) -> None:
        """Write the tail (padded to the alignment, truncated back) and wait for every write."""
        if self._fill:  # the buffer being filled: its earlier write already waited for
            aligned = self.direct and not self._defers(self._fill)
            padded = -(-self._fill // _DIRECT_ALIGN) * _DIRECT_ALIGN if aligned else self._fill
            self._bufs[self._slot][self._fill : padded] = bytes(padded - self._fill)
            self._send(padded)
        pending = [p for p in (*self._written, *self._through) if p is not None]
        self._written, self._through = [None] * self._ring, collections.deque()
        errors = [e for e in (p.exception() for p in pending) if e is not None]
        if errors:
            raise errors[0]
        small = self._small() if self._deferred else None
        for offset, data in self._deferred:
            pwrite_all(small, data, offset)  # type: ignore[arg-type]  # set when deferred
        self._deferred.clear()
        if os.fstat(self.fileno()).st_size != self.size:
            os.ftruncate(self.fileno(), self.size)

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._drain()
        except BaseException:
            self._fsync = False  # nothing to make durable: the caller sees the error
            raise
        finally:
            self._io.shutdown(wait=True)
            if self._small_fd is not None and self._small_fd >= 0:
                os.close(self._small_fd)
            self._bufs.clear()  # unmapped once no view of them is left (an error's frame may hold one)
            super().close()


def takes_direct_io(directory: str) -> bool:
    """Whether ``directory``'s filesystem takes an aligned ``O_DIRECT`` write (a real one,
    to a probe file of a fresh name, ``O_EXCL | O_NOFOLLOW``, mode 0600, removed after only
    while that name is still the probe); False where nothing can be written."""
    path = os.path.join(directory, f".direct-io-probe.{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return False
    try:
        if not _set_direct(fd, True):
            return False
        os.pwrite(fd, mmap.mmap(-1, _DIRECT_ALIGN), 0)
        return True
    except OSError:
        return False
    finally:
        mine = os.fstat(fd)
        with contextlib.suppress(OSError):
            there = os.lstat(path)
            if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(path)
        os.close(fd)


def address_of(mv: memoryview) -> int:
    """The address of ``mv``'s first byte (read-only buffers too)."""
    import numpy as np

    return int(np.frombuffer(mv, np.uint8).ctypes.data) if len(mv) else 0


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; returns whether it is on. Turning it on fails
    quietly (False) where this platform or filesystem has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    import fcntl

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | flag if on else flags & ~flag)
    except OSError:
        if not on:
            raise
        return False
    return on


@contextlib.contextmanager
def atomic_write(path: str, *, fsync: bool = True, mode: int = 0o666) -> Iterator[HashingWriter]:
    """Write ``path`` atomically: readers see the old file or the complete new one.

    Yields a :class:`HashingWriter`; after the block its ``size``/``digest`` describe the
    published file. On error the temporary file is removed and ``path`` is untouched.
    ``mode``: the new file's permissions before the umask (0o600: private to this user).
    """
    tmp = temp_sibling(path)
    w = HashingWriter(tmp, fsync=fsync, mode=mode)
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


def atomic_write_bytes(path: str, data: bytes, *, fsync: bool = True, mode: int = 0o666) -> str:
    """Atomically publish ``data`` at ``path``; returns its checksum."""
    with atomic_write(path, fsync=fsync, mode=mode) as w:
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


# --- private places on a shared node ---------------------------------------------------------
# A directory that only this user can write is the one root of trust for the fixed names in it:
# nobody else can plant a symlink or a file there. private_dir checks that once; open_private
# opens a fixed name inside such a directory without following a link and with mode 0600.

_GROUP_OR_WORLD_WRITABLE = stat.S_IWGRP | stat.S_IWOTH


class PrivateDirError(PermissionError):
    """A directory that must be private to this user is not (another owner, writable by
    group or others, or not a directory). The message names the path, what was found and the
    fix."""


def private_dir(path: str, *, purpose: str = "directory", closed: bool = False) -> str:
    """Create ``path`` with mode 0700 (parents as ``makedirs`` would), or accept it if it
    already exists, is a real directory (not a symlink), is owned by this user and is not
    writable by group or others (``closed``: no access at all for them, mode 0700 - for
    what others must not read either, e.g. checkpoints). Anything else raises
    :class:`PrivateDirError` naming the directory, its owner and mode, and the fix. Returns
    ``path``.

    ``purpose`` (``"run directory"``, ``"cache directory"``) makes the message say what the
    directory is for.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a non-directory there: the lstat below names it
    except OSError as e:
        raise PrivateDirError(
            f"{path}: cannot create the {purpose} ({e.strerror}); pass a path this user can create"
        ) from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise PrivateDirError(
            f"{path}: the {purpose} is {kind}; it must be a real directory owned by this user "
            "(remove it, or pass another path)"
        )
    uid = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != uid:  # not ours to fix: only its owner (or root) can remove it
        raise PrivateDirError(
            f"{path}: the {purpose} is owned by uid {st.st_uid} with mode {mode:04o}, not by "
            f"this user (uid {uid}); its owner could plant or replace files in it. Have it "
            "removed (its owner or root), or pass another path"
        )
    if mode & (0o077 if closed else _GROUP_OR_WORLD_WRITABLE):
        could, fix = (
            ("read, plant or replace", "chmod 700")
            if closed
            else ("plant or replace", "chmod go-w")
        )
        raise PrivateDirError(
            f"{path}: the {purpose} is owned by this user with mode {mode:04o}; other users "
            f"could {could} files in it. Use a directory owned by uid {uid} that group and "
            f"others cannot {'open' if closed else 'write'} ({fix} {path}), or pass another path"
        )
    return path


def open_private(path: str, flags: int, *, mode: int = 0o600) -> int:
    """``os.open`` for a fixed name inside a :func:`private_dir`: never follows a symlink
    (``O_NOFOLLOW``), creates with ``mode`` (0600), closes on exec, and refuses anything but a
    regular file owned by this user. Returns the fd; raises ``OSError`` (``ELOOP`` for a
    symlink) or :class:`PrivateDirError`."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PrivateDirError(
                f"{path}: expected a regular file owned by this user, found mode "
                f"{stat.S_IMODE(st.st_mode):04o} owned by uid {st.st_uid}; remove it"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


# --- descriptors of lock files: never inherited by a forked child ----------------------------

_LOCK_FDS: set[int] = set()
_LOCK_FDS_GUARD = threading.Lock()


def open_lock_fd(path: str, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """:func:`open_private` for a file this process ``flock``-s: the descriptor is closed in
    any child forked from this process (a DataLoader worker, a forked fetcher) at the fork
    (T-FORK-LOCK).

    A ``flock`` belongs to the open file description, which a fork shares with the child: a
    child's copy keeps the lock, taken before the fork or after it through the parent's
    descriptor, for as long as the child lives, and every other process waits on it (issue
    22: a worker forked while a download thread wrote the cache's event log stopped the
    node's downloads). Opening and recording, and :func:`close_lock_fd`'s closing and
    forgetting, are one step with respect to fork (a lock taken across it), so no child
    gets a descriptor between the two."""
    with _LOCK_FDS_GUARD:
        fd = open_private(path, flags)
        _LOCK_FDS.add(fd)
    return fd


def close_lock_fd(fd: int) -> None:
    """Close a descriptor from :func:`open_lock_fd` (its locks go with it). Nothing in a
    forked child, where the fork closed it already (the number may name another file now)."""
    with _LOCK_FDS_GUARD:
        if fd in _LOCK_FDS:
            _LOCK_FDS.discard(fd)
            os.close(fd)


def _close_lock_fds_in_child() -> None:
    for fd in _LOCK_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
    _LOCK_FDS_GUARD.release()


os.register_at_fork(
    before=_LOCK_FDS_GUARD.acquire,
    after_in_parent=_LOCK_FDS_GUARD.release,
    after_in_child=_close_lock_fds_in_child,
)
