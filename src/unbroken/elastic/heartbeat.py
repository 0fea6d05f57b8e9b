"""Progress beacons from the training loop, and the hang watchdog that reads them.

:func:`beat` costs well under a microsecond of Python work and no system call: each process
owns one 72-byte file mapped into memory (``MAP_SHARED``) in
``RUN_DIR/beats/a<attempt>/r<rank>-p<pid>.beat``, and a beat is one ``pack_into``. The page
cache makes the bytes visible to the supervisor at once (:func:`read_beats`,
:func:`stalled`), and they survive the process being SIGKILLed.

After its last step a process calls :func:`finishing` (and does so by itself at interpreter
exit): from then on it saves and exits, and the watchdog gives it the finish timeout
(``unbroken run --shutdown-timeout``, at least ``--hang-timeout``) from that moment instead of
the hang timeout from its last beat. Its final save and teardown are not a hang, however
long the last step's beat is behind them.

The first beat (or :func:`install`) also registers :mod:`faulthandler` on
:data:`DUMP_SIGNAL`, which writes every thread's Python stack to
``RUN_DIR/stacks/a<attempt>-r<rank>-p<pid>.txt`` when the supervisor asks
(:func:`request_stack_dumps`) before killing a hung worker group. The signal is ignored
under that handler, so a request that comes while the interpreter finalizes (faulthandler
is gone by then and restores what it found) cannot kill the process with ``-SIGUSR2``.

Both directories are 0700 and both files 0600, opened without following symlinks
(T-SHARED-NODE). A beacon's pid is only a claim: the supervisor signals it only when that
process carries the attempt's token, so a planted beacon cannot aim a signal anywhere.

The beacon layout: ARCHITECTURE.md, "Design notes" > elastic > heartbeats.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import mmap
import os
import signal
import struct
import threading
import time
from dataclasses import dataclass
from typing import IO

from unbroken.common import events
from unbroken.common.fs import open_private
from unbroken.common.procs import is_alive, proc_state, signal_if_tagged

__all__ = [
    "DUMP_SIGNAL",
    "BeatRecord",
    "beat",
    "beat_dir",
    "finishing",
    "hang_began",
    "install",
    "read_beats",
    "remove_empty_dumps",
    "request_stack_dumps",
    "stack_dir",
    "stalled",
]

log = logging.getLogger(__name__)

DUMP_SIGNAL = signal.SIGUSR2
"""Signal on which a worker writes its Python stacks (``faulthandler``)."""

_MAGIC = b"UBHB"
_VERSION = 2
_HEAD = struct.Struct("<4sIqqq")
_BODY = struct.Struct("<QqddQ")  # seq, step, time of the last beat, time of finishing(), seq
_SIZE = _HEAD.size + _BODY.size
_NO_TARGET = 1 << 62


def beat_dir(run_dir: str, attempt: int) -> str:
    return os.path.join(run_dir, "beats", f"a{attempt}")


def stack_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "stacks")


class _Beacon:
    __slots__ = ("mm", "seq", "step", "t", "target", "rank", "local_rank", "_stack_file")

    def __init__(
        self, run_dir: str, attempt: int, rank: int, target: int, local_rank: int = 0
    ) -> None:
        d = events.private_subdir(run_dir, "beats", f"a{attempt}")
        pid = os.getpid()
        path = os.path.join(d, f"r{rank}-p{pid}.beat")
        fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w+b") as f:
            f.write(_HEAD.pack(_MAGIC, _VERSION, pid, rank, attempt) + bytes(_BODY.size))
            f.flush()
            self.mm = mmap.mmap(f.fileno(), _SIZE)  # the mapping outlives the file object
        self.seq = 0
        self.step = -1
        self.t = 0.0
        self.target = target
        self.rank = rank
        self.local_rank = local_rank
        sd = events.private_subdir(run_dir, "stacks")
        # faulthandler writes through this fd from a signal handler; keep it open for life.
        name = os.path.join(sd, f"a{attempt}-r{rank}-p{pid}.txt")
        self._stack_file: IO[str] = os.fdopen(
            open_private(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w"
        )
        if threading.current_thread() is threading.main_thread():
            # what faulthandler restores when the interpreter finalizes: a late request
            # for stacks is then ignored instead of killing a process that is exiting
            signal.signal(DUMP_SIGNAL, signal.SIG_IGN)
        faulthandler.register(DUMP_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        atexit.register(finishing)

    def caught_up(self, step: int) -> None:
        self.target = _NO_TARGET
        if self.local_rank == 0:  # one mark per node: each supervisor measures its own
            events.mark("caught_up", step=step)


_beacon: _Beacon | None = None
_disabled = False
_pack = _BODY.pack_into
_now = time.time


def _reset_after_fork() -> None:
    global _beacon, _disabled
    _beacon, _disabled = None, False


os.register_at_fork(after_in_child=_reset_after_fork)


def install() -> bool:
    """Create this process's beacon and stack-dump hook now (the first :func:`beat` does it
    anyway). Call it early to get a stack dump even for a hang before the first step.
    Returns False (and does nothing) when not running under ``unbroken run``."""
    global _beacon, _disabled
    if _beacon is not None:
        return True
    if _disabled:
        return False
    run_dir = os.environ.get(events.ENV_RUN_DIR)
    if not run_dir:
        _disabled = True
        return False
    attempt = int(os.environ.get(events.ENV_ATTEMPT, "0"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    target = os.environ.get(events.ENV_CATCHUP)
    try:
        _beacon = _Beacon(run_dir, attempt, rank, int(target) if target else _NO_TARGET, local_rank)
    except OSError as e:
        log.warning("heartbeat disabled: cannot create beacon under %s: %s", run_dir, e)
        _disabled = True
        return False
    return True


def beat(step: int) -> None:
    """Record that the loop reached ``step``. Call once per step; no-op when unsupervised."""
    b = _beacon
    if b is None:
        if _disabled or not install():
            return
        b = _beacon
        if b is None:
            return
    b.seq += 1
    b.step, b.t = step, _now()
    _pack(b.mm, 32, b.seq, step, b.t, 0.0, b.seq)
    if step >= b.target:
        b.caught_up(step)


def finishing() -> None:
    """Say that the loop has ended: this process now saves and exits. The watchdog then
    waits the finish timeout (``--shutdown-timeout``, at least ``--hang-timeout``) from now
    instead of the hang timeout from the last beat. Call it after the last step; it also
    runs at interpreter exit. No-op when unsupervised or before the first beat; the next
    :func:`beat` takes it back."""
    b = _beacon
    if b is None or b.seq == 0:
        return
    b.seq += 1
    _pack(b.mm, 32, b.seq, b.step, b.t, _now(), b.seq)


@dataclass(frozen=True)
class BeatRecord:
    path: str
    pid: int
    rank: int
    attempt: int
    seq: int
    step: int
    t: float
    """Unix time of the last beat (0.0 if none yet)."""
    finished: float = 0.0
    """Unix time the process said its loop ended (:func:`finishing`); 0.0 while it trains."""

    @property
    def started(self) -> bool:
        return self.seq > 0


def _read_one(path: str) -> BeatRecord | None:
    for _ in range(5):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read(_SIZE)
        if len(data) < _SIZE:
            return None
        magic, version, pid, rank, attempt = _HEAD.unpack_from(data, 0)
        if magic != _MAGIC or version != _VERSION:
            return None
        seq, step, t, finished, seq2 = _BODY.unpack_from(data, _HEAD.size)
        if seq == seq2:
            if not seq:
                return BeatRecord(path, pid, rank, attempt, 0, -1, 0.0)
            return BeatRecord(path, pid, rank, attempt, seq, step, t, finished)
    return None  # writer too busy to catch a consistent copy; try at the next poll


def read_beats(run_dir: str, attempt: int) -> list[BeatRecord]:
    """Every beacon of an attempt (live or dead processes), sorted by rank."""
    d = beat_dir(run_dir, attempt)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    recs = [_read_one(os.path.join(d, n)) for n in names if n.endswith(".beat")]
    return sorted((r for r in recs if r is not None), key=lambda r: (r.rank, r.pid))


def _since(b: BeatRecord) -> float:
    """When the beacon last made progress: its last beat, or its :func:`finishing`."""
    return b.finished or b.t


def stalled(
    beats: list[BeatRecord], now: float, hang_timeout: float, finish_timeout: float = 0.0
) -> list[BeatRecord]:
    """Live, started beacons whose last beat is older than ``hang_timeout`` seconds, or
    that said :func:`finishing` more than ``max(hang_timeout, finish_timeout)`` s ago."""
    finish = max(hang_timeout, finish_timeout)
    return [
        b
        for b in beats
        if b.started
        and now - _since(b) > (finish if b.finished else hang_timeout)
        and is_alive(b.pid)
    ]


def hang_began(beats: list[BeatRecord], hung: list[BeatRecord]) -> float | None:
    """When the hang began: the last beat (or finishing) of the hung ranks (a healthy rank
    may beat once more, then wait in the collective), else the last beat of any rank (hung
    before their first beat); None when nothing beat at all."""
    started = [_since(b) for b in hung if b.started] or [b.t for b in beats if b.started]
    return max(started) if started else None


def request_stack_dumps(
    run_dir: str, beats: list[BeatRecord], grace: float, token: tuple[str, str]
) -> list[str]:
    """Ask each live beacon owner for its stacks; wait up to ``grace`` s; return dump files.

    Only processes whose environment holds ``token`` (``(key, value)``: the attempt's
    token) are asked: a beacon's pid is whatever its file says. A SIGSTOPped worker cannot
    run a signal handler, so it gets SIGCONT after the dump signal: it then writes where it
    was stopped (it is killed right after anyway).
    """
    asked: list[str] = []
    for b in beats:
        if not signal_if_tagged(b.pid, DUMP_SIGNAL, *token):
            continue
        path = os.path.join(stack_dir(run_dir), f"a{b.attempt}-r{b.rank}-p{b.pid}.txt")
        if proc_state(b.pid) == "T":
            signal_if_tagged(b.pid, signal.SIGCONT, *token)
        asked.append(path)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not all(_nonempty(p) for p in asked):
        time.sleep(0.05)
    time.sleep(0.05)  # let a dump that just started finish its last thread
    return [p for p in asked if _nonempty(p)]


def remove_empty_dumps(run_dir: str, attempt: int) -> int:
    """Delete the attempt's stack-dump files that were never written; returns how many."""
    d = stack_dir(run_dir)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return 0
    n = 0
    for name in names:
        if name.startswith(f"a{attempt}-") and name.endswith(".txt"):
            path = os.path.join(d, name)
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(path).st_size == 0:
                    os.unlink(path)
                    n += 1
    return n


def _nonempty(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False
