"""Process bookkeeping on Linux through /proc: find, inspect and kill what an attempt started.

torchrun starts every worker with ``start_new_session=True``, so killing torchrun's process
group does not reach the workers, and a SIGKILLed agent leaves its workers running. The
supervisor therefore marks every attempt with an environment token and finds *all* processes
that inherited it (workers, their DataLoader workers, anything they spawned) by reading
``/proc/<pid>/environ``. That survives re-parenting and new sessions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

__all__ = [
    "children_of",
    "is_alive",
    "kill_matching",
    "pids_with_env",
    "proc_state",
]

log = logging.getLogger(__name__)


def proc_state(pid: int) -> str | None:
    """The one-letter state from ``/proc/<pid>/stat`` (R, S, D, T, Z, ...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may contain spaces or parentheses; the state follows the last ')'.
    end = data.rfind(b")")
    if end < 0 or end + 2 >= len(data):
        return None
    return chr(data[end + 2])


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    st = proc_state(pid)
    return st is not None and st not in ("Z", "X")


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (all of its threads), [] if it is gone."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return out


def pids_with_env(key: str, value: str) -> list[int]:
    """Every live process whose initial environment holds ``key=value`` (not this one)."""
    needle = f"{key}={value}".encode()
    me = os.getpid()
    found: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0") and is_alive(pid):
            found.append(pid)
    return found


def kill_matching(key: str, value: str, *, timeout: float = 5.0, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to every process carrying ``key=value`` until none is left.

    Loops because a dying parent may still spawn. Returns how many distinct processes were
    signalled; logs a warning naming the survivors if any remain after ``timeout`` (a process
    in uninterruptible sleep, e.g. on a hung NFS mount, cannot be killed by anyone).
    """
    signalled: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        pids = pids_with_env(key, value)
        if not pids:
            return len(signalled)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
            signalled.add(pid)
        if time.monotonic() > deadline:
            log.warning(
                "processes %s (%s=%s) survive signal %d after %.1f s; they may be in "
                "uninterruptible I/O", pids, key, value, sig, timeout,
            )
            return len(signalled)
        time.sleep(0.05)
