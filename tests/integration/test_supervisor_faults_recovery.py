"""The recovery phases of a failure that happens before the job saved anything: real torchrun
on 127.0.0.1, a real gloo worker, a real SIGKILL.

The restart restores nothing (no ``loaded`` event) and recomputes every step from the first:
that time is still recovery, and must be in the record, the table and the goodput.
"""

from __future__ import annotations

import os
import signal

import elastic_harness as h
import pytest

from unbroken.common.events import load_events
from unbroken.elastic import recovery

pytestmark = pytest.mark.timeout(240)


def test_a_failure_before_the_first_checkpoint_is_measured_to_the_catch_up(tmp_path):
    """SIGKILL at step 5 of a job that saves every 100 steps: the restart starts from
    scratch. Before, the record's load, catch-up and total were None (the summary counted
    only detect and relaunch as lost); now load is 0 (nothing restored) and catch-up runs
    from the new workers' appearance to the step reached before the failure."""
    steps = 14
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "1"],
            h.script_args(tmp_path, steps, save_every=100, sleep=0.1),
        )
        (b,) = h.wait_until(lambda: h.live_beats(job, 0, 5, ranks=1), 90, "step 5", job)
        os.kill(b.pid, signal.SIGKILL)
        assert job.wait(90) == 0, job.output()[-3000:]

    assert not job.events("loaded") and not job.events("saved")  # nothing saved, nothing restored
    (f,) = job.events("failure")
    (up,) = [e for e in job.events("workers_up") if e["attempt"] == 1]
    (caught,) = job.events("caught_up")
    assert caught["attempt"] == 1 and caught["step"] >= f["step"] >= 5, (caught, f)
    (rec,) = job.recoveries()
    assert rec["load"] == 0.0, rec
    assert rec["catch_up"] == pytest.approx(caught["t"] - up["t"]), rec
    assert rec["total"] == pytest.approx(rec["detect"] + rec["relaunch"] + rec["catch_up"]), rec
    summary = recovery.summarize(load_events(job.run_dir))
    assert summary.lost >= rec["total"], (summary.lost, rec)
    row = next(ln for ln in job.output().splitlines() if ln.split()[:3] == ["0", "0", "process"])
    assert row.split()[8] == "0.00" and row.split()[9] != "-", row  # load, catch-up
