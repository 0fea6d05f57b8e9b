"""The preparation commands' worker processes (``common/workpool.py``).

A worker killed mid-run (the kernel's out-of-memory killer sends SIGKILL) must fail the
command by name within seconds and lose nothing committed: ``multiprocessing.Pool`` forked a
replacement and waited for the lost task's result forever (``unbroken tokenize`` hung so when
one of its workers was SIGKILLed, 2026-12-05), and ``ProcessPoolExecutor`` waited for the
rest of a result torn in its one shared result pipe forever (a tokenize worker killed while
sending a chunk's ~1 MiB of tokens, seen in CI, 2026-12-05)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np
import pytest

from unbroken.common import workpool
from unbroken.common.procs import _stat, children_of, is_alive
from unbroken.common.workpool import WorkerDied, process_pool
from unbroken.data.manifest import MANIFEST_NAME, DatasetManifest
from unbroken.data.prepare.pack import index_directory, pack
from unbroken.data.tokens.tokenizer import tokenize

pytestmark = pytest.mark.timeout(120)  # a hang is the defect these tests guard against


def _report_and_hold(fd: int) -> None:
    os.write(fd, f"{os.getpid()}\n".encode())
    threading.Event().wait(120)  # until killed


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _what_it_runs_with(key: str) -> tuple[Any, str | None]:
    return signal.getsignal(signal.SIGTERM), os.environ.get(key)


def test_a_worker_killed_mid_task_fails_its_task_and_the_pool_still_ends() -> None:
    r, w = os.pipe()
    try:
        with process_pool(2) as pool:
            fut = pool.submit(_report_and_hold, w)
            pid = int(os.read(r, 64).split()[0])  # the task is running in this worker
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(BrokenProcessPool):
                fut.result(timeout=60)
            with pytest.raises(BrokenProcessPool):
                pool.submit(_what_it_runs_with, "X")
    finally:
        os.close(r)
        os.close(w)


def _bytes_read() -> int:
    """What this process has read so far (every thread, /proc/self/io's ``rchar``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _report_then_return(fd: int, n: int) -> bytes:
    os.write(fd, f"{os.getpid()}\n".encode())
    return bytes(n)


def test_a_worker_killed_while_sending_its_result_fails_its_task_and_the_pool_still_ends() -> None:
    """The torn message: a 256 MiB result, its worker killed once 16 MiB of it has been read.
    ``ProcessPoolExecutor`` (shared result pipe) hung here: the task never failed and the
    shutdown never returned (checked 2026-12-05 under a 90 s timeout)."""
    r, w = os.pipe()
    try:
        with process_pool(2) as pool:
            before = _bytes_read()
            fut = pool.submit(_report_then_return, w, 256 << 20)
            pid = int(os.read(r, 64).split()[0])
            while _bytes_read() - before < (16 << 20) and not fut.done():
                time.sleep(0.0005)  # polling a counter, not waiting for an event
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(
                BrokenProcessPool, match=f"worker process {pid} was killed by SIGKILL"
            ):
                fut.result(timeout=60)
    finally:
        os.close(r)
        os.close(w)


def _fail(x: int) -> None:
    raise KeyError(f"no key {x}")


def test_a_tasks_own_error_reaches_its_caller_with_the_workers_traceback() -> None:
    before = set(children_of(os.getpid()))
    with process_pool(2) as pool:
        fut = pool.submit(_fail, 7)
        with pytest.raises(KeyError, match="no key 7") as e:
            fut.result(timeout=60)
        assert "_fail" in str(e.value.__cause__)  # the traceback as the worker saw it
        assert list(pool.map(abs, [-1, -2, -3])) == [1, 2, 3]  # the pool is not broken
    # ended and reaped by the time the pool is left: no zombie waits for a later reaping
    assert set(children_of(os.getpid())) - before == set()


_ORPHAN = """
import os, signal, sys, time
from unbroken.common.procs import children_of
from unbroken.common.workpool import process_pool
with process_pool(2) as pool:
    assert pool.submit(abs, -1).result() == 1
    print(*children_of(os.getpid()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_end_when_their_caller_is_killed() -> None:
    """Each pipe's far end lives in one process only, so a worker reads end-of-file when
    its caller is gone instead of waiting for a task for good."""
    out = subprocess.run(
        [sys.executable, "-c", _ORPHAN], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    workers = [int(p) for p in out.stdout.split()]
    assert len(workers) == 2
    gone = time.monotonic() + 30
    while any(is_alive(p) for p in workers) and time.monotonic() < gone:
        time.sleep(0.01)
    assert not any(is_alive(p) for p in workers)


def _hold_then_fail(w: int, r: int) -> int:
    """A pool whose task holds its worker while the caller raises; the worker's pid."""
    pid = -1
    with pytest.raises(ValueError, match="the caller's own"), process_pool(2) as pool:
        pool.submit(_report_and_hold, w)
        pid = int(os.read(r, 64).split()[0])
        raise ValueError("the caller's own error")
    return pid


def test_after_an_error_a_hung_task_gets_a_deadline_then_its_worker_is_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that never finishes its task must not hold the caller's error for good."""
    monkeypatch.setattr(workpool, "_DRAIN_S", 0.5)
    r, w = os.pipe()
    try:
        pid = _hold_then_fail(w, r)
        # killed, its files closed (its sentinel); it leaves the process table a moment later
        gone = time.monotonic() + 30
        while is_alive(pid) and time.monotonic() < gone:
            time.sleep(0.01)
        assert not is_alive(pid)
    finally:
        os.close(r)
        os.close(w)


def _refuse() -> None:
    raise ValueError("this argument does not unpickle in a worker")


class _BadInWorker:
    """Pickles in the caller; unpickling it raises (a ``__setstate__`` that refuses)."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _refuse, ()


def test_a_task_that_does_not_unpickle_in_its_worker_fails_alone() -> None:
    """Before: the worker died of it, so every task failed and the error blamed the
    out-of-memory killer."""
    with process_pool(2) as pool:
        bad = pool.submit(abs, _BadInWorker())
        with pytest.raises(ValueError, match="does not unpickle"):
            bad.result(timeout=60)
        assert list(pool.map(abs, [-1, -2, -3, -4])) == [1, 2, 3, 4]


def test_a_callback_of_a_task_cancelled_at_shutdown_may_call_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: ``shutdown`` cancelled the queued tasks under the pool's lock, and a done
    callback that submits (keep-N-in-flight code) waited for that lock for good."""
    monkeypatch.setattr(workpool, "_DRAIN_S", 0.5)  # the holding task is killed after it
    said: list[str] = []
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="the caller's own"), process_pool(1) as pool:
            futs = [pool.submit(_report_and_hold, w)]  # holds the one worker
            futs += [pool.submit(abs, -i) for i in range(3)]  # one more sent, two queued
            os.read(r, 64)

            def again(_: object) -> None:
                try:
                    pool.submit(abs, -1)
                except RuntimeError as e:
                    said.append(str(e))

            futs[-1].add_done_callback(again)
            raise ValueError("the caller's own error")
    finally:
        os.close(r)
        os.close(w)
    assert futs[-1].cancelled()
    assert said == ["cannot submit a task to a worker pool being shut down"]


class _Tick(Exception):
    pass


def _lines_of_submit() -> list[int]:
    """The lines of ``workpool.py`` that ``submit`` runs in the caller's thread."""
    seen: set[int] = set()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != workpool.__file__:
            return None
        if event == "line":
            seen.add(frame.f_lineno)
        return trace

    with process_pool(2) as pool:
        sys.settrace(trace)
        try:
            futs = [pool.submit(abs, -i) for i in range(8)]
        finally:
            sys.settrace(None)
        assert [f.result(timeout=60) for f in futs] == list(range(8))
    return sorted(seen)


def _raise_once_at(line: int, hit: list[bool]) -> Any:
    """A trace function raising :class:`_Tick` the first time ``workpool.py:line`` runs."""

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != workpool.__file__:
            return None
        if event == "line" and frame.f_lineno == line and not hit[0]:
            hit[0] = True
            raise _Tick(line)
        return trace

    return trace


def test_an_exception_at_any_line_of_submit_never_gives_a_task_another_ones_result() -> None:
    """A signal handler that raises (Ctrl-C's) runs in the caller's thread, between any two
    statements of ``submit``. Here an exception is raised at each line ``submit`` runs, in
    turn (a trace function, in this thread only), from the 3rd of 8 submits on. Before, one
    landing between recording a task as sent to a worker and sending it shifted that
    worker's later results onto the futures before theirs, and one future never completed.
    The caller's thread now only queues; the reader thread, where no handler runs, sends."""
    lines = _lines_of_submit()
    raised = []
    for line in lines:
        hit = [False]
        trace = _raise_once_at(line, hit)
        with process_pool(2) as pool:
            futs = {}
            for i in range(8):
                if i >= 2 and not hit[0]:
                    sys.settrace(trace)
                try:
                    futs[i] = pool.submit(abs, -i)
                except _Tick:
                    pass
                finally:
                    sys.settrace(None)
            got = {i: f.result(timeout=30) for i, f in futs.items()}
            assert got == {i: i for i in futs}, f"an exception at workpool.py:{line}"
        if hit[0]:
            raised.append(line)
    assert len(raised) >= 5, (lines, raised)  # every statement of submit's one path


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_an_error_while_the_workers_start_leaves_none_running() -> None:
    """Ctrl-C (here an alarm's handler) while the workers run a slow ``init``: before, they
    outlived the error, and an interpreter exiting on it waited for them for good."""

    def tick(*_: object) -> None:
        raise _Tick

    before = set(children_of(os.getpid()))
    previous = signal.signal(signal.SIGUSR1, tick)
    try:
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
        with pytest.raises(_Tick):  # wherever it lands on a stalled box, it lands in here
            timer.start()
            with process_pool(2, _sleep, (60.0,)):
                pass
        timer.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    left = [p for p in children_of(os.getpid()) if p not in before and is_alive(p)]
    assert left == []  # killed and reaped before the error left the pool


def test_an_error_of_pack_with_a_task_hung_ends_within_the_pools_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``pack``'s driver waited, unbounded, for every shard in flight before the pool's
    error path (``_DRAIN_S``, then SIGKILL) could run: a hung worker held the error for good."""
    from unbroken.data.prepare.pack import _drive

    monkeypatch.setattr(workpool, "_DRAIN_S", 0.5)

    def on_done(i: int, info: object, kept: bool) -> None:
        raise OSError(f"disk full while recording shard {i}")

    t0 = time.monotonic()
    with pytest.raises(OSError, match="disk full"), process_pool(2) as pool:
        # the second shard's task hangs; recording the first one's result fails
        seconds: list[Any] = [0.01, 3600.0, 0.01]  # stand-ins for the shards' tasks
        _drive(iter(seconds), lambda t: pool.submit(_hang_or_shard, t), 4, on_done)
    assert time.monotonic() - t0 < 30


def _hang_or_shard(seconds: float) -> tuple[int, None, bool]:
    time.sleep(seconds)
    return 0, None, False


def test_a_worker_dead_while_starting_is_named_as_such() -> None:
    with (
        pytest.raises(WorkerDied, match=r"^starting the worker processes: a worker process"),
        process_pool(2, _die),
    ):
        pass


def test_workers_get_the_default_sigterm_and_the_env_which_the_caller_does_not_keep() -> None:
    """A training process's SIGTERM handler (the preemption flag) must not reach the
    workers: one that ignores SIGTERM outlives the command."""
    key = "UNBROKEN_TEST_WORKPOOL_ENV"
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        with process_pool(2, env={key: "yes"}) as pool:
            got = [pool.submit(_what_it_runs_with, key).result() for _ in range(4)]
        assert got == [(signal.SIG_DFL, "yes")] * 4
        assert key not in os.environ
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cpu_ticks(pid: int) -> int:
    fields = _stat(pid)  # /proc/<pid>/stat after the command name, as procs reads it
    return -1 if fields is None or len(fields) < 13 else int(fields[11]) + int(fields[12])


class _KillABusyWorker:
    """SIGKILLs the first new child of this process to have used 50 ms of CPU (a worker of
    the pool the code under test started, busy with its first tasks)."""

    def __enter__(self) -> _KillABusyWorker:
        self.before = set(children_of(os.getpid()))
        self.killed: int | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(0.002):
            for pid in children_of(os.getpid()):
                if pid not in self.before and _cpu_ticks(pid) >= 5:
                    os.kill(pid, signal.SIGKILL)
                    self.killed = pid
                    return

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


_WORDS = np.array("the cat sat on a mat while dogs ran far away".split())


def _corpus(path: str, n: int) -> str:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(_WORDS, 60))}) + "\n")
    return path


def test_a_worker_killed_mid_tokenize_fails_the_run_by_name_and_a_rerun_completes(
    tmp_path: str,
) -> None:
    small = _corpus(os.path.join(tmp_path, "small.jsonl"), 300)
    tokenize(small, os.path.join(tmp_path, "bpe"), train_bpe_vocab=300, workers=1, progress=False)
    tok = os.path.join(tmp_path, "bpe", "tokenizer.json")
    big = _corpus(os.path.join(tmp_path, "big.jsonl"), 50_000)
    out = os.path.join(tmp_path, "out")
    with _KillABusyWorker() as killer, pytest.raises(WorkerDied) as e:
        tokenize(big, out, tokenizer=tok, workers=2, progress=False)
    assert killer.killed is not None
    assert "big.jsonl:" in str(e.value) and "Run the command again" in str(e.value)
    assert not os.path.exists(os.path.join(out, MANIFEST_NAME))
    again = tokenize(big, out, tokenizer=tok, workers=2, progress=False)
    clean = tokenize(big, os.path.join(tmp_path, "clean"), tokenizer=tok, workers=1, progress=False)
    assert again.documents == clean.documents == 50_000
    assert [s.checksum for s in DatasetManifest.load(out).shards] == [
        s.checksum for s in DatasetManifest.load(os.path.join(tmp_path, "clean")).shards
    ]


def test_a_worker_killed_mid_pack_fails_the_run_by_name_and_a_rerun_completes(
    tmp_path: str,
) -> None:
    src = os.path.join(tmp_path, "in.jsonl")
    rng = np.random.default_rng(1)
    with open(src, "w") as f:
        f.writelines(
            json.dumps({"i": i, "pad": rng.bytes(3000).hex()}) + "\n" for i in range(20_000)
        )
    out = os.path.join(tmp_path, "out")
    with _KillABusyWorker() as killer, pytest.raises(WorkerDied) as e:
        pack(src, out, shard_size=1 << 20, workers=2, progress=False)
    assert killer.killed is not None
    assert "shard-" in str(e.value) and "Run the command again" in str(e.value)
    assert not os.path.exists(os.path.join(out, MANIFEST_NAME))
    again = pack(src, out, shard_size=1 << 20, workers=2, progress=False)
    clean = pack(
        src, os.path.join(tmp_path, "clean"), shard_size=1 << 20, workers=1, progress=False
    )
    assert again.manifest.num_samples == 20_000
    assert [s.checksum for s in again.manifest.shards] == [
        s.checksum for s in clean.manifest.shards
    ]

    # `unbroken data index` of the same shards, its manifest gone
    root = os.path.join(tmp_path, "clean")
    os.unlink(os.path.join(root, MANIFEST_NAME))
    with _KillABusyWorker() as killer, pytest.raises(WorkerDied, match=r"shard-\d{6}\.tar: "):
        index_directory(root, workers=2, progress=False)
    assert killer.killed is not None
    assert not os.path.exists(os.path.join(root, MANIFEST_NAME))
    indexed = index_directory(root, workers=2, progress=False)
    assert [s.checksum for s in indexed.manifest.shards] == [
        s.checksum for s in clean.manifest.shards
    ]
