"""One writer per checkpoint root (C-ONE-WRITER).

The run that saves into a root holds an exclusive ``flock`` on ``<root>/.lock`` from its
first ``Checkpointer.restore()`` or ``save()`` until ``close()``. The kernel drops the lock
when the holder exits, however it dies (SIGKILL included), so a crashed run never blocks
its successor; a second live writer is refused by :func:`acquire` (:class:`RootLocked`)
with a message naming the holder (host, pid, run id, argv, recorded in the file while
held). In one process the lock is shared: every ``Checkpointer`` of a root is the same
writer (a :class:`Lease` count keeps it until the last one closes). Forked children drop
their inherited copy as soon as they run.

Temp dirs: only the holder may judge a ``.tmp-step-*`` directory it did not create as
debris; a process without the lock deletes nothing (:func:`writer_alive`). On a filesystem
without ``flock`` one WARNING says the root is not protected and saving goes on.

The holder file, stale files, a writer killed between a fork and its child's first
instructions (``ORPHAN_WAIT_S``) and read-only roots: ARCHITECTURE.md, "Design notes" >
ckpt > the writer lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LOCK_NAME", "Lease", "RootLocked", "acquire", "note_temp", "writer_alive"]

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
ORPHAN_WAIT_S = 10.0  # a forked child drops the lock at its first instructions; load delays it


class RootLocked(RuntimeError):
    """Another live process holds the writer lock of a checkpoint root."""


@dataclass
class _Held:
    path: str
    fd: int | None  # None: running without the lock (no flock support, or read-only)
    leases: int = 0
    inflight: set[str] = field(default_factory=set)


_HELD: dict[str, _Held] = {}
_GUARD = threading.Lock()
_owner: int | None = None  # the thread inside the guard
_deferred: list[Lease] = []  # releases that came while their own thread held the guard


@contextlib.contextmanager
def _guarded() -> Iterator[None]:
    """The guard, recording its owner; on leaving it, releases that a garbage collection
    ran inside the section (a finalizer's) are done (see :meth:`Lease.release`)."""
    global _owner
    with _GUARD:
        _owner = threading.get_ident()
        try:
            yield
            while _deferred:
                _deferred.pop()._release()
        finally:
            _owner = None


def _key(root: str) -> str:
    return os.path.realpath(root)


def _holder_text(info: dict[str, Any], path: str) -> str:
    if not isinstance(info.get("pid"), int):
        return f"another process (it has not written its identity to {path} yet)"
    when = info.get("started")
    since = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
        if isinstance(when, int | float)
        else "?"
    )
    argv = info.get("argv")
    cmd = " ".join(str(a) for a in argv) if isinstance(argv, list) else "?"
    return (
        f"pid {info['pid']} on host {info.get('host', '?')} (run id {info.get('run_id')}, "
        f"since {since}, command: {cmd})"
    )


def _read_info(fd: int) -> dict[str, Any]:
    try:
        info = json.loads(os.pread(fd, 65536, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _write_info(fd: int) -> None:
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "started": time.time(),
        "argv": sys.argv,
    }
    data = json.dumps(info).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _dead_here(info: dict[str, Any]) -> bool:
    """Whether the holder recorded in ``info`` ran on this host and is no longer running.
    Only ever a reason to wait longer for the lock, never to take it: a holder in another
    PID namespace with the same host name looks dead here."""
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0 or info.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    try:  # a killed holder nobody has reaped yet is a zombie: its files are closed
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _unlocked(root: str, path: str, why: str, level: int) -> _Held:
    log.log(level, "checkpoint root %s: %s", root, why)
    return _Held(path, None)


_DENIED = (errno.EROFS, errno.EACCES, errno.EPERM)


def _open(path: str) -> int:
    """The lock file, created if needed; read-only when that is all we may (flock needs no
    write access, so another user's live writer is still seen). A fixed name in a root that
    may come from elsewhere: never a symlink (the holder's record is written into it, which
    would truncate the file it points to), never anything but a regular file (a FIFO would
    block the open)."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
        except OSError as e:
            if e.errno not in _DENIED:
                raise
            try:
                fd = os.open(path, os.O_RDONLY | flags)
            except FileNotFoundError:
                raise e from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RuntimeError(f"{path} is a symlink, not a lock file; remove it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RuntimeError(f"{path} is not a regular file; remove it")
    return fd


def _lock(root: str) -> _Held:
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"checkpoint root {root!r} is a file, not a directory")
    path = os.path.join(root, LOCK_NAME)
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        fd = _open(path)
    except OSError as e:
        if e.errno in _DENIED and os.path.isdir(root):
            why = f"{path} cannot be created ({e.strerror}): restoring without the writer lock"
            return _unlocked(root, path, why, logging.INFO)
        raise RuntimeError(
            f"cannot create checkpoint directory {root!r} or its lock file: {e.strerror}; "
            "pass a writable path"
        ) from e
    waited_since: float | None = None  # since when the lock is held for a dead holder
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            info = _read_info(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                dead = _dead_here(info)
                if dead:
                    if waited_since is None:
                        waited_since = time.monotonic()
                        log.info(
                            "checkpoint root %s: the lock's holder (pid %s) is gone; waiting "
                            "up to %.0f s for the processes it forked to let go of the lock",
                            root,
                            info["pid"],
                            ORPHAN_WAIT_S,
                        )
                    if time.monotonic() - waited_since < ORPHAN_WAIT_S:
                        time.sleep(0.02)
                        continue
                os.close(fd)
                if dead:
                    raise RootLocked(
                        f"checkpoint root {root!r} is locked, but its writer is no longer "
                        f"running: {_holder_text(info, path)}. Processes it forked (e.g. "
                        "DataLoader workers) still hold the lock open after "
                        f"{ORPHAN_WAIT_S:.0f} s; find them with `fuser -v {path}` and stop "
                        "them, then start this run again"
                    ) from None
                raise RootLocked(
                    f"checkpoint root {root!r} is in use by another writer: "
                    f"{_holder_text(info, path)}. Two runs writing one root would interleave "
                    "their steps and delete each other's checkpoints. Stop that run first "
                    "(its lock goes away when it exits, even if killed), or give this run "
                    "another checkpoint directory"
                ) from None
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                why = (
                    f"this filesystem does not support flock ({e.strerror}): a second run "
                    "writing here would NOT be refused"
                )
                return _unlocked(root, path, why, logging.WARNING)
            raise
        # A releasing holder unlinks the file while still holding it: if this fd's inode
        # is no longer the one at `path`, the lock we got protects nothing; start over.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            with contextlib.suppress(OSError):  # a read-only fd: the lock holds all the same
                _write_info(fd)
            return _Held(path, fd)
        os.close(fd)
        fd = _open(path)


class Lease:
    """This process's claim on a root's writer lock; :meth:`release` is idempotent."""

    def __init__(self, key: str) -> None:
        self._key = key
        self._released = False

    def release(self) -> None:
        """Idempotent. Called by a weakref finalizer when a collection runs on a thread that
        is inside the guard (any allocation there may collect), it is deferred to the end
        of that section instead of waiting on a lock its own thread holds."""
        if _owner == threading.get_ident():
            _deferred.append(self)
            return
        with _guarded():
            self._release()

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        held = _HELD.get(self._key)
        if held is None:  # forgotten in a forked child
            return
        held.leases -= 1
        if held.leases > 0:
            return
        del _HELD[self._key]
        if held.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(held.path)  # still locked: nobody can take a doomed inode
            os.close(held.fd)


def acquire(root: str) -> Lease:
    """Become (or stay) the writer of ``root``; raises :class:`RootLocked` naming the
    holder when another live process is. Creates ``root`` if needed."""
    key = _key(root)
    with _guarded():
        held = _HELD.get(key)
        if held is None:
            held = _HELD[key] = _lock(key)
        held.leases += 1
    return Lease(key)


def note_temp(tmp_dir: str, *, done: bool = False) -> None:
    """Record that this process writes ``tmp_dir`` (before it exists), or no longer does."""
    key = _key(os.path.dirname(os.path.abspath(tmp_dir)))
    name = os.path.basename(tmp_dir)
    with _guarded():
        held = _HELD.get(key)
        if held is not None:
            (held.inflight.discard if done else held.inflight.add)(name)


def writer_alive(tmp_dir: str) -> bool:
    """Whether the writer of a ``.tmp-step-*`` directory may still be running.

    False only when this process holds the root's lock and did not create ``tmp_dir``
    itself: every writer holds that lock while it writes, so that writer is gone. Without
    the lock nobody can tell, and the answer is True (never delete live work).
    """
    key = _key(os.path.dirname(os.path.abspath(tmp_dir)))
    with _guarded():
        held = _HELD.get(key)
        if held is None or held.fd is None:
            return True
        return os.path.basename(tmp_dir) in held.inflight


def _drop_inherited() -> None:
    """In a forked child: close the copies of the lock fds; the parent keeps its locks."""
    for held in _HELD.values():
        if held.fd is not None:
            with contextlib.suppress(OSError):
                os.close(held.fd)
    _HELD.clear()
    _GUARD.release()


# The guard is taken across fork so a child never inherits it locked by another thread.
os.register_at_fork(
    before=_GUARD.acquire, after_in_parent=_GUARD.release, after_in_child=_drop_inherited
)
