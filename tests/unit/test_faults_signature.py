"""What makes two failures "the same" (``signature_of``): nothing that differs between two
attempts of the same bug, such as a process id, may be in it."""

from __future__ import annotations

import signal

import pytest

from unbroken.elastic import faults

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("pids", [(4321, 4377), (123456, 123999)])
def test_a_launcher_sigkilled_at_the_same_step_twice_has_one_signature(tmp_path, pids):
    """A SIGKILLed launcher leaves no report (vanished): its failure is described with its
    pid. Before, a pid under 5 digits (common on a fresh node or container) made each
    attempt's signature differ, so the same kill at the same step never stopped the run."""
    sigs = []
    for launcher in pids:
        x = faults.WorkerExit(
            1, None, -signal.SIGKILL, False, None, launcher, 1.0, "?", vanished=True
        )
        (f,) = faults.collect_worker_failures("", str(tmp_path), [x])
        c = faults.classify(faults.Evidence("exit", None, (f,), "", 7))
        assert c.rule == "killed" and str(launcher) in c.reason, c
        sigs.append(c.signature)
    assert sigs[0] == sigs[1], sigs
    t = faults.RestartTracker(faults.RestartPolicy())
    first = faults.Classification(
        faults.FaultClass.PROCESS, faults.Action.RESTART, "killed", "", sigs[0]
    )
    second = faults.Classification(
        faults.FaultClass.PROCESS, faults.Action.RESTART, "killed", "", sigs[1]
    )
    assert t.decide(first, 5, 7).exit_code is None
    assert t.decide(second, 5, 7).exit_code == faults.EXIT_DETERMINISTIC
