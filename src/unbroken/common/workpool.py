"""Worker processes for the offline preparation commands (``pack``, ``index``, ``tokenize``).

Each worker has its own pipe, and the pool reads a worker's results only from it. When a
worker dies (the kernel's out-of-memory killer, a SIGKILL), its pipe reaches end-of-file,
also in the middle of a message, so the task it held fails at once with
``BrokenProcessPool`` and so does every task not yet started; callers raise
:func:`worker_died` for it, naming what was lost and what to do. Two pools of the standard
library hang there instead:

- ``multiprocessing.Pool`` forks a replacement and never completes the task the dead worker
  held, so the command waited for its result forever;
- ``concurrent.futures.ProcessPoolExecutor`` shares one result pipe among its workers. A
  worker killed while writing a large result (a tokenize chunk, ~1 MiB) leaves the message
  torn, the pipe is still open in the live workers, and the executor's reader waits for the
  rest of it forever (seen in CI, 2026-12-05).

A worker has at most :data:`_DEPTH` tasks sent to it; the rest wait in this process. On the
way out the tasks not sent are cancelled and the ones sent finish, never terminated
mid-write; after an error they get :data:`_DRAIN_S`, then their workers are killed.

Workers are forked (they start in milliseconds and the caller needs no ``if __name__ ==
"__main__"`` guard) and get the default SIGTERM action: a caller's handler (a training
process's preemption flag) is inherited through fork, and a worker that ignores SIGTERM
outlives the command. A worker closes its copies of the pipes of the workers forked before it,
so each pipe's far end lives in exactly one process, and a worker whose caller is gone reads
end-of-file and exits. (A task that forks a process which outlives it, without exec, would give
that process a copy of its worker's end; no caller's task does.)

A task that does not unpickle in its worker, or whose result does not unpickle here, fails
alone with that error; the pool goes on.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, InvalidStateError
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from multiprocessing.reduction import ForkingPickler
from typing import Any

from unbroken.common.procs import signal_name

__all__ = ["WorkerDied", "WorkerPool", "process_pool", "worker_died"]

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """A worker process ended abruptly while a task was in flight."""


class _RemoteTraceback(Exception):
    """The traceback of a task's exception as the worker printed it (its ``__cause__``)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _serve(
    conn: Connection,
    others: list[Connection],
    init: Callable[..., object] | None,
    initargs: tuple[Any, ...],
) -> None:
    """A worker: ``("ready", pid)`` or ``("init", traceback)`` first, then for each task
    ``(fn, args)`` received, ``(True, fn(*args))`` or ``(False, exception, traceback)``, in
    the order received (also for a task that does not unpickle here); ends at ``None`` or
    end-of-file."""
    for c in others:
        c.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # end-of-file or a failed write: the caller is gone; KeyboardInterrupt: Ctrl-C
    with contextlib.suppress(EOFError, OSError, KeyboardInterrupt):
        try:
            if init is not None:
                init(*initargs)
        except BaseException:  # noqa: BLE001 - reported to the caller, which refuses the pool
            conn.send(("init", traceback.format_exc()))
            return
        conn.send(("ready", os.getpid()))
        while True:
            data = conn.recv_bytes()
            try:
                task = ForkingPickler.loads(data)
                if task is None:
                    return
                fn, args = task
                reply: tuple[Any, ...] = (True, fn(*args))
            except BaseException as e:  # noqa: BLE001 - the task's own error goes back to it
                reply = (False, e, traceback.format_exc())
            del data
            try:
                payload = ForkingPickler.dumps(reply)
            except Exception as e:  # noqa: BLE001 - an unpicklable result or exception
                payload = ForkingPickler.dumps(
                    (False, RuntimeError(f"the task's outcome cannot be sent back: {e!r}"), "")
                )
            conn.send_bytes(payload)


_DEPTH = 2
"""Tasks sent to a worker ahead of its results: the one it runs and the next, already in its
pipe, so it never waits for this process (whose reader thread may wait for the GIL for a few
milliseconds) between two tasks. Tokenize of 300k documents, 2 workers, medians of 8 alternated
runs: 3.11 s with one, 3.06 s with two, 3.03 s with ``ProcessPoolExecutor`` (and, with the
reader dispatching, 3.24 s against the executor's 3.24 s in a slower hour)."""


@dataclass(eq=False)
class _Worker:
    proc: Any  # multiprocessing.Process
    conn: Connection
    outbox: queue.SimpleQueue[Any]
    """Pickled tasks for its sender thread to write (None: the end)."""
    tasks: collections.deque[Future[Any]] = field(default_factory=collections.deque)
    """The tasks sent to it, oldest first: its next result is the first's."""
    gone: bool = False


class WorkerPool:
    """``workers`` forked processes, one pipe each (see the module docstring). Use
    :func:`process_pool`, which shuts it down.

    Threads: one reader, which takes every worker's results and deaths and alone decides
    which worker gets which task (:meth:`submit` only queues it and rings the reader's
    doorbell), and one sender per worker, the only thread that writes to its pipe. A write
    can block while the worker computes (a task larger than the pipe's buffer), so the reader
    and the caller never write: a reader blocked on a worker that is itself blocked sending a
    result would wait for good. The caller's thread, where signal handlers run and raise
    (Ctrl-C), touches no worker's bookkeeping, so an exception there cannot leave a task
    recorded as sent and never sent, and a worker's results are matched to its tasks in the
    order they were sent.
    """

    def __init__(
        self,
        workers: int,
        init: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers!r} must be at least 1")
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        ctx: Any = mp.get_context(method)
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[Future[Any], Any]] = collections.deque()
        self._workers: list[_Worker] = []
        self._threads: list[threading.Thread] = []
        self._bell_r = self._bell_w = -1  # the reader's doorbell (a pipe), made after the forks
        self._broken: str | None = None
        self._closing = False
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})
        try:
            try:  # every worker is forked now, under env, before this pool starts a thread
                for _ in range(workers):
                    ours, theirs = ctx.Pipe()
                    # what a forked worker must not keep: this end of its own pipe, the ends
                    # of the pipes of the workers forked before it
                    others = [ours, *(w.conn for w in self._workers)] if method == "fork" else []
                    proc = ctx.Process(target=_serve, args=(theirs, others, init, initargs))
                    proc.start()
                    theirs.close()  # its one copy is the worker's: end-of-file when it dies
                    self._workers.append(_Worker(proc, ours, queue.SimpleQueue()))
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            self._await_ready()
            self._bell_r, self._bell_w = os.pipe()
            os.set_blocking(self._bell_r, False)
            os.set_blocking(self._bell_w, False)
            self._threads.append(threading.Thread(target=self._read, name="unbroken-workpool"))
            self._threads += [
                threading.Thread(target=_send_all, args=(w,), name=f"unbroken-workpool-{i}")
                for i, w in enumerate(self._workers)
            ]
            for t in self._threads:
                t.daemon = True
                t.start()
        except BaseException:  # Ctrl-C during a slow init too: no worker outlives this
            self._kill_all()
            raise

    def _close_bell(self) -> None:
        for fd in (self._bell_r, self._bell_w):
            if fd >= 0:
                os.close(fd)
        self._bell_r = self._bell_w = -1

    @property
    def workers(self) -> int:
        return len(self._workers)

    def _await_ready(self) -> None:
        for w in self._workers:
            why = None
            wait_any([w.conn, w.proc.sentinel])
            try:
                kind, what = w.conn.recv()
            except (EOFError, OSError):
                why = f"worker process {w.proc.pid} {_ending(w.proc)} while starting"
            else:
                if kind != "ready":
                    why = f"worker process {w.proc.pid} failed to start:\n{what}"
            if why is not None:
                raise worker_died("starting the worker processes", BrokenProcessPool(why))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` in a worker (``fn`` a module-level function); its future.
        Raises ``BrokenProcessPool`` once a worker has died, and the pickling error of a
        task that cannot be sent."""
        payload = ForkingPickler.dumps((fn, args))
        fut: Future[Any] = Future()
        with self._lock:
            if self._broken is not None:
                raise BrokenProcessPool(self._broken)
            if self._closing:
                raise RuntimeError("cannot submit a task to a worker pool being shut down")
            self._queue.append((fut, payload))
        self._ring()
        return fut

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        """``fn(item)`` for each of ``items``, in order, at most 2 per worker in flight."""
        pending: collections.deque[Future[Any]] = collections.deque()
        for it in items:
            pending.append(self.submit(fn, it))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def _ring(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: the reader is already woken
            os.write(self._bell_w, b"x")

    def _dispatch(self) -> None:
        """Queued tasks to the live workers with room (fewest sent first); the reader's."""
        with self._lock:
            while self._queue and self._broken is None:
                room = [w for w in self._workers if not w.gone and len(w.tasks) < _DEPTH]
                if not room:
                    return
                fut, payload = self._queue.popleft()
                if not fut.set_running_or_notify_cancel():
                    continue  # cancelled by its caller meanwhile
                w = min(room, key=lambda w: len(w.tasks))
                w.tasks.append(fut)
                w.outbox.put(payload)

    def _read(self) -> None:
        """The reader thread: results to their futures, deaths to :meth:`_died`, queued
        tasks to workers, until every worker has ended. Whatever goes wrong here fails
        every task rather than leave one waiting."""
        try:
            self._read_until_all_ended()
        except BaseException as e:  # no caller here to raise to
            log.exception("the worker pool's reader failed")
            self._fail_all(f"the worker pool's reader failed ({type(e).__name__}: {e})")

    def _read_until_all_ended(self) -> None:
        owner: dict[Any, _Worker] = {}
        for w in self._workers:
            owner[w.conn] = owner[w.proc.sentinel] = w
        while owner:
            self._dispatch()
            for ready in wait_any([self._bell_r, *owner]):
                if ready == self._bell_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._bell_r, 4096)
                    continue
                if ready not in owner:
                    continue
                w = owner[ready]
                try:  # a result, also when the sentinel woke us: the pipe first
                    data = w.conn.recv_bytes() if w.conn.poll() else None
                except (EOFError, OSError):
                    data = None
                if data is None:
                    self._died(w)
                    owner.pop(w.conn, None)
                    owner.pop(w.proc.sentinel, None)
                    continue
                try:
                    reply = ForkingPickler.loads(data)
                except Exception as e:  # noqa: BLE001 - a result that does not unpickle here
                    reply = (False, e, "")
                with self._lock:
                    fut = w.tasks.popleft()
                if reply[0]:
                    fut.set_result(reply[1])
                else:
                    err = reply[1]
                    if reply[2]:
                        err.__cause__ = _RemoteTraceback(reply[2])
                    fut.set_exception(err)

    def _died(self, w: _Worker) -> None:
        """``w`` ended: expected when the pool closed it with no task left; otherwise the
        pool is broken, and its tasks and every queued one fail."""
        with self._lock:
            w.gone = True
            if not w.tasks and self._closing:
                return
        w.outbox.put(None)  # its sender thread ends (a write to it fails anyway)
        self._fail_all(
            f"worker process {w.proc.pid} {_ending(w.proc)} "
            f"{'while running a task' if w.tasks else 'while idle'}",
            w,
        )

    def _fail_all(self, why: str, w: _Worker | None = None) -> None:
        """The pool is broken (``why``): the tasks sent to ``w`` (every worker's, when the
        reader itself failed) and every queued one fail; later submits raise."""
        with self._lock:
            self._broken = self._broken or why
            failed = [fut for fut, _ in self._queue]
            self._queue.clear()
            for v in self._workers if w is None else [w]:
                failed += v.tasks
                v.tasks.clear()
        for f in failed:
            with contextlib.suppress(InvalidStateError):  # cancelled by its caller
                f.set_exception(BrokenProcessPool(why))

    def shutdown(self, *, error: bool = False) -> None:
        """Cancel the tasks not sent and end every worker once the tasks sent to it are
        done; after an ``error``, a worker still running :data:`_DRAIN_S` later is killed."""
        with self._lock:
            self._closing = True
            queued = [fut for fut, _ in self._queue]
            self._queue.clear()
        for fut in queued:  # outside the lock: cancel() runs the future's callbacks
            fut.cancel()
        for w in self._workers:
            w.outbox.put(None)  # after the tasks already sent
        procs = [w.proc for w in self._workers]
        running = _wait_exit(procs, _DRAIN_S if error else None)
        for p in running:
            log.warning(
                "worker process %d still running %.3g s after the error; killed", p.pid, _DRAIN_S
            )
            p.kill()
        self._ring()  # a reader that failed is not waiting; one that waits sees the deaths
        for t in self._threads:
            t.join(5.0)
        self._release(_wait_exit(running, 5.0))
        self._close_bell()

    def _kill_all(self) -> None:
        for w in self._workers:
            w.proc.kill()
        self._release(_wait_exit([w.proc for w in self._workers], 5.0))
        self._close_bell()

    def _release(self, running: list[Any]) -> None:
        """Close the pipes and reap every worker that has ended (its sentinel fired: it
        has exited, so its pid cannot be another process's before it is reaped); those
        still ``running`` are left to the interpreter's own reaping."""
        for w in self._workers:
            w.conn.close()
            if w.proc not in running:
                w.proc.join()
                w.proc.close()


def _send_all(w: _Worker) -> None:
    """A worker's sender thread: its outbox to its pipe, until None or a failed write (the
    worker died: the reader reports it)."""
    while (payload := w.outbox.get()) is not None:
        try:
            w.conn.send_bytes(payload)
        except OSError:
            return
    with contextlib.suppress(OSError):
        w.conn.send(None)


@contextlib.contextmanager
def process_pool(
    workers: int,
    init: Callable[..., object] | None = None,
    initargs: tuple[Any, ...] = (),
    *,
    env: Mapping[str, str] | None = None,
) -> Iterator[WorkerPool]:
    """``workers`` processes, each running ``init(*initargs)`` first, started before this
    returns with ``env`` set in their environment (and in this process only while they are
    forked). Shut down on exit: tasks not yet sent to a worker are cancelled, the ones sent
    (at most :data:`_DEPTH` a worker) finish (after an error, within :data:`_DRAIN_S`)."""
    pool = WorkerPool(workers, init, initargs, env=env)
    try:
        yield pool
    except BaseException:
        pool.shutdown(error=True)
        raise
    pool.shutdown()


_DRAIN_S = 60.0
"""After an error, how long the tasks already running get to finish (a shard being written
commits or aborts) before their workers are killed: a hung worker must not hold the error."""


def _ending(proc: Any) -> str:
    """How a worker that ended did (its exit status, once the kernel has it)."""
    proc.join(1.0)
    code = proc.exitcode
    if code is None:
        return "ended"
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    return f"exited with status {code}"


def _wait_exit(procs: list[Any], seconds: float | None) -> list[Any]:
    """Wait up to ``seconds`` (None: for good) for every process of ``procs`` to exit; those
    still running. Waits on each process's sentinel, which never reaps it, so a pid killed
    afterwards is still that worker."""
    pending = {p.sentinel: p for p in procs}
    deadline = None if seconds is None else time.monotonic() + seconds
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
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
