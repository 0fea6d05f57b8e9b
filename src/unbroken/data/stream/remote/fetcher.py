"""The per-node download process of a remote dataset (``python -m
unbroken.data.stream.remote.fetcher``, or forked).

Started by the first reader of a :class:`~unbroken.data.stream.remote.cache.RemoteCache` that
finds none running: forked from it (milliseconds, everything imported; daemonic, gone with
its parent, whose exit sends it SIGTERM), or, from a DataLoader worker (which may not fork children), a fresh interpreter
whose state - the pickled cache (manifests, order, config; no torch, no transform) - comes
over a pipe into its stdin, never through a file others could replace. It holds
``<cache_dir>/.fetch/<dataset>.lock`` while it runs, so there is one per node and dataset,
prefetches for every live reader, fetches first what a reader waits for, and exits 10-12.5 s
after the last reader is gone (or at SIGTERM), ending its downloads in flight and removing
what dead downloads left on its way out. Between those it sleeps on a doorbell the readers ring
(:mod:`unbroken.data.stream.remote.readers`): its CPU follows the readers' progress and the
downloads, not the wall clock. Downloads run here rather than in the DataLoader workers
because a worker busy decoding holds the GIL and starves the I/O threads of its own process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from unbroken.common.fs import open_private
from unbroken.data.stream.remote.plan import LOG_MAX
from unbroken.data.stream.remote.readers import Doorbell, set_wake

if TYPE_CHECKING:
    from unbroken.data.stream.remote.cache import RemoteCache

__all__ = ["fork_default", "main", "serve", "spawn"]

log = logging.getLogger(__name__)

_CHILDREN: list[Any] = []  # fetcher processes started here (kept to be reaped, not waited for)
_RETRY_FIRST = 0.02  # s before a refused unit is tried again (doubled while nothing moves)
_RETRY_MAX = 1.0


class _Forked:
    """``poll()`` for a multiprocessing child, like ``subprocess.Popen``'s."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    def poll(self) -> int | None:
        return self.proc.exitcode


def fork_default() -> bool:
    """Whether a fetcher started here is forked (cheap) rather than a new interpreter: not
    from a DataLoader worker (a daemon, which may not fork children), nor from a process
    that has run obstore (its runtime does not survive a fork; the child would fall back
    to fsspec, the slower request path)."""
    import multiprocessing

    from unbroken.common.objstore import obstore_runtime_here

    return not (multiprocessing.current_process().daemon or obstore_runtime_here())


def spawn(cache: RemoteCache, fresh: bool | None = None) -> None:
    """Start a fetcher for ``cache``: forked from this process, or (``fresh``; the default
    where :func:`fork_default` says no) a new interpreter."""
    import multiprocessing
    import subprocess

    clone = cache.detached()
    _CHILDREN[:] = [c for c in _CHILDREN if c.poll() is None]  # reap finished ones
    if fresh is None:
        fresh = not fork_default()
    if not fresh:
        # Forked like a DataLoader worker, and like one it never touches CUDA.
        child = multiprocessing.get_context("fork").Process(
            target=serve, args=(clone,), name="unbroken-fetcher", daemon=True
        )
        child.start()
        _CHILDREN.append(_Forked(child))
        return
    payload = pickle.dumps(clone)
    # its log: a fixed name (never followed), started afresh when it reached half its bound;
    # the fetcher keeps it within LOG_MAX (counted at that size in the limit)
    err = open_private(cache.fetch_path(".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        if os.fstat(err).st_size > LOG_MAX // 2:
            os.ftruncate(err, 0)
        proc = subprocess.Popen(
            [sys.executable, "-m", "unbroken.data.stream.remote.fetcher"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=err,
            close_fds=True,
        )
    finally:
        os.close(err)
    _CHILDREN.append(proc)
    # written from a thread: the child reads it all once its interpreter is up
    threading.Thread(
        target=_feed, args=(proc.stdin, payload), name="unbroken-fetcher-feed", daemon=True
    ).start()


def _feed(pipe: Any, payload: bytes) -> None:
    """Write ``payload`` into a child's stdin and close it (a child that died first: nothing
    to do; its readers start another)."""
    try:
        pipe.write(payload)
        pipe.close()
    except OSError:
        pass


def serve(cache: RemoteCache, idle_exit: float = 10.0) -> None:
    """The fetcher's loop (see the module docstring); returns when nobody has read for
    ``idle_exit`` seconds, when the cache directory is gone, or when another fetcher already
    serves. A failed download is the readers' to report (they fetch it themselves after
    ``grace_s``), so nothing here raises."""
    try:
        _serve(cache, idle_exit)
    except FileNotFoundError:
        pass  # the cache directory was removed under us
    except Exception:
        log.exception("fetcher for %s stopped", cache.cache_dir)


def _serve(cache: RemoteCache, idle_exit: float) -> None:
    if not cache.hold_fetch_lock():
        return
    bell = Doorbell(cache.fetch_path(".wake"))
    try:
        with _stop_on_sigterm(bell) as stop:
            try:
                cache.events.write("fetcher", state="start")
                _loop(cache, bell, idle_exit, stop)
                cache.events.write("fetcher", state="stop", sigterm=stop.is_set())
            finally:
                cache.leave()  # often the run's last process: nothing of a download stays
    finally:
        bell.close()


@contextlib.contextmanager
def _stop_on_sigterm(bell: Doorbell) -> Iterator[threading.Event]:
    """An event set (and the loop woken) by SIGTERM: how multiprocessing ends a forked
    fetcher, a daemonic child, when the reader that forked it exits. Dying of it would leave
    the downloads in flight as they are (a temporary file, a reservation) with nobody to
    clean them up before the next run; the loop returns instead and
    :meth:`RemoteCache.leave` ends them. A second SIGTERM ends the process at once."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop  # (serve() run in a thread: only the main thread takes signals)
        return

    def on_term(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stop.set()
        bell.ring()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, old)


def _loop(cache: RemoteCache, bell: Doorbell, idle_exit: float, stop: threading.Event) -> None:
    """Sleep on the doorbell; on each ring (a reader reached the position written into its
    record, or waits for a unit; a download of ours ended) serve what the readers need now and
    write each one's next wake position. Timed wakes only: a check every ``idle_exit / 4``
    (readers gone, the directory removed, anything missed is planned again) and, while a
    unit was refused (another process had it, or no room), a retry with a back-off."""
    st = cache._proc()
    st.pool.on_done = bell.ring
    idle_since = time.monotonic()
    tick = idle_exit / 4
    backoff = _RETRY_FIRST
    timed = True  # the first pass plans for every reader
    while not stop.is_set() and os.path.isdir(cache.cache_dir):
        recs = cache.reader_records()
        now = time.monotonic()
        if recs:
            idle_since = now
        elif now - idle_since > idle_exit:
            return
        for _, epoch, pos, want, _ in recs:
            cache.demand(want, epoch, pos)
        # planned again: a reader that reached its wake position (or is new), every reader
        # on a timed wake
        moved = {(e, p) for _, e, p, _, at in recs if (e, p) >= at}
        if moved:
            backoff = _RETRY_FIRST  # readers moved on: a refused unit is worth trying soon
        due = {(e, p) for _, e, p, _, _ in recs} if timed else moved
        bounds = {ep: cache.prefetch(*ep) for ep in sorted(due)}
        for name, epoch, pos, _, at in recs:
            b = bounds.get((epoch, pos))
            if b is not None and (epoch, b) != at:
                set_wake(cache.cache_dir, name, epoch, b)
        wait = tick
        later = [t for t in list(st.retry_after.values()) if t > now]
        if later:
            wait = min(tick, max(min(later) - now, backoff))
            backoff = min(backoff * 2, _RETRY_MAX)
        timed = not bell.wait(wait)


class _BoundedStderr(logging.StreamHandler):
    """Log lines to stderr, the cache's ``.fetch/<dataset>.log`` (opened O_APPEND by the
    reader that started this process): emptied before it would pass its bound."""

    def __init__(self, cap: int) -> None:
        super().__init__(sys.stderr)
        self.cap = cap

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if os.fstat(2).st_size > self.cap // 2:
                os.ftruncate(2, 0)
        except OSError:
            pass  # not a file (a terminal, a pipe): nothing to bound
        super().emit(record)


def main(argv: list[str]) -> int:
    handler = _BoundedStderr(LOG_MAX)
    handler.setFormatter(logging.Formatter("%(asctime)s fetcher %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    if argv:
        print(
            "usage: python -m unbroken.data.stream.remote.fetcher < PICKLED_CACHE",
            file=sys.stderr,
        )
        return 2
    payload = sys.stdin.buffer.read()  # all of it first: the parent's writer is not kept waiting
    cache = pickle.loads(payload)  # from spawn(), in our parent, over a pipe
    serve(cache)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
