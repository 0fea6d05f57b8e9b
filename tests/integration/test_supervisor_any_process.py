"""Any process of a rank may die (issue 21 item 7): the worker, its per-rank launcher (the
process torchrun started, whose argv names the script and whose environment says RANK=1) or
the fork server that forked the workers. Each death is a process fault that restarts the
rank, never a "preemption by a signal from outside". And the processes say what they are:
``pgrep -f SCRIPT`` finds the worker, and the launcher's and the worker's titles differ.

Real torchrun on 127.0.0.1, real gloo workers, real SIGKILL.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess

import elastic_harness as h
import pytest

from unbroken.common.procs import cmdline, environ_of, parent_of

pytestmark = pytest.mark.timeout(240)

SCRIPT_NAME = os.path.basename(h.SCRIPT)


def _title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0].decode()


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _launcher_of(job: h.Job, rank: int, worker: int, attempt: int = 0) -> int:
    """The per-rank launcher: torchrun's child for ``rank`` (RANK set, not the worker)."""
    (pid,) = [
        p
        for p in h.pids_of(job, attempt=attempt)
        if p != worker and environ_of(p).get("RANK") == str(rank)
    ]
    return pid


@pytest.mark.parametrize(
    ("victims", "mode"),
    [
        # one job, each kind in turn: attempt 0 loses its worker, 1 its launcher, 2 its
        # fork server (each restart forks the workers anew)
        (("worker", "launcher", "fork server"), []),
        # its worker a fresh interpreter, not a fork (--no-prewarm forks since issue 23 item 2)
        (("launcher",), ["--no-standby"]),
    ],
    ids=["worker-launcher-fork-server", "launcher-no-standby"],
)
def test_any_process_of_a_rank_killed_is_a_process_fault_that_restarts_it(tmp_path, victims, mode):
    """issue 21 item 7: SIGKILL of the worker, of the per-rank launcher or of the fork server
    of rank 1 is a process fault; the job restarts and ends bit-identical."""
    steps = 15 * len(victims) + 15
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "2", "--stop-grace", "5", *mode],
            h.script_args(tmp_path, steps, save_every=5),
        )
        for attempt, victim in enumerate(victims):
            # 8 steps past the newest save the attempt can have restored (every 5)
            at = 15 * attempt + 8
            up = functools.partial(h.live_beats, job, attempt, at, ranks=2)
            beats = h.wait_until(up, 90, f"step {at}", job)
            worker = beats[1].pid
            launcher = _launcher_of(job, 1, worker, attempt)
            pid = {"worker": worker, "launcher": launcher, "fork server": parent_of(worker)}
            assert (
                pid[victim] is not None
                and pid[victim] not in (launcher, worker)
                or (victim != "fork server")
            )
            os.kill(pid[victim], signal.SIGKILL)
        assert job.wait(120) == 0, job.output()[-3000:]

    fails = job.events("failure")
    assert len(fails) == len(victims), fails
    for f, victim in zip(fails, victims, strict=True):
        assert (f["fault"], f["action"]) == ("process", "restart"), f
        assert "outside" not in f["reason"] and "preempt" not in f["reason"], f
        assert "rank 1" in f["reason"] or victim == "fork server", f
    h_steps = h.metric_steps(str(tmp_path / "metrics.jsonl"))
    assert h_steps == list(range(1, steps + 1)), h_steps
    losses = [r["loss"] for r in h.metrics(str(tmp_path / "metrics.jsonl"))]
    assert losses == h.reference_losses(steps, 2)
    assert not h.pids_of(job), "processes of the job outlived its supervisor"


def test_pgrep_finds_the_worker_and_titles_say_which_is_which(tmp_path):
    """issue 21 item 7: the forked worker carries the script's name (``pgrep -f`` finds it,
    /proc/PID/comm is the script's name); the launcher's title says it is the launcher."""
    with h.jobs() as start:
        stop = tmp_path / "stop"
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "2"],
            h.script_args(tmp_path, 10_000, stop_file=stop),
        )
        beats = h.wait_until(lambda: h.live_beats(job, 0, 2, ranks=2), 90, "step 2", job)
        found = subprocess.run(
            ["pgrep", "-f", SCRIPT_NAME], capture_output=True, text=True, check=False
        ).stdout.split()
        for b in beats:
            assert str(b.pid) in found, (b.pid, found)
            title = _title(b.pid)
            assert title.startswith(f"[unbroken worker rank {b.rank}] "), title
            assert SCRIPT_NAME in title, title
            assert _comm(b.pid) == SCRIPT_NAME[:15]
            launcher = _launcher_of(job, b.rank, b.pid)
            lt = _title(launcher)
            assert lt.startswith(f"[unbroken launcher rank {b.rank}, worker {b.pid}] "), lt
            assert SCRIPT_NAME in lt, lt
            assert _comm(launcher) == f"ub-launcher-{b.rank}"
            # the full argv is still there for the tools that read it
            assert cmdline(b.pid)[0] == title
        stop.write_text("")
        assert job.wait(120) == 0, job.output()[-3000:]
