"""The memory tier under `unbroken run` (issue 25 item 1): the node's agent owns the slots.

A real supervisor, a real torchrun agent, a real worker with the real Checkpointer
publishing every step into the directory the agent created; a real SIGKILL of the worker;
the restarted worker restores from memory, losing at most K = 1 step, and the run's losses
are bit-identical to an uninterrupted run's. When the job ends the directory is gone.
"""

from __future__ import annotations

import os
import signal
import stat

import elastic_harness as h
import pytest

from unbroken.common import memdir

pytestmark = pytest.mark.timeout(240)


def test_sigkill_under_unbroken_run_restores_from_the_agents_memory_tier(tmp_path):
    """issue 25 item 1: `unbroken run` creates the private per-job memory directory at
    launch, names it to the workers (UNBROKEN_MEMORY_TIER), a worker SIGKILLed under it
    restarts from memory with steps lost <= K, the recovery record names the tier and the
    steps lost, and the directory is removed when the job ends, by the agent."""
    steps = 30
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "1", "--ckpt-dir", str(tmp_path / "ckpt")],
            # no disk save before the end: only the memory tier can spare the recompute
            h.script_args(tmp_path, steps, save_every=100, ckpt_kind="unbroken", memory_every=1),
        )
        (st,) = h.wait_until(lambda: job.events("start"), 60, "the start event", job)
        tier = st["memory_tier"]
        assert tier.startswith(memdir.user_root() + os.sep), st
        info = os.lstat(tier)
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
        assert info.st_uid == os.geteuid()
        (victim,) = h.wait_until(lambda: h.live_beats(job, 0, 12, ranks=1), 90, "step 12", job)
        # the worker publishes into the agent's directory
        h.wait_until(
            lambda: os.path.exists(os.path.join(tier, "rank-0", "slot-1")), 30, "slots", job
        )
        os.kill(victim.pid, signal.SIGKILL)
        h.wait_until(lambda: h.live_beats(job, 1, 1, ranks=1), 90, "the restarted rank", job)
        assert job.wait(90) == 0, job.output()[-3000:]

    (f,) = job.events("failure")
    assert "SIGKILL" in f["reason"], f
    (loaded,) = [e for e in job.events("loaded") if e["attempt"] == 1]
    assert loaded["tier"] == "memory", loaded
    (rec,) = job.recoveries()
    assert rec["tier"] == "memory" and rec["step_at_failure"] >= 12, rec
    assert 0 <= rec["steps_lost"] <= 1, rec  # K = 1
    assert "from the memory tier" in job.output()
    # the workers leave the directory to the agent (memdir.AGENT_ENV), however they end
    left = [(e["attempt"], e["memory_tier_left_to_agent"]) for e in job.events("startup")]
    assert left == [(0, True), (1, True)], left
    # bit-identical to an uninterrupted run, every step logged once
    assert h.metric_steps(str(tmp_path / "metrics.jsonl")) == list(range(1, steps + 1))
    losses = [r["loss"] for r in h.metrics(str(tmp_path / "metrics.jsonl"))]
    assert losses == h.reference_losses(steps, 1)
    assert not os.path.lexists(tier), "the memory tier outlived the job"
    assert not h.pids_of(job)
