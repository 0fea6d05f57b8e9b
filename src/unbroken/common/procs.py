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
import select
import signal
import time
from collections.abc import Collection, Iterable

__all__ = [
    "PidWatch",
    "agent_of",
    "children_of",
    "cmdline",
    "environ_of",
    "is_alive",
    "kill_matching",
    "maps_address",
    "parent_of",
    "pids_with_env",
    "signal_name",
    "proc_state",
    "signal_if_tagged",
]

log = logging.getLogger(__name__)


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[state, ppid, pgrp,
    ...]``, see proc(5)), None if the process is gone or the line is cut short."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may contain spaces or parentheses; the fields follow the last ')'.
    end = data.rfind(b")")
    fields = data[end + 1 :].split() if end >= 0 else []
    return fields if len(fields) >= 2 else None


def maps_address(addr: int) -> bool:
    """Whether this process has the byte at ``addr`` mapped (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, _, hi = line.partition(" ")[0].partition("-")
            if int(lo, 16) <= addr < int(hi, 16):
                return True
    return False


def proc_state(pid: int) -> str | None:
    """The one-letter state from ``/proc/<pid>/stat`` (R, S, D, T, Z, ...), None if gone."""
    fields = _stat(pid)
    return None if fields is None else fields[0][:1].decode("ascii", "replace")


def signal_name(signum: int) -> str:
    """``"SIGKILL"`` for 9; ``"signal 64"`` for a number without a name here."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    st = proc_state(pid)
    return st is not None and st not in ("Z", "X")


def parent_of(pid: int) -> int | None:
    """The parent pid from ``/proc/<pid>/stat``, None if gone."""
    fields = _stat(pid)
    try:
        return None if fields is None else int(fields[1])
    except ValueError:
        return None


def cmdline(pid: int) -> list[str]:
    """``/proc/<pid>/cmdline`` as a list ([] if gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []


def environ_of(pid: int) -> dict[str, str]:
    """The *initial* environment of ``pid`` ({} if unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    return out


_AGENT_MARKS = (
    "torch.distributed.run",
    "unbroken.elastic.launch.standby",
    "unbroken.elastic.launch.agent",
)


def agent_of(worker_pid: int) -> int | None:
    """The torchrun agent above a worker. Under ``unbroken run`` a worker's parent is the
    attempt's fork server (a forked copy of the agent) or its launcher; the agent is the
    nearest ancestor that runs torchrun (a standby, ``python -m unbroken.elastic.launch.agent``
    or ``python -m torch.distributed.run``)
    and whose own parent does not."""

    def runs_torchrun(pid: int) -> bool:
        argv = cmdline(pid)
        return any(m in argv for m in _AGENT_MARKS)

    pid: int | None = worker_pid
    for _ in range(3):
        pid = parent_of(pid) if pid else None
        if pid is None or pid <= 1:
            return None
        if runs_torchrun(pid) and not runs_torchrun(parent_of(pid) or 0):
            return pid
    return None


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


def kill_matching(
    key: str,
    value: str,
    *,
    timeout: float = 5.0,
    sig: int = signal.SIGKILL,
    exclude: Collection[int] = (),
) -> int:
    """Send ``sig`` to every process carrying ``key=value`` (but the pids in ``exclude``)
    until none is left.

    Loops because a dying parent may still spawn. Returns how many distinct processes were
    signalled; logs a warning naming the survivors if any remain after ``timeout`` (a process
    in uninterruptible sleep, e.g. on a hung NFS mount, cannot be killed by anyone).
    """
    signalled: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in pids_with_env(key, value) if p not in exclude]
        if not pids:
            return len(signalled)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
            signalled.add(pid)
        if time.monotonic() > deadline:
            log.warning(
                "processes %s (%s=%s) survive signal %d after %.1f s; they may be in "
                "uninterruptible I/O",
                pids,
                key,
                value,
                sig,
                timeout,
            )
            return len(signalled)
        time.sleep(0.05)


def signal_if_tagged(pid: int, sig: int, key: str, value: str) -> bool:
    """Send ``sig`` to ``pid`` only if its initial environment holds ``key=value`` (a pid
    read from a file is anyone's until proven ours). The check and the signal go through
    one pidfd, so a pid reused in between is never hit. Returns whether it was sent."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return False  # gone (or no pidfds: then nothing read from a file is signalled)
    try:
        if environ_of(pid).get(key) != value:  # /proc/pid is still fd's process (alive)
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class PidWatch:
    """Sleep until one of some processes exits or a timeout passes (Linux pidfds), so the
    supervisor notices a dead worker within milliseconds instead of at its next poll.
    Falls back to a plain sleep where ``pidfd_open`` is missing (Linux < 5.3)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._ok = hasattr(os, "pidfd_open")

    def wait(self, pids: Iterable[int], timeout: float) -> bool:
        """Returns True when woken by an exit, False after ``timeout`` seconds."""
        want = {p for p in pids if p > 0 and is_alive(p)}
        for pid in list(self._fds):
            if pid not in want:
                os.close(self._fds.pop(pid))
        if self._ok:
            for pid in want - self._fds.keys():
                try:
                    self._fds[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    return True  # gone between the check and here: that is an exit
                except OSError:
                    self._ok = False
                    break
        if not self._ok or not self._fds:
            time.sleep(max(0.0, timeout))
            return False
        ready, _, _ = select.select(list(self._fds.values()), [], [], max(0.0, timeout))
        return bool(ready)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
