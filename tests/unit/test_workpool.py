"""The preparation commands' worker processes (``common/workpool.py``).

A worker killed mid-run (the kernel's out-of-memory killer sends SIGKILL) must fail the
command by name within seconds and lose nothing committed: ``multiprocessing.Pool`` forked a
replacement and waited for the lost task's result forever (``unbroken tokenize`` hung so when
one of its workers was SIGKILLed, 2026-12-05).

Not proved here: a tokenize worker killed while it is *sending* a chunk's result (~1 MiB)
leaves a torn message in the executor's one result pipe, and its manager thread then waits for
the rest for good (seen once in CI, 2026-12-05): tokenize still hangs in that case. The pack and
index workers' results are a few hundred bytes, one atomic pipe write, so those tests cannot
meet it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np
import pytest

from unbroken.common import workpool
from unbroken.common.procs import _stat, children_of, is_alive
from unbroken.common.workpool import WorkerDied, process_pool
from unbroken.data.manifest import MANIFEST_NAME
from unbroken.data.prepare.pack import index_directory, pack

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
