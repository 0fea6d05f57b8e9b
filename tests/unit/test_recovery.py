"""Recovery phases from events (E-MEASURED) and the event log's `mark`."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from unbroken.common import events
from unbroken.elastic import recovery

pytestmark = pytest.mark.timeout(60)


def _ev(t, event, **kw):
    return {"t": t, "event": event, **kw}


def _run(failure_step=12, loaded_step=10, caught=True):
    ev = [
        _ev(0.0, "start"),
        _ev(0.1, "launch", attempt=0),
        _ev(2.0, "workers_up", attempt=0),
        _ev(4.0, "loaded", attempt=0, rank=0, step=0),
        _ev(
            20.5,
            "failure",
            attempt=0,
            t_fail=20.0,
            t_detect=20.5,
            fault="process",
            reason="killed",
            step=failure_step,
        ),
        _ev(21.0, "launch", attempt=1),
        _ev(23.0, "workers_up", attempt=1),
        _ev(25.0, "loaded", attempt=1, rank=1, step=loaded_step, seconds=0.4),
        _ev(26.0, "loaded", attempt=1, rank=0, step=loaded_step, seconds=0.9),
        _ev(40.0, "loaded", attempt=1, rank=0, step=loaded_step),  # a later reload (spare)
    ]
    if caught:
        ev.append(_ev(29.0, "caught_up", attempt=1, rank=0, step=failure_step))
    ev.append(_ev(50.0, "finish", exit_code=0))
    return ev


def test_phases_from_events():
    (r,) = recovery.phases(_run())
    assert (r.detect, r.relaunch, r.load, r.catch_up) == (0.5, 2.5, 3.0, 3.0)
    assert r.total == 9.0 and r.restore_seconds == 0.9 and r.loaded_step == 10
    (r,) = recovery.phases(_run(caught=False))
    assert r.catch_up is None and r.total is None
    (r,) = recovery.phases(_run(failure_step=10, caught=False))
    assert r.catch_up == 0.0  # the checkpoint held the failure step: nothing to redo


def test_recovery_record_names_the_tier_and_the_steps_lost():
    """issue 25 item 1: the recovery record gets the tier the restart restored from and the
    steps lost (the step reached before the failure less the step restored)."""
    ev = _run(failure_step=12, loaded_step=11)
    for e in ev:
        if e["event"] == "loaded" and e["attempt"] == 1:
            e["tier"] = "memory"
    (r,) = recovery.phases(ev)
    assert (r.tier, r.steps_lost) == ("memory", 1)
    assert r.to_json()["tier"] == "memory" and r.to_json()["steps_lost"] == 1
    text = recovery.format_summary(recovery.summarize(ev))
    assert "tier" in text and "memory" in text and "lost" in text
    (r,) = recovery.phases(_run())  # no tier named (a job's own "loaded"): unknown
    assert (r.tier, r.steps_lost) == (None, 2)


def test_summary_goodput_and_trend():
    s = recovery.summarize(_run())
    assert s.wall == 50.0 and s.lost == pytest.approx(4.0 + 9.0)
    assert s.goodput == pytest.approx(1 - 13 / 50)
    text = recovery.format_summary(s)
    assert "goodput 74.0%" in text and "killed" in text and s.trend_warning is None
    recs = [
        recovery.Recovery(i, i, "process", "", 1, 0.0, 1.0, t, 1.0, 1.0, None, 1)
        for i, t in enumerate((2.0, 2.2, 1.8, 9.0))
    ]
    assert "getting slower" in (recovery._trend(recs) or "")


def test_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = recovery.plot_timeline(_run(), str(tmp_path / "timeline.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 5000
    with pytest.raises(ValueError, match="no events"):
        recovery.plot_timeline([], str(tmp_path / "x.png"))


def test_mark_is_a_noop_unsupervised_and_appends_when_supervised(tmp_path, monkeypatch):
    monkeypatch.delenv(events.ENV_RUN_DIR, raising=False)
    events.mark("loaded", step=3, seconds=0.1)
    assert not os.listdir(tmp_path)
    monkeypatch.setenv(events.ENV_RUN_DIR, str(tmp_path))
    monkeypatch.setenv(events.ENV_ATTEMPT, "2")
    monkeypatch.setenv("RANK", "1")
    events.mark("loaded", step=3, seconds=0.1)
    (e,) = events.load_events(str(tmp_path))
    assert (e["event"], e["attempt"], e["rank"], e["step"], e["seconds"]) == (
        "loaded",
        2,
        1,
        3,
        0.1,
    )
    with pytest.raises(ValueError, match="reserved"):
        events.mark("x", t=1)
    with open(tmp_path / events.EVENTS_FILE, "a") as f:
        f.write('{"t": 1, "event": "torn')  # a writer killed mid-line
    assert len(events.load_events(str(tmp_path))) == 1


def _marker(run_dir: str, n: int) -> None:
    os.environ[events.ENV_RUN_DIR] = run_dir
    for i in range(n):
        events.mark("saved", step=i, payload="x" * 200)


def test_concurrent_marks_never_interleave(tmp_path):
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_marker, args=(str(tmp_path), 300)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    ev = events.load_events(str(tmp_path))
    assert len(ev) == 1200 and {len(e["payload"]) for e in ev} == {200}
