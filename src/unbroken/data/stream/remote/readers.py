"""Who reads on this node, and where: ``<cache_dir>/.readers/<pid>-<k>``, one per reading
process of a dataset, 5 int64 (dataset id, epoch, position, heartbeat ns, wanted unit or -1),
``flock``-ed shared while its reader lives. Prefetch and eviction look at the node from its
slowest live reader; a fetcher process serves what readers wait for."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import time
from typing import Any

from unbroken.common.fs import open_private
from unbroken.data.stream.remote.locks import open_fd, try_flock

__all__ = ["Registration", "live_readers"]

_RECORD = struct.Struct("<5q")


class Registration:
    """This process's registration as a reader of one dataset (made on first use)."""

    def __init__(self, cache_dir: str, ds_id: int, key: str) -> None:
        self.path_base = os.path.join(cache_dir, ".readers")
        self.ds_id = ds_id
        self.key = key
        self._pid = -1
        self._fd = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_fd": -1}

    def register(self, epoch: int, pos: int) -> None:
        """This reader is at ``pos`` of ``epoch``."""
        if self._fd < 0 or self._pid != os.getpid():
            self._pid = os.getpid()
            self._fd = open_fd(os.path.join(self.path_base, f"{self._pid}-{self.key}"))
            fcntl.flock(self._fd, fcntl.LOCK_SH)  # alive while held
            os.pwrite(self._fd, struct.pack("<q", -1), 32)
        os.pwrite(self._fd, struct.pack("<4q", self.ds_id, epoch, pos, time.monotonic_ns()), 0)

    def touch(self, want: int | None = None) -> None:
        """Heartbeat while waiting; ``want``: the unit this reader waits for (-1: none)."""
        if self._fd >= 0 and self._pid == os.getpid():
            os.pwrite(self._fd, struct.pack("<q", time.monotonic_ns()), 24)
            if want is not None:
                os.pwrite(self._fd, struct.pack("<q", want), 32)

    def leave(self) -> None:
        """Stop counting as a reader (epoch -1) until the next :meth:`register`."""
        if self._fd >= 0 and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                os.pwrite(self._fd, struct.pack("<q", -1), 8)


def live_readers(cache_dir: str, ds_id: int, stale_s: float) -> list[tuple[int, int, int]]:
    """(epoch, position, wanted unit or -1) of dataset ``ds_id``'s live readers on the node
    that were active in the last ``stale_s`` seconds; registrations of dead readers (their
    lock free) are removed."""
    rdir = os.path.join(cache_dir, ".readers")
    now = time.monotonic_ns()
    stale = int(stale_s * 1e9)
    out: list[tuple[int, int, int]] = []
    try:
        names = os.listdir(rdir)
    except FileNotFoundError:
        return out  # the cache directory was removed
    for name in names:
        path = os.path.join(rdir, name)
        try:
            fd = open_private(path, os.O_RDWR)
        except OSError:
            continue
        try:
            if try_flock(fd, fcntl.LOCK_EX):  # nobody holds it: its reader is gone
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            raw = os.pread(fd, _RECORD.size, 0)
        finally:
            os.close(fd)
        if len(raw) != _RECORD.size:
            continue
        rid, epoch, pos, beat, want = _RECORD.unpack(raw)
        if rid != ds_id or epoch < 0 or now - beat > stale:
            continue  # another dataset, or a reader idle for long (it re-registers)
        out.append((epoch, pos, want))
    return out
