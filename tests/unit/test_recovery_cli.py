"""`unbroken report RUN_DIR` and `unbroken plan` over a run's events.jsonl."""

from __future__ import annotations

import json
import os

import pytest

from unbroken.cli import main


def _events(run_dir: str) -> None:
    ev = [
        {"t": 0.0, "event": "start"},
        {"t": 0.1, "event": "launch", "attempt": 0},
        {"t": 2.0, "event": "workers_up", "attempt": 0},
        {"t": 10.0, "event": "saved", "rank": 0, "step": 10, "seconds": 0.5},
        {"t": 20.0, "event": "saved", "rank": 0, "step": 20, "seconds": 0.7},
        {
            "t": 25.5,
            "event": "failure",
            "attempt": 0,
            "t_fail": 25.0,
            "t_detect": 25.5,
            "fault": "process",
            "reason": "killed",
            "step": 24,
        },
        {"t": 26.0, "event": "launch", "attempt": 1},
        {"t": 28.0, "event": "workers_up", "attempt": 1},
        {"t": 29.0, "event": "loaded", "attempt": 1, "rank": 0, "step": 20, "seconds": 0.6},
        {"t": 33.0, "event": "caught_up", "attempt": 1, "rank": 0, "step": 24},
        {"t": 50.0, "event": "finish", "exit_code": 0},
    ]
    with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in ev)


def test_report_prints_phases_and_goodput_and_writes_png(tmp_path, capsys) -> None:
    _events(str(tmp_path))
    png = str(tmp_path / "t.png")
    assert main(["report", str(tmp_path), "--out", png]) == 0
    out = capsys.readouterr().out
    assert "recovery phases" in out and "goodput" in out and "killed" in out
    assert os.path.getsize(png) > 1000


def test_plan_from_options_matches_daly() -> None:
    from unbroken.elastic import planner

    p = planner.plan(300.0, 24 * 3600.0)
    assert p.daly / 60 == pytest.approx(116.7, abs=0.1) and p.young / 60 == pytest.approx(
        120.0, abs=0.1
    )


def test_plan_measures_cost_and_mtbf_from_a_run(tmp_path, capsys) -> None:
    _events(str(tmp_path))
    assert main(["plan", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "checkpoint cost C = 600 ms" in out
        and "MTBF M = 50.0 s" in out
        and "current interval" in out
    )
    assert "warning: M = 50.0 s rests on" in out  # a short run is no failure rate


def test_plan_and_report_bad_input_is_clear(tmp_path, capsys) -> None:
    assert main(["plan", "--mtbf", "100"]) == 2
    assert "--ckpt-cost" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no events.jsonl" in capsys.readouterr().err
