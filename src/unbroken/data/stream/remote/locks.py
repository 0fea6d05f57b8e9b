"""Per-unit locks of the node cache, robust to a dying process.

``<cache_dir>/.locks/<dir>-<n>`` is ``flock``-ed exclusively while unit ``n`` of dataset
``<dir>`` is downloaded, verified or evicted, and shared while a reader has it open (a
:class:`Pin`): no unit is fetched twice at once, an open unit is never evicted, and the
kernel drops the lock of a process that dies. The files are empty; their mtime is the
heartbeat of a download in progress. Every descriptor opened here is closed in a forked
child (a DataLoader worker) at the fork (:func:`~unbroken.common.fs.open_lock_fd`): an
inherited lock would otherwise hold the unit for as long as the child lives.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from typing import Any

from unbroken.common.fs import close_lock_fd, open_lock_fd

__all__ = ["Pin", "PinnedShard", "UnitLocks", "flock_within", "try_flock"]


def try_flock(fd: int, how: int) -> bool:
    """``flock`` without blocking: False when another open file holds it."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def flock_within(fd: int, how: int, seconds: float) -> bool:
    """``flock`` waited for at most ``seconds`` (a lock cannot be waited for with a timeout:
    polled, 0.5 ms doubling to 20 ms); whether it was taken."""
    deadline = time.monotonic() + seconds
    nap = 0.0005
    while not try_flock(fd, how):
        if time.monotonic() > deadline:
            return False
        time.sleep(nap)
        nap = min(nap * 2, 0.02)
    return True


class Pin:
    """A shared lock on one unit's lock file: the unit cannot be evicted while held."""

    __slots__ = ("fd", "pid")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pid = os.getpid()

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd < 0 or os.getpid() != self.pid:
            return  # an inherited pin: the fork hook closed the child's copy already
        # LOCK_UN acts on the open file description, for every process sharing it.
        fcntl.flock(fd, fcntl.LOCK_UN)
        close_lock_fd(fd)


class PinnedShard:
    """An open shard (a ``ShardReader`` or ``TokenShard``) plus its pin, released on close."""

    __slots__ = ("inner", "pin")

    def __init__(self, inner: Any, pin: Pin) -> None:
        self.inner = inner
        self.pin = pin

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def close(self) -> None:
        try:
            close = getattr(self.inner, "close", None)
            if close is not None:
                close()
        finally:
            self.pin.release()


class UnitLocks:
    """The lock files of the units of one cache directory, and the waits on them."""

    def __init__(self, cache_dir: str) -> None:
        self.dir = os.path.join(cache_dir, ".locks")
        self._wakers: dict[tuple[str, int], threading.Event] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_wakers": {}}

    def path(self, dir_name: str, shard: int) -> str:
        return os.path.join(self.dir, f"{dir_name}-{shard}")

    def open(self, dir_name: str, shard: int) -> int:
        return open_lock_fd(self.path(dir_name, shard))

    def pin(self, dir_name: str, shard: int) -> Pin | None:
        """A shared lock on the unit, or None when someone holds it exclusively."""
        fd = self.open(dir_name, shard)
        if try_flock(fd, fcntl.LOCK_SH):
            return Pin(fd)
        close_lock_fd(fd)
        return None

    def heartbeat(self, dir_name: str, shard: int) -> int:
        """The mtime of the unit's lock file: a download touches it as bytes arrive."""
        try:
            return os.lstat(self.path(dir_name, shard)).st_mtime_ns
        except OSError:
            return 0

    def nap(self, dir_name: str, shard: int, secs: float) -> None:
        """Sleep up to ``secs``; return as soon as the unit's lock is released if another
        process holds it (downloading or evicting it). Measured: polling alone left a reader
        waiting 4.6 ms on average after the download it waited for was published.

        The wake-up is a thread blocked in ``flock(LOCK_SH)`` on its own descriptor (a lock
        cannot be waited for with a timeout); one per process and unit, kept across naps
        until the lock is released, so a stalled download never piles up threads."""
        if self._pid != os.getpid():  # forked: the parent's waker threads are not here
            self._wakers, self._pid = {}, os.getpid()
        key = (dir_name, shard)
        ev = self._wakers.get(key)
        if ev is None:
            fd = self.open(dir_name, shard)
            if try_flock(fd, fcntl.LOCK_SH):  # nobody holds it: nothing to wake on
                fcntl.flock(fd, fcntl.LOCK_UN)
                close_lock_fd(fd)
                time.sleep(secs)
                return
            ev = self._wakers[key] = threading.Event()

            def waker(fd: int = fd, ev: threading.Event = ev) -> None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH)  # blocks until the holder lets go
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except OSError:
                    pass  # closed by a fork hook or at exit: just wake the reader
                finally:
                    ev.set()
                    with contextlib.suppress(OSError):
                        close_lock_fd(fd)

            threading.Thread(target=waker, name="unbroken-cache-wake", daemon=True).start()
        if ev.wait(secs):
            self._wakers.pop(key, None)
