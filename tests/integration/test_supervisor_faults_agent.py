"""Faults of the torchrun agent and of a rank's launcher under `unbroken run` (not of a
worker): real torchrun on 127.0.0.1, real gloo workers, a real SIGSTOP of either process.

A stopped agent cannot reap its workers or exit: the supervisor must not wait for it
forever once every rank of the node has ended.
"""

from __future__ import annotations

import os
import signal
import time

import elastic_harness as h
import pytest

from unbroken.common.procs import children_of, cmdline
from unbroken.elastic.launch.worker import LAUNCHER_TITLE

pytestmark = pytest.mark.timeout(240)


def test_a_stopped_agent_whose_ranks_all_finished_does_not_hold_the_run_forever(tmp_path):
    """SIGSTOP of the agent while its one rank trains: the rank finishes and exits 0, the
    agent never exits. Before, the supervisor waited on it forever (no worker beacon is
    live, so the hang watchdog saw nothing); now it ends the agent once it outlived its
    ranks by the finish timeout, and the run finishes with 0 and leaves nothing behind."""
    steps, hang_s = 12, 6.0
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "1", "--hang-timeout", str(hang_s)],
            h.script_args(tmp_path, steps, save_every=4, sleep=0.2),
        )
        h.wait_until(lambda: h.live_beats(job, 0, 2, ranks=1), 90, "step 2", job)
        (launch,) = job.events("launch")
        os.kill(launch["agent_pid"], signal.SIGSTOP)
        (ended,) = h.wait_until(lambda: job.events("worker_exit"), 60, "the rank's exit", job)
        assert ended["exitcode"] == 0, ended
        t_ended = time.time()
        # hang_timeout (6 s, above --shutdown-timeout 5 s) from the rank's exit, plus polls
        assert job.wait(hang_s + 20) == 0, job.output()[-3000:]
        assert time.time() - t_ended >= hang_s - 1.0, "the agent was not given its time"

    assert job.events("failure") == [], job.events("failure")
    assert "agent" in job.output() and "has not exited" in job.output(), job.output()[-3000:]
    assert h.metric_steps(str(tmp_path / "metrics.jsonl")) == list(range(1, steps + 1))
    assert not h.pids_of(job), "processes of the job outlived its supervisor"


def test_a_rank_whose_launcher_is_stopped_is_a_hang_once_its_worker_is_gone(tmp_path):
    """SIGSTOP of a rank's launcher (the process torchrun started): the worker trains on,
    finishes and exits, but its launcher cannot report it, and torchrun waits on the
    launcher. Before, the supervisor waited forever (the worker's beacon is dead, so the
    watchdog skipped it); now a worker of this attempt gone without a report for the hang
    timeout is a hang: the attempt is ended and restarted, and the run finishes."""
    steps, hang_s = 12, 6.0
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "1", "--hang-timeout", str(hang_s)],
            h.script_args(tmp_path, steps, save_every=4, sleep=0.2),
        )
        h.wait_until(lambda: h.live_beats(job, 0, 2, ranks=1), 90, "step 2", job)
        (launch,) = job.events("launch")
        (launcher,) = [
            p for p in children_of(launch["agent_pid"]) if cmdline(p)[0].startswith(LAUNCHER_TITLE)
        ]
        os.kill(launcher, signal.SIGSTOP)
        assert job.wait(90) == 0, job.output()[-3000:]

    (hang,) = job.events("hang")
    assert "launcher" in hang["detail"] and "ranks [0]" in hang["detail"], hang
    assert hang["step"] == steps and hang["detail"].endswith(f"at step {steps}"), hang
    (f,) = job.events("failure")
    assert (f["fault"], f["rule"], f["kind"]) == ("process", "hang", "hang"), f
    assert h.metric_steps(str(tmp_path / "metrics.jsonl")) == list(range(1, steps + 1))
    assert not h.pids_of(job), "processes of the job outlived its supervisor"
