"""Failures that use no restart from the budget (a lost node: waiting for nodes is not a
fault of the job) under `unbroken run`: real torchrun on 127.0.0.1, a real worker.

When such a failure repeats without the checkpointed step advancing, the run must still
end (the no-progress guard), not restart forever.
"""

from __future__ import annotations

import elastic_harness as h
import pytest

from unbroken.elastic import faults

pytestmark = pytest.mark.timeout(240)


def test_a_node_lost_failure_that_repeats_without_progress_stops(tmp_path):
    """Every attempt fails at step 7 (saved at 5) with a failure a --fault-rule files as a
    lost node. Before: restarted forever (no budget used, no no-progress count, no backoff);
    now the no-progress guard stops it with exit 5 after --no-progress-limit restarts."""
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            [
                "--max-restarts",
                "1",
                "--no-progress-limit",
                "2",
                "--fault-rule",
                "node_lost=boom at step",
            ],
            h.script_args(tmp_path, 20, save_every=5, raise_at=7),
        )
        assert job.wait(120) == faults.EXIT_NO_PROGRESS, job.output()[-3000:]

    fails = job.events("failure")
    assert [f["rule"] for f in fails] == ["user:node_lost"] * 3, fails
    assert [f["action"] for f in fails] == ["wait_for_nodes", "wait_for_nodes", "stop"], fails
    assert fails[-1]["stop_code"] == faults.EXIT_NO_PROGRESS, fails[-1]
    assert fails[-1]["restarts"] == 0, fails[-1]  # waiting for nodes used none of the budget
    assert len(job.events("launch")) == 3
