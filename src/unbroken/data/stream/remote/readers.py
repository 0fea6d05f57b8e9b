"""Who reads on this node, and where: ``<cache_dir>/.readers/<pid>-<k>``, one per reading
process of a dataset, 7 int64 (dataset id, epoch, position, heartbeat ns, wanted unit or -1,
and the epoch and position at which the fetcher wants to hear from it again), ``flock``-ed
shared while its reader lives. Prefetch and eviction look at the node from its slowest live
reader; a fetcher process serves what readers wait for.

The fetcher sleeps on its doorbell, ``<cache_dir>/.fetch/<dataset>.wake`` (a FIFO, 0600, in
the cache's 0700 directory; its bytes are only a wake-up, never read as data): a reader rings
it when it reaches the position the fetcher wrote into its record (where the reader's set of
shards changes and the read-ahead moves on) and when it starts waiting for a unit. So the
fetcher's work follows the readers' progress and the downloads, not the wall clock (issue 22,
round 4: its 20-100 ms polling loop was about half of its CPU)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import stat
import struct
import time
from typing import Any

from unbroken.common.fs import close_lock_fd, open_lock_fd, open_private
from unbroken.data.stream.remote.locks import try_flock

__all__ = ["Doorbell", "Registration", "live_readers", "reader_records", "ring", "set_wake"]

_RECORD = struct.Struct("<7q")
_WAKE = struct.Struct("<2q")
_WAKE_AT = 40  # offset of (wake epoch, wake position) in a record


class Registration:
    """This process's registration as a reader of one dataset (made on first use)."""

    def __init__(self, cache_dir: str, ds_id: int, key: str, bell: str) -> None:
        self.path_base = os.path.join(cache_dir, ".readers")
        self.ds_id = ds_id
        self.key = key
        self.bell = bell
        self._pid = -1
        self._fd = -1
        self._rung = (-2, -2)  # the fetcher's wake position this reader last rang for
        self._where = (-1, -1)  # (epoch, position) last registered
        self._want = -1  # the unit this reader waits for (-1: none)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_fd": -1, "_rung": (-2, -2), "_want": -1}

    def _ensure(self) -> bool:
        """Make this process's record when it has none: at first use, after a fork, and
        when its file was removed (D-NODE-READERS). A scan (:func:`reader_records`) removes
        a record whose lock it can take, taking it for a dead reader's; a reader between
        creating its file and locking it is one, and it must not go on writing into a file
        nobody reads (issue 22: the fetcher then served only the other worker, and this one
        fetched each unit itself after ``grace_s``). Whether the record was made afresh."""
        old = self._fd if self._pid == os.getpid() else -1
        if old >= 0 and os.fstat(old).st_nlink:
            return False
        path = os.path.join(self.path_base, f"{os.getpid()}-{self.key}")
        try:
            while True:
                fd = open_lock_fd(path)
                fcntl.flock(fd, fcntl.LOCK_SH)  # alive while held
                if os.fstat(fd).st_nlink:  # linked once locked: no scan can remove it now
                    break
                close_lock_fd(fd)
        except OSError:
            if old < 0:
                raise  # the first record: the cache directory is not usable
            return False  # made again later; the cache directory itself is going away
        os.pwrite(fd, struct.pack("<3q", -1, -1, -1), 32)
        if old >= 0:
            close_lock_fd(old)
        self._pid, self._fd, self._rung = os.getpid(), fd, (-2, -2)
        return True

    def register(self, epoch: int, pos: int) -> None:
        """This reader is at ``pos`` of ``epoch``; rings the fetcher when it has reached the
        position the fetcher asked to hear about (once per such position)."""
        self._ensure()
        self._where = (epoch, pos)
        os.pwrite(self._fd, struct.pack("<4q", self.ds_id, epoch, pos, time.monotonic_ns()), 0)
        raw = os.pread(self._fd, _WAKE.size, _WAKE_AT)
        at = _WAKE.unpack(raw) if len(raw) == _WAKE.size else (-1, -1)
        if (epoch, pos) >= at and at != self._rung:
            self._rung = at
            ring(self.bell)

    def touch(self, want: int | None = None) -> None:
        """Heartbeat while waiting; ``want``: the unit this reader waits for (-1: none; a
        unit rings the fetcher). Nothing before this process's first :meth:`register`."""
        if self._fd < 0 or self._pid != os.getpid():
            return
        if want is not None:
            self._want = want
        fresh = self._ensure()
        if fresh:
            os.pwrite(self._fd, struct.pack("<3q", self.ds_id, *self._where), 0)
        os.pwrite(self._fd, struct.pack("<q", time.monotonic_ns()), 24)
        if want is not None or fresh:
            os.pwrite(self._fd, struct.pack("<q", self._want), 32)
            if self._want >= 0:
                ring(self.bell)

    def leave(self) -> None:
        """Stop counting as a reader (epoch -1) until the next :meth:`register`."""
        if self._fd >= 0 and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                os.pwrite(self._fd, struct.pack("<q", -1), 8)


def reader_records(
    cache_dir: str, ds_id: int, stale_s: float
) -> list[tuple[str, int, int, int, tuple[int, int]]]:
    """(file name, epoch, position, wanted unit or -1, wake position) of dataset ``ds_id``'s
    live readers on the node that were active in the last ``stale_s`` seconds;
    registrations of dead readers (their lock free) are removed."""
    rdir = os.path.join(cache_dir, ".readers")
    now = time.monotonic_ns()
    stale = int(stale_s * 1e9)
    out: list[tuple[str, int, int, int, tuple[int, int]]] = []
    try:
        names = os.listdir(rdir)
    except FileNotFoundError:
        return out  # the cache directory was removed
    for name in names:
        path = os.path.join(rdir, name)
        try:
            fd = open_lock_fd(path, os.O_RDWR)
        except OSError:
            continue
        try:
            if try_flock(fd, fcntl.LOCK_EX):  # nobody holds it: its reader is gone
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            raw = os.pread(fd, _RECORD.size, 0)
        finally:
            close_lock_fd(fd)
        if len(raw) != _RECORD.size:
            continue
        rid, epoch, pos, beat, want, we, wp = _RECORD.unpack(raw)
        if rid != ds_id or epoch < 0 or now - beat > stale:
            continue  # another dataset, or a reader idle for long (it re-registers)
        out.append((name, epoch, pos, want, (we, wp)))
    return out


def live_readers(cache_dir: str, ds_id: int, stale_s: float) -> list[tuple[int, int, int]]:
    """(epoch, position, wanted unit or -1) of the live readers (see :func:`reader_records`)."""
    return [(e, p, w) for _, e, p, w, _ in reader_records(cache_dir, ds_id, stale_s)]


def set_wake(cache_dir: str, name: str, epoch: int, pos: int) -> None:
    """Ask reader ``name`` to ring the doorbell once it reaches ``pos`` of ``epoch``."""
    try:
        fd = open_private(os.path.join(cache_dir, ".readers", name), os.O_RDWR)
    except OSError:
        return  # gone meanwhile
    try:
        os.pwrite(fd, _WAKE.pack(epoch, pos), _WAKE_AT)
    finally:
        os.close(fd)


def _fifo_ok(fd: int) -> bool:
    st = os.fstat(fd)
    return stat.S_ISFIFO(st.st_mode) and st.st_uid == os.geteuid()


def ring(path: str) -> None:
    """Wake the fetcher sleeping on doorbell ``path`` (nothing when none listens: no fetcher
    runs, and the readers' own checks start one)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # no fetcher has it open (ENXIO), none made it yet, or not ours (ELOOP)
    try:
        if _fifo_ok(fd):
            with contextlib.suppress(BlockingIOError):
                os.write(fd, b"!")  # full: a wake-up is pending anyway
    finally:
        os.close(fd)


class Doorbell:
    """The fetcher's end of its doorbell (see the module docstring): made afresh by the
    fetcher holding the dataset's fetch lock. It holds a write end too, so that the last
    reader closing its end never leaves the FIFO signalling end-of-file forever, and so that
    its own download threads can :meth:`ring` it."""

    def __init__(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead fetcher's, or anything else at this fixed name
        os.mkfifo(path, 0o600)
        self.rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.wfd = -1
        try:
            if not _fifo_ok(self.rfd):
                raise PermissionError(f"{path}: not this user's FIFO; remove it")
            os.fchmod(self.rfd, 0o600)
            self.wfd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except BaseException:
            self.close()
            raise
        self._poll = select.poll()
        self._poll.register(self.rfd, select.POLLIN)

    def ring(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.wfd, b"!")

    def wait(self, timeout: float | None) -> bool:
        """Sleep until rung or ``timeout`` seconds (None: no limit); whether it was rung. The
        bytes are drained and dropped, whatever they are (bounded reads)."""
        got = self._poll.poll(None if timeout is None else max(0, int(timeout * 1000) + 1))
        if not got:
            return False
        for _ in range(64):
            try:
                if len(os.read(self.rfd, 4096)) < 4096:
                    break
            except BlockingIOError:
                break
        return True

    def close(self) -> None:
        for fd in (self.rfd, self.wfd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.rfd = self.wfd = -1
