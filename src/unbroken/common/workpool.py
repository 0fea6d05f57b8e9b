"""Worker processes for the offline preparation commands (``pack``, ``index``, ``tokenize``).

A ``concurrent.futures.ProcessPoolExecutor``, not ``multiprocessing.Pool``: when a worker
dies (the kernel's out-of-memory killer, a SIGKILL), ``Pool`` forks a replacement and the
task that worker held never completes, so the command waited for its result forever. The
executor notices the dead process and fails every task in flight (``BrokenProcessPool``);
callers raise :func:`worker_died` for it, naming what was lost and what to do. On the way
out the pool is shut down with the tasks not yet started cancelled and the running ones
finished, never terminated mid-write (a worker killed while writing its result leaves a
torn message, and ``Pool``'s result thread then waited for the rest of it forever).

Workers are forked (they start in milliseconds and the caller needs no ``if __name__ ==
"__main__"`` guard) and get the default SIGTERM action: a caller's handler (a training
process's preemption flag) is inherited through fork, and a worker that ignores SIGTERM
outlives the command.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import wait as wait_any
from typing import Any

__all__ = ["WorkerDied", "process_pool", "worker_died"]

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """A worker process ended abruptly while a task was in flight."""


def _start(init: Callable[..., object] | None, args: tuple[Any, ...]) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if init is not None:
        init(*args)


def _ready() -> int:
    return os.getpid()


@contextlib.contextmanager
def process_pool(
    workers: int,
    init: Callable[..., object] | None = None,
    initargs: tuple[Any, ...] = (),
    *,
    env: Mapping[str, str] | None = None,
) -> Iterator[ProcessPoolExecutor]:
    """``workers`` processes, each running ``init(*initargs)`` first, started before this
    returns with ``env`` set in their environment (and in this process only while they are
    forked). Shut down on exit: tasks not started are cancelled, running ones finish (after
    an error, within :data:`_DRAIN_S`)."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(
        workers, mp_context=mp.get_context(method), initializer=_start, initargs=(init, initargs)
    )
    try:
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})
        try:  # with fork, the first task starts every worker: forked now, under env
            pool.submit(_ready).result()
        except BrokenProcessPool as e:
            raise worker_died("starting the worker processes", e) from None
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        yield pool
    except BaseException:
        # the executor's own table of its processes (private; shutdown() drops it)
        procs = list((getattr(pool, "_processes", None) or {}).values())
        if procs:  # without the table, the shutdown below waits for the running tasks
            pool.shutdown(wait=False, cancel_futures=True)
            _stop_workers(procs)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_DRAIN_S = 60.0
"""After an error, how long the tasks already running get to finish (a shard being written
commits or aborts) before their workers are killed: a hung worker must not hold the error."""


def _stop_workers(procs: list[Any]) -> None:
    """Wait up to :data:`_DRAIN_S` for the workers ``procs`` of a pool being shut down to
    exit, then SIGKILL those still running, and wait for them to be gone. Waits on each
    process's sentinel, which never reaps it, so a pid killed here is still that worker."""
    running = _wait_exit(procs, _DRAIN_S)
    for p in running:
        log.warning(
            "worker process %d still running %.3g s after the error; killed", p.pid, _DRAIN_S
        )
        p.kill()
    _wait_exit(running, 5.0)  # a SIGKILL takes effect asynchronously


def _wait_exit(procs: list[Any], seconds: float) -> list[Any]:
    """Wait up to ``seconds`` for every process of ``procs`` to exit; those still running."""
    pending = {p.sentinel: p for p in procs}
    deadline = time.monotonic() + seconds
    while pending and (left := deadline - time.monotonic()) > 0:
        for ready in wait_any(list(pending), left):
            pending.pop(ready)
    return list(pending.values())


def worker_died(what: str, broken: BaseException) -> WorkerDied:
    """The error for a pool ``broken`` by a dead worker (``BrokenProcessPool``, raised by
    the futures in flight and by every later ``submit``); ``what``: the first input not
    published (e.g. ``"corpus.jsonl:1 to corpus.jsonl:900"``)."""
    return WorkerDied(
        f"{what}: a worker process ended abruptly ({str(broken).rstrip('.')}; a worker killed by the "
        "kernel's out-of-memory killer leaves a line in `dmesg`); nothing from here on was "
        "published. Run the command again (pack and tokenize resume from the shards "
        "already committed), with fewer --workers if memory ran out"
    )
