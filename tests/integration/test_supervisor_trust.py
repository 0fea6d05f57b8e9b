"""`unbroken run` on a shared node (issue 20 items 3 and 4): what others can write (the
rendezvous store, files in the run directory) neither steers nor stops the job, and what the
job writes is private. Real supervisors, torchrun agents and workers on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
from datetime import timedelta

import elastic_harness as h
import pytest
from torch.distributed import TCPStore

from unbroken.elastic import heartbeat

pytestmark = pytest.mark.timeout(240)


def _script_args(tmp_path, steps: int) -> list[str]:
    return h.script_args(tmp_path, steps, sleep=0.1)


def _steps_done(tmp_path) -> list[int]:
    return h.metric_steps(str(tmp_path / "metrics.jsonl"))


def test_malformed_store_values_neither_crash_nor_finish_the_run(tmp_path):
    """issue 20 item 3: anyone who reaches the rendezvous store can write its keys: a
    ``stop`` of ``"0 ..."`` made the supervisor exit 0 as if the job had finished, and a
    non-numeric ``gen`` crashed it (``int()``, only ``RuntimeError`` caught)."""
    steps = 40
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--ckpt-dir", str(tmp_path / "ckpt")],
            _script_args(tmp_path, steps),
        )
        h.wait_until(lambda: h.live_beats(job, 0, 3, ranks=1), 90, "step 3", job)
        (ev,) = job.events("start")
        host, _, port = ev["store"].rpartition(":")
        stranger = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        stranger.set("unbroken/unbroken/stop", "0 finished, says a stranger")
        stranger.set("unbroken/unbroken/gen", "not a number")
        stranger.append("unbroken/unbroken/nodes", b"\xff\xfe\n")  # type: ignore[attr-defined]
        assert job.wait(120) == 0, job.output()[-3000:]
    assert _steps_done(tmp_path) == list(range(1, steps + 1)), "the job did not run to its end"
    assert not job.events("failure") and not job.events("stop")
    assert "malformed" in job.output()


def _plant_beat(run_dir: str, attempt: int, pid: int, rank: int, step: int, t: float) -> str:
    """A beacon file in heartbeat's current layout naming ``pid``, last beat at ``t``; the
    supervisor's reader takes it (a beacon of an old layout would be ignored, and the test
    could not fail)."""
    d = os.path.join(run_dir, "beats", f"a{attempt}")
    path = os.path.join(d, f"r{rank}-p{pid}.beat")
    head = heartbeat._HEAD.pack(heartbeat._MAGIC, heartbeat._VERSION, pid, rank, attempt)
    body = heartbeat._BODY.pack(7, step, t, 0.0, 7)
    with open(path, "wb") as f:
        f.write(head + body)
    assert any(b.path == path and b.pid == pid for b in heartbeat.read_beats(run_dir, attempt))
    return path


def test_a_planted_beacon_aims_no_signal_and_run_files_are_private(tmp_path):
    """issue 20 item 4: a beacon naming any pid, with a beat long past the hang timeout,
    made the supervisor declare a hang and send that pid SIGUSR2 (and SIGTERM/SIGKILL the
    job). Only processes carrying the attempt's token are signalled now. And the run's
    directories are 0700, its files 0600."""
    victim = subprocess.Popen(["sleep", "300"])  # ours, but not the job's: SIGUSR2 ends it
    steps = 40
    try:
        with h.jobs() as start:
            job = start(str(tmp_path / "run"), [], _script_args(tmp_path, steps))
            h.wait_until(lambda: h.live_beats(job, 0, 3, ranks=1), 90, "step 3", job)
            planted = _plant_beat(
                job.run_dir, 0, victim.pid, rank=0, step=10**6, t=time.time() - 1e4
            )
            assert job.wait(120) == 0, job.output()[-3000:]
            assert victim.poll() is None, "the supervisor signalled the pid a planted beacon named"
    finally:
        victim.kill()
        victim.wait()
    assert not job.events("hang") and not job.events("failure")
    assert _steps_done(tmp_path) == list(range(1, steps + 1))
    _assert_private(job.run_dir, skip={job.out_path, planted})


def _assert_private(run_dir: str, skip: set[str]) -> None:
    """Every directory below ``run_dir`` 0700, every file 0600 (torchrun's own log dir
    aside: it lies inside a 0700 directory)."""
    seen = 0
    for root, dirs, files in os.walk(run_dir):
        dirs[:] = [d for d in dirs if d != "torchelastic"]
        if root != run_dir:
            assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700, root
        for name in files:
            path = os.path.join(root, name)
            if path in skip:
                continue
            seen += 1
            assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600, f"{path} is not 0600"
    assert seen >= 5, "expected events, logs, beacons and reports in the run directory"


def test_a_program_squatting_on_the_rendezvous_port_stops_the_start_within_the_join_timeout(
    tmp_path,
):
    """A program on this node took the endpoint's port, accepts and never answers: torch's
    store client waited for its first answer without bound, deaf to SIGTERM. The supervisor
    gives up after --join-timeout (plus a margin) and names the endpoint; the first
    attempt's agent, started ahead of the store, goes with it."""
    with socket.socket() as squatter, h.jobs() as start:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)
        endpoint = f"127.0.0.1:{squatter.getsockname()[1]}"
        job = start(
            str(tmp_path / "run"),
            ["--rdzv-endpoint", endpoint, "--join-timeout", "3"],
            _script_args(tmp_path, 5),
        )
        t0 = time.monotonic()
        assert job.wait(60) == 1, job.output()[-3000:]
        took = time.monotonic() - t0
        assert f"no answer from the rendezvous store at {endpoint}" in job.output(), job.output()
        assert took < 30.0, took
        assert not h.pids_of(job), h.described(h.pids_of(job))  # the early agent closed
        assert not job.events("launch")
