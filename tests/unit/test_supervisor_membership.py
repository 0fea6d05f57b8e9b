"""A membership change (torchrun restarting its workers to admit a joining node) in the
run's record: its own line, never a failure (issue 23 item 2)."""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.elastic import planner, recovery

# Attempt 0 trains alone; node B joins: torchrun stops the workers at t=50 (the launcher's
# worker_exit, stopped), the supervisor sees it at 50.1, the new workers are up at 51.0,
# restored at 53.0 and back at the step reached before the stop at 53.5. Then a real failure.
EVENTS: list[dict[str, Any]] = [
    {"t": 0.0, "event": "start"},
    {"t": 0.5, "event": "launch", "attempt": 0},
    {"t": 1.0, "event": "workers_up", "attempt": 0},
    {"t": 3.0, "event": "loaded", "attempt": 0, "rank": 0, "step": 0},
    {"t": 50.0, "event": "worker_exit", "attempt": 0, "rank": 0, "exitcode": 0, "stopped": True},
    {
        "t": 51.0,
        "event": "membership",
        "attempt": 0,
        "change": "scale_up",
        "t_fail": 50.0,
        "t_detect": 50.1,
        "t_up": 51.0,
        "step": 40,
        "reason": "torchrun restarted the workers to admit a joining node",
    },
    {"t": 53.0, "event": "loaded", "attempt": 0, "rank": 0, "step": 39},
    {"t": 53.0, "event": "loaded", "attempt": 0, "rank": 1, "step": 39},
    {"t": 53.5, "event": "membership_caught_up", "attempt": 0, "step": 40},
    {"t": 90.0, "event": "failure", "attempt": 0, "t_fail": 89.0, "t_detect": 90.0, "step": 70,
     "fault": "process", "reason": "rank 1 died of SIGKILL"},
    {"t": 92.0, "event": "workers_up", "attempt": 1},
    {"t": 94.0, "event": "loaded", "attempt": 1, "rank": 0, "step": 69},
    {"t": 100.0, "event": "finish"},
]  # fmt: skip


def test_scale_up_is_its_own_line_in_the_recovery_record():
    """issue 23 item 2: the restart that admits a late node has a line of its own (fault
    ``membership``), with the time it cost phase by phase, and the failure after it keeps
    its own record."""
    recs = recovery.phases(EVENTS)
    assert [(r.fault, r.attempt) for r in recs] == [("membership", 0), ("process", 0)]
    m, f = recs
    assert m.index == 0 and f.index == 1
    assert m.detect == pytest.approx(0.1) and m.relaunch == pytest.approx(0.9)
    assert m.load == pytest.approx(2.0) and m.catch_up == pytest.approx(0.5)
    assert m.step_at_failure == 40 and m.loaded_step == 39 and m.steps_lost == 1
    assert "joining node" in m.reason
    # The failure's record is unchanged by the membership change before it.
    assert (f.detect, f.relaunch, f.load) == (1.0, 2.0, 2.0)
    text = recovery.format_summary(recovery.summarize(EVENTS))
    assert "membership" in text and "process" in text


def test_scale_up_catch_up_is_zero_when_the_restore_holds_the_step():
    """issue 23 item 2: a restore at the step reached before the stop has nothing to catch up."""
    ev = [e for e in EVENTS if e["event"] != "membership_caught_up" and e["t"] < 60]
    ev = [
        {**e, "step": 40} if e["event"] == "loaded" and e["t"] > 50 else e for e in ev
    ]  # fmt: skip
    (m,) = recovery.phases(ev)
    assert m.fault == "membership" and m.catch_up == 0.0 and m.total == pytest.approx(3.0)


def test_scale_up_is_not_a_failure_for_the_planner():
    """issue 23 item 2: the MTBF the planner measures counts failures only, not a node that
    joined."""
    est = planner.estimate_from_events(EVENTS)
    assert est["failures"] == 1 and est["mtbf"] == pytest.approx(100.0)
