"""The node cache's event log: ``<cache_dir>/.events``, one JSON line per download,
verification, eviction or discarded file, for people and tests to read.

Bounded (it counts in ``cache_limit``): rotated to ``.events.1`` before it would pass
:data:`EVENTS_MAX`, under a lock on the file, so the two hold at most twice that (the last
~500 events). Both are fixed names, never followed through a symlink.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from typing import Any

from unbroken.common.fs import close_lock_fd, open_lock_fd
from unbroken.data.stream.remote.index import read_private
from unbroken.data.stream.remote.locks import flock_within

__all__ = ["EVENTS_MAX", "LOCK_WAIT_S", "EventLog", "read_events"]

EVENTS_MAX = 32 << 10
"""Bytes of ``.events`` before it is rotated to ``.events.1``."""

LOCK_WAIT_S = 5.0
"""Seconds a line waits for the log's lock before it is dropped."""

log = logging.getLogger(__name__)


class EventLog:
    def __init__(self, cache_dir: str) -> None:
        self.path = os.path.join(cache_dir, ".events")
        self._warned = False  # of a dropped line

    def write(self, kind: str, **fields: Any) -> None:
        """Append one line (one ``O_APPEND`` write: lines of several processes never
        interleave); rotate first when it would pass :data:`EVENTS_MAX`. The log's lock is
        waited for at most :data:`LOCK_WAIT_S` (a process stopped while writing holds it):
        the line is dropped then, with one WARNING; a download never waits on its log."""
        line = (
            json.dumps(
                {"t": round(time.time(), 6), "ev": kind, "pid": os.getpid(), **fields},
                separators=(",", ":"),
            )
            + "\n"
        ).encode()
        for _ in range(8):  # another writer rotated it between our open and our lock: again
            fd = open_lock_fd(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                if not flock_within(fd, fcntl.LOCK_EX, LOCK_WAIT_S):
                    self._drop(kind)
                    return
                here = os.fstat(fd)
                try:
                    now = os.lstat(self.path)
                except FileNotFoundError:
                    continue
                if (now.st_dev, now.st_ino) != (here.st_dev, here.st_ino):
                    continue
                if here.st_size and here.st_size + len(line) > EVENTS_MAX:
                    os.replace(self.path, self.path + ".1")
                    continue
                os.write(fd, line)
                return
            finally:
                close_lock_fd(fd)

    def _drop(self, kind: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "%s: its lock was held by another process for %g s (one stopped with "
                "SIGSTOP?); a %r event was not logged (later ones are dropped the same way "
                "while it lasts, silently)",
                self.path, LOCK_WAIT_S, kind,
            )  # fmt: skip

    def size(self) -> int:
        """Bytes the log holds now (both files)."""
        total = 0
        for path in (self.path, self.path + ".1"):
            with contextlib.suppress(OSError):
                total += os.lstat(path).st_size
        return total


def read_events(cache_dir: str) -> list[dict[str, Any]]:
    """The cache's event log (downloads, verifications, evictions, discarded files), oldest
    first."""
    out = []
    for name in (".events.1", ".events"):
        try:
            raw = read_private(os.path.join(cache_dir, name))
        except FileNotFoundError:
            continue
        for line in raw.decode("utf-8", "replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out
