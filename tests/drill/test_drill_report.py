"""The drill's report (unbroken.elastic.drill.report): its headline names the first concrete
mismatch, not a guess."""

from __future__ import annotations

from unbroken.elastic.drill.judge import Check, FaultResult, RunComparison, unplanned_failures
from unbroken.elastic.drill.plan import FaultSpec, Injection
from unbroken.elastic.drill.report import DrillReport


def _report(faults: list[FaultResult], runs: list[RunComparison]) -> DrillReport:
    return DrillReport("/d", ["t.py", "{dir}"], 0, [], faults, runs, {"single/A": 3})


def test_the_headline_names_the_jobs_own_failure_not_a_guess():
    """issue 21 item 9: restore()'s return value ignored: the resumed job logs step 1 again
    and MetricLog refuses it. The headline names that, not "RNG streams ... or weights"."""
    inj = Injection(FaultSpec(1, "kill", "single", 30), t=10.0)
    guess = (
        "steps 31..40 compared: the loss differs from step 31 on; the first step after "
        "restoring step 30 already differs, on the same samples: state the forward pass "
        "uses was not restored (RNG streams such as dropout, or the model weights)"
    )
    fault = FaultResult(
        inj,
        [Check("injected", True, ""), Check("trajectory", False, guess, cause="the loss differs")],
    )
    reason = (
        "exception: rank 0: ValueError: metric step 1 is before the last logged step 30; "
        "log steps in order (after a restore, the log resumes from the restored step)"
    )
    failures = [
        ("A", {"t": 10.5, "step": 30, "fault": "process", "rule": "killed", "reason": "x"}),
        ("A", {"t": 12.0, "step": 30, "fault": "process", "rule": "exception", "reason": reason}),
    ]
    runs = [RunComparison("single", "r", "j", 1, None, [unplanned_failures([10.0], failures)], {})]
    table = _report([fault], runs).format_table()
    head = table.splitlines()[0]
    assert "FAIL: ValueError: metric step 1 is before the last logged step 30" in head, head
    assert "RNG" not in head


def test_without_a_failure_of_its_own_the_headline_names_the_first_failed_check():
    inj = Injection(FaultSpec(2, "hang", "single", 12), t=10.0)
    fault = FaultResult(
        inj,
        [
            Check("injected", True, ""),
            Check("trajectory", False, "steps 13..20 compared: ...", cause="other samples"),
        ],
    )
    ok_run = RunComparison("single", "r", "j", 1, None, [Check("failures", True, "1 recorded")], {})
    head = _report([fault], [ok_run]).format_table().splitlines()[0]
    assert "FAIL: fault #2 hang: other samples" in head, head
    passed = _report([FaultResult(inj, [Check("injected", True, "")])], [ok_run])
    passed.exits = {}
    assert passed.format_table().splitlines()[0].startswith("unbroken drill: 1 fault, seed 0: PASS")


def test_the_timeline_is_drawn_or_a_note_says_why_not(tmp_path, monkeypatch):
    """issue 21 item 9: no matplotlib -> no PNG and a note saying so; nothing to draw -> a
    note saying that."""
    import sys

    from unbroken.elastic.drill import runner
    from unbroken.elastic.drill.plot import plot_timeline

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if absent
    assert plot_timeline(str(tmp_path / "t.png"), [{"t0": 0.0}]) is None
    assert not (tmp_path / "t.png").exists()
    report = _report([], [])
    runner._plot(report, [], {}, runner.DrillConfig(("t.py", "{dir}"), str(tmp_path)))
    assert report.notes == ["no timeline.png: no drilled run got far enough to draw"]
