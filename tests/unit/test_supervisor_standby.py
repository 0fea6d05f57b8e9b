"""When the next attempt's standby starts (``RunConfig.standby_start``, issue 23 item 1)."""

from __future__ import annotations

import os

import pytest

from unbroken.elastic.supervisor import RunConfig, Supervisor


def _at_launch(tmp_path, start: str, nproc: int) -> bool:
    cfg = RunConfig(("x.py",), run_dir=str(tmp_path), nproc_per_node=nproc, standby_start=start)
    return Supervisor(cfg)._at_launch


def test_auto_starts_at_launch_only_with_a_cpu_for_the_standby(tmp_path):
    """issue 23 item 1: ``auto`` = ``launch`` when the CPUs this process may use hold one per
    local rank, the attempt's agent and fork server and the standby's two; else ``beat``
    (measured: on the 2-core box the standby's imports slow the job's own start)."""
    cpus = len(os.sched_getaffinity(0))
    assert _at_launch(tmp_path, "auto", max(1, cpus - 4)) is (cpus - 4 >= 1)
    assert _at_launch(tmp_path, "auto", cpus) is False
    assert _at_launch(tmp_path, "launch", cpus) is True
    assert _at_launch(tmp_path, "beat", 1) is False


def test_an_unknown_standby_start_is_refused_by_name():
    """issue 23 item 1: the error names the option, the value and the choices."""
    with pytest.raises(ValueError, match=r"standby_start='soon' \(--standby-start\).*auto"):
        RunConfig(("x.py",), standby_start="soon")


def test_a_run_directory_it_cannot_read_is_named_and_leaves_the_signals_as_found(tmp_path):
    """The supervisor takes SIGINT and SIGTERM for the run; an events log it could not read
    (here a directory in its place) raised before the handlers were given back, so the
    caller's Ctrl-C stopped raising, and the error named a file descriptor ("Is a directory:
    3"), not the file."""
    import signal

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "events.jsonl").mkdir()
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(OSError) as e:
        Supervisor(RunConfig(("train.py",), run_dir=str(run))).run()
    assert str(run / "events.jsonl") in str(e.value), e.value
    assert {s: signal.getsignal(s) for s in before} == before
