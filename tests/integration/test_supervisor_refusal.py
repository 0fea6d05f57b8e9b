"""A deterministic refusal at restore is a configuration fault (issue 21 item 8): the
checkpoint layer refuses a checkpoint the job cannot take (a resize of per-rank state, a
shape mismatch) with ``RestoreRefused``; restarting would refuse again, so the supervisor
stops at once, with its own exit code and the refusal's message in the summary.

Real torchrun on 127.0.0.1, real gloo workers, a real SIGKILL to force the restore.
"""

from __future__ import annotations

import os
import signal

import elastic_harness as h
import pytest

from unbroken.elastic import faults

pytestmark = pytest.mark.timeout(240)


def test_a_refused_restore_stops_at_once_with_the_message(tmp_path):
    """issue 21 item 8: no retries, exit EXIT_CONFIGURATION, message in summary and report."""
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "2", "--max-restarts", "5"],
            h.script_args(tmp_path, 40, save_every=5, refuse_restore=True),
        )
        beats = h.wait_until(lambda: h.live_beats(job, 0, 8, ranks=2), 90, "step 8", job)
        os.kill(beats[1].pid, signal.SIGKILL)
        assert job.wait(120) == faults.EXIT_CONFIGURATION, job.output()[-3000:]

    failures = job.events("failure")
    assert len(failures) == 2, (failures, job.events("launch"), job.output()[-3000:])
    first, second = failures
    assert (first["fault"], first["action"]) == ("process", "restart"), first
    assert (second["fault"], second["rule"], second["action"]) == (
        "configuration",
        "restore_refused",
        "stop",
    ), second
    assert "saved by 2 ranks and this job has 1" in second["reason"], second
    assert len(job.events("launch")) == 2  # stopped at once: no third attempt
    out = job.output()
    assert f"exit code {faults.EXIT_CONFIGURATION}" in out
    assert "RestoreRefused" in out and "saved by 2 ranks and this job has 1" in out
    with open(os.path.join(job.run_dir, "stop-report.txt")) as f:
        assert "configuration" in f.read()
