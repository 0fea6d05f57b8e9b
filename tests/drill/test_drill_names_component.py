"""The drill on a script with a planted restore bug in a carried hidden state (registered as
``TrainState(extras={"hidden": ...})``): the fault whose recovery the runs part after fails
and names ``extra.hidden``; the fault after it says it was not checked, not "ok"."""

from __future__ import annotations

import json
import os
from typing import cast

import pytest

from unbroken.elastic.drill.runner import DrillConfig, run_drill

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "carry.py")


def test_a_forgotten_hidden_state_is_named_and_later_faults_are_not_checked(tmp_path, token):
    cfg = DrillConfig(
        (SCRIPT, "--dir", "{dir}", "--steps", "40", "--break", "hidden"),
        str(tmp_path / "drill"),
        faults=("kill", "corrupt"),
        seed=0,
        timeout=240,
    )
    report = run_drill(cfg, token=token)
    table = report.format_table()
    print(table)
    assert not report.passed
    first, second = sorted(report.faults, key=lambda f: f.injection.t or 0.0)
    checks = {c.name: c for c in first.checks}
    assert all(checks[n].ok for n in ("injected", "detected", "recovered", "resumed")), table
    r = cast(int, first.restored)
    assert not checks["restore"].ok and checks["restore"].detail == (
        f"restore() did not bring back what was saved at step {r}: on rank 0, extra.hidden (h) "
        "not as saved"
    )
    traj = checks["trajectory"]
    assert not traj.ok and f"the loss differs from step {r + 1} on" in traj.detail
    assert "extra.hidden (h)" in traj.detail and "RNG" not in traj.detail
    later = {c.name: c for c in second.checks}["trajectory"]
    assert (
        later.ok
        and later.skipped
        and later.detail
        == (
            f"not checked: the run had already diverged at step {r + 1} after fault "
            f"#{first.injection.spec.index}'s recovery"
        )
    )
    assert second.verdict in ("NOT CHECKED", "FAIL")  # its own restore check fails too
    assert "NOT CHECKED" in table or "n/c  trajectory" in table
    saved = json.loads((tmp_path / "drill" / "drill.json").read_text())
    assert {f["verdict"] for f in saved["faults"]} <= {"FAIL", "NOT CHECKED"}
