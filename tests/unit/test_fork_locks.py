"""A child forked from a process that holds (or is about to take) a file lock must not keep it.

``flock`` locks belong to an open file description, and a fork shares every description with
the child: a DataLoader worker forked while a download thread of its parent had the cache's
event log open kept that log's lock for as long as it lived, so every later download of the
node waited on it (issue 22, measured: the fetcher's four download threads stopped, the
readers' own downloads found the unit "busy", and the epoch failed after its 60 s timeout; in
the milder case the epoch ran 7x slower). These tests fork for real while the lock file is
open in another thread, keep the child alive, and ask a third process to take the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from unbroken.ckpt.memtier import SlotStore
from unbroken.data.stream.remote.events import EventLog, read_events

_TAKE = (
    "import fcntl, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"  # raises when anyone still holds it
    "print('taken', flush=True)\n"
)


def _fds_of(path: str) -> int:
    """How many descriptors of ``path`` this process holds."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{name}") == path
    return n


class _Holder:
    """Another process holding ``path``'s lock until :meth:`release` (told by a line, not by
    end-of-file: a forked child may hold a copy of the pipe's write end)."""

    def __init__(self, path: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TAKE + "sys.stdin.readline()\n", path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        assert self.proc.stdout.readline() == "taken\n"

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def _wait(cond: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


class _Child:
    """A forked child that reports how many descriptors of ``path`` it holds, then lives on
    (as a DataLoader worker does) until :meth:`end`."""

    def __init__(self, path: str) -> None:
        r, w = os.pipe()
        self.go_r, self.go_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: no Python-level cleanup, no pytest
            try:
                os.write(w, str(_fds_of(path)).encode())
                os.read(self.go_r, 1)
            finally:
                os._exit(0)
        os.close(w)
        self.held = int(os.read(r, 16).decode())
        os.close(r)

    def end(self) -> None:
        os.write(self.go_w, b"x")
        os.waitpid(self.pid, 0)
        os.close(self.go_r)
        os.close(self.go_w)


def _another_process_takes(path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _TAKE, path], capture_output=True, text=True, timeout=60
    )


def test_a_worker_forked_while_the_event_log_is_written_holds_no_lock(tmp_path: Any) -> None:
    cache = str(tmp_path)
    log = EventLog(cache)
    log.write("first")  # the log exists
    path = log.path
    # another process holds the log's lock, so this process's writer waits inside write(),
    # the log open, as a download thread did when its parent forked a DataLoader worker
    holder = _Holder(path)
    writer = threading.Thread(target=log.write, args=("download",), kwargs={"shard": 7})
    writer.start()
    _wait(lambda: _fds_of(path) > 0, "the writer never opened the log")
    child = _Child(path)
    try:
        assert child.held == 0, "the forked child inherited the event log's descriptor"
        holder.release()  # the parent's writer takes the lock and finishes
        writer.join(timeout=60)
        assert not writer.is_alive()
        # the child still lives; the lock must be free for everyone else
        got = _another_process_takes(path)
        assert got.returncode == 0, got.stderr[-2000:]
        assert [e["ev"] for e in read_events(cache)] == ["first", "download"]
    finally:
        child.end()


def test_a_worker_forked_from_a_publishing_rank_does_not_hold_its_memory_tier(
    tmp_path: Any,
) -> None:
    """The memory tier's lock says "a live process publishes here": a DataLoader worker forked
    from the rank must not keep it after the rank died (its restart would find the tier busy
    until the orphaned worker noticed)."""
    store = SlotStore(str(tmp_path), rank=0)
    store._take_lock()
    path = os.path.join(store.rank_dir, "lock")
    child = _Child(path)
    try:
        assert child.held == 0, "the forked child inherited the memory tier's lock"
        store.close()  # the rank is gone; its worker lives on
        got = _another_process_takes(path)
        assert got.returncode == 0, got.stderr[-2000:]
    finally:
        child.end()


def test_a_lock_descriptor_opened_in_another_thread_is_never_inherited(tmp_path: Any) -> None:
    """A thread opening, locking and closing a lock file without pause while the main thread
    forks 40 times never leaves a child a descriptor of it (the descriptor is open nearly all
    the time: an untracked one is inherited at once; the window between the open and its
    recording is closed by a lock held across fork, which this can only sample)."""
    from unbroken.common.fs import close_lock_fd, open_lock_fd

    path = str(tmp_path / "lock")
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            fd = open_lock_fd(path)
            fcntl.flock(fd, fcntl.LOCK_EX)
            close_lock_fd(fd)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(40):
            child = _Child(path)
            child.end()
            assert child.held == 0
    finally:
        stop.set()
        t.join()


def test_a_line_waits_for_a_stopped_writer_only_so_long(
    tmp_path: Any, monkeypatch: Any, caplog: Any
) -> None:
    """A process stopped while it holds the event log's lock (SIGSTOP) costs a download at most
    ``LOCK_WAIT_S``: the line is dropped with one WARNING, and the next one is written once
    the lock is free."""
    from unbroken.data.stream.remote import events

    monkeypatch.setattr(events, "LOCK_WAIT_S", 0.3)
    log = EventLog(str(tmp_path))
    log.write("first")
    holder = _Holder(log.path)
    t0 = time.monotonic()
    log.write("dropped")
    assert time.monotonic() - t0 < 30
    assert "was not logged" in caplog.text
    holder.release()
    log.write("after")
    assert [e["ev"] for e in read_events(str(tmp_path))] == ["first", "after"]
