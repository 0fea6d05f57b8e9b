"""A small priority thread pool for downloads: the unit needed soonest first (a reader's
demand jumps the prefetch queue), one task per unit at a time, stoppable mid-download."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

__all__ = ["Pool"]


class Pool:
    """Download threads taking the unit needed soonest first (a reader's demand jumps the
    prefetch queue); one task per unit at a time."""

    def __init__(self, threads: int, fn: Callable[[int, int], str], name: str) -> None:
        self._fn = fn
        self._n = threads
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, int]] = []
        # uid -> (future, prio, seq); seq -1 once running
        self._tasks: dict[int, tuple[Future[str], int, int]] = {}
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self.stopping = False
        self.on_done: Callable[[], None] | None = None  # told after each task (the fetcher)

    def submit(self, uid: int, prio: int) -> Future[str]:
        with self._cond:
            task = self._tasks.get(uid)
            if task is not None:
                fut, old, queued = task
                if queued >= 0 and prio < old:  # more urgent: queue again, skip the stale entry
                    seq = next(self._seq)
                    self._tasks[uid] = (fut, prio, seq)
                    heapq.heappush(self._heap, (prio, seq, uid))
                    self._cond.notify()
                return fut
            fut = Future()
            seq = next(self._seq)
            self._tasks[uid] = (fut, prio, seq)
            heapq.heappush(self._heap, (prio, seq, uid))
            if self._idle == 0 and len(self._threads) < self._n:
                t = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
            self._cond.notify()
            return fut

    def busy(self, uid: int) -> bool:
        with self._cond:
            return uid in self._tasks

    def drop_queued(self, keep: int = -1, only: int = -1) -> None:
        """Forget the tasks not started yet (except unit ``keep``; only unit ``only``)."""
        with self._cond:
            for uid, (fut, _, seq) in list(self._tasks.items()):
                if seq >= 0 and uid != keep and only in (-1, uid):
                    del self._tasks[uid]
                    fut.cancel()

    def stop(self, timeout: float) -> None:
        """Drop the queued tasks, make the running downloads abort (``stopping`` is checked as
        bytes arrive: their partial files and reservations are removed) and wait for them."""
        with self._cond:
            self.stopping = True
            self._heap.clear()
            for uid, (fut, _, seq) in list(self._tasks.items()):
                if seq >= 0:
                    del self._tasks[uid]
                    fut.cancel()
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while not self._heap:
                        if self.stopping:
                            return
                        self._idle += 1
                        self._cond.wait()
                        self._idle -= 1
                    prio, seq, uid = heapq.heappop(self._heap)
                    task = self._tasks.get(uid)
                    if task is not None and task[2] == seq:
                        self._tasks[uid] = (task[0], prio, -1)
                        break
            fut = task[0]
            fut.set_running_or_notify_cancel()
            try:
                res = self._fn(uid, prio)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the unit
                with self._cond:
                    self._tasks.pop(uid, None)
                fut.set_exception(e)
            else:
                with self._cond:
                    self._tasks.pop(uid, None)
                fut.set_result(res)
            if self.on_done is not None:
                self.on_done()
