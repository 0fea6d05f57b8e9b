"""C-ONE-WRITER with real processes: a checkpoint root has one writer at a time.

* a second writer (here: the test process) is refused while the first lives, with a
  message naming the holder's pid, host and run id; its restore() never deletes the
  first writer's in-flight temp dir, and that save still commits;
* after a SIGKILL of the first writer the lock is free at once, and the killed writer's
  half-written temp dir is removed as debris;
* two writers started together: exactly one writes, the other is refused before it writes
  anything, so the root holds one run's steps only.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from ckpt_writer import Values

from unbroken.ckpt import Checkpointer, TrainState, read_checkpoint

pytestmark = pytest.mark.slow

_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ckpt_writer.py")
_DEADLINE = 180.0  # a loaded 2-core box imports torch slowly


class _Writer:
    """``scripts/ckpt_writer.py`` in its own process, one stdout line at a time."""

    def __init__(self, root: str, mark: float, run_id: str) -> None:
        env = {**os.environ, "TORCHELASTIC_RUN_ID": run_id}
        self.proc = subprocess.Popen(
            [sys.executable, _SCRIPT, root, str(mark)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)  # EOF: the process exited

    def line(self) -> str | None:
        """The next line, or None when the process exited without one."""
        return self._lines.get(timeout=_DEADLINE)

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=_DEADLINE)


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + _DEADLINE
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never stopped")


def test_second_writer_refused_in_flight_save_kept_lock_free_after_sigkill(tmp_path) -> None:
    root = str(tmp_path / "ck")
    a = _Writer(root, 1000.0, "run-a")
    try:
        assert a.line() == "ready None"
        a.send("save 1")
        assert a.line() == "saved 1"
        a.send("save-stop 2")
        line = a.line()
        assert line is not None and line.startswith("stopping "), line
        tmp2 = line.removeprefix("stopping ")
        _wait_stopped(a.pid)  # frozen between writing step 2 and committing it
        assert os.path.isdir(tmp2) and os.listdir(tmp2)

        v = Values()
        ck = Checkpointer(root, TrainState(extras={"v": v}), keep_last=None)
        with pytest.raises(RuntimeError) as refused:
            ck.restore()
        msg = str(refused.value)
        assert f"pid {a.pid}" in msg and socket.gethostname() in msg and "run-a" in msg, msg
        with pytest.raises(RuntimeError, match=f"pid {a.pid}"):
            ck.save(5)
        assert os.path.isdir(tmp2), "the second writer deleted the first one's in-flight save"
        assert sorted(n for n in os.listdir(root) if n != ".lock") == [
            os.path.basename(tmp2),
            "step-00000001",
        ]

        os.kill(a.pid, signal.SIGCONT)
        assert a.line() == "saved 2"  # the first writer's save committed after all
        assert float(read_checkpoint(root, 2)["components"]["extra.v"]["t"][0]) == 1002.0

        a.send("save-stop 3")
        line = a.line()
        assert line is not None and line.startswith("stopping "), line
        tmp3 = line.removeprefix("stopping ")
        _wait_stopped(a.pid)
        a.kill()  # SIGKILL in the middle of a save

        assert ck.restore() == 2  # the kernel released the lock with the process: no wait
        assert not os.path.exists(tmp3), "a dead writer's temp dir is debris"
        assert float(v.t[0]) == 1002.0
        v.t.fill_(7.0)
        ck.save(3)
        ck.close()
        assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002", "step-00000003"]
    finally:
        a.kill()


def test_two_writers_started_together_never_interleave(tmp_path) -> None:
    root = str(tmp_path / "ck")
    writers = {1000.0: _Writer(root, 1000.0, "run-x"), 2000.0: _Writer(root, 2000.0, "run-y")}
    try:
        first = {mark: w.line() for mark, w in writers.items()}
        winners = [mark for mark, line in first.items() if line == "ready None"]
        assert len(winners) == 1, first
        (win,) = winners
        (lose,) = set(writers) - {win}
        loser = writers[lose]
        assert loser.proc.wait(timeout=_DEADLINE) == 3
        assert loser.proc.stderr is not None
        err = loser.proc.stderr.read()
        assert f"pid {writers[win].pid}" in err, err
        for step in (1, 2, 3):
            writers[win].send(f"save {step}")
            assert writers[win].line() == f"saved {step}"
        writers[win].send("exit")
        assert writers[win].proc.wait(timeout=_DEADLINE) == 0
        assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002", "step-00000003"]
        for step in (1, 2, 3):
            t = read_checkpoint(root, step)["components"]["extra.v"]["t"]
            assert torch.all(t == win + step), f"step {step} holds another writer's data"
    finally:
        for w in writers.values():
            w.kill()
