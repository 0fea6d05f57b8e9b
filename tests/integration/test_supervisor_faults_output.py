"""A worker that writes a very long line (no newline for many MB: a dump of a tensor, a
progress bar drawn with backspaces) under `unbroken run`: real torchrun, a real worker.

The supervisor copies torchrun's console line by line; a line without end must neither
grow its memory with the output nor hide the output until the line ends.
"""

from __future__ import annotations

import os
import time

import elastic_harness as h
import pytest

pytestmark = pytest.mark.timeout(240)

_FLOOD = """\
import os, sys, time
go, done, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
deadline = time.time() + 120
while not os.path.exists(go) and time.time() < deadline:
    time.sleep(0.05)
sys.stdout.write("tick-A ")
chunk = "x" * (1 << 20)
for _ in range(mib):
    sys.stdout.write(chunk)
sys.stdout.flush()
while not os.path.exists(done) and time.time() < deadline:
    time.sleep(0.05)
print(" end")
"""


def _peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))


def test_a_line_of_48_mib_is_copied_as_it_comes_in_bounded_memory(tmp_path):
    """Before: the supervisor held the whole line (its peak memory grew by the 48 MiB) and
    torchrun.log and the console showed nothing of it until its newline."""
    script = tmp_path / "flood.py"
    script.write_text(_FLOOD)
    go, done = tmp_path / "go", tmp_path / "done"
    with h.jobs() as start:
        job = start(str(tmp_path / "run"), [], [str(go), str(done), "48"], script=str(script))
        h.wait_until(lambda: job.events("workers_up"), 90, "the worker", job)
        time.sleep(1.0)  # the worker's start-up output is in
        before = _peak_kib(job.proc.pid)
        go.touch()
        log = os.path.join(job.run_dir, "attempts", "0", "torchrun.log")
        h.wait_until(
            lambda: os.path.getsize(log) > 40 << 20, 90, "the line's bytes in torchrun.log", job
        )
        grown = _peak_kib(job.proc.pid) - before
        assert "tick-A" in job.output(), "the console showed nothing of the line"
        done.touch()
        assert job.wait(90) == 0, job.output()[-3000:]
    assert grown < 16 << 10, f"the supervisor's peak memory grew by {grown} KiB"
