"""Checkpoint-interval planning: Young, Daly (checked against the paper's values), goodput."""

from __future__ import annotations

import json

import pytest

from unbroken import cli
from unbroken.elastic import planner

MIN, HOUR = 60.0, 3600.0


@pytest.mark.parametrize(
    ("mtbf", "expect_min"), [(24 * HOUR, 116.7), (6 * HOUR, 56.7), (15 * MIN, 9.14)]
)
def test_daly_matches_the_paper(mtbf, expect_min):
    # Daly 2006, delta = 5 min: 117, 57 and 9.1 min for M = 24 h, 6 h and 15 min.
    assert planner.daly_interval(5 * MIN, mtbf) / MIN == pytest.approx(expect_min, abs=0.05)


def test_llama3_like_cluster():
    # ~1 interruption per 3 h (Llama 3 405B: 419 unexpected in 54 days), 1 min checkpoints.
    assert planner.young_interval(1 * MIN, 185.6 * MIN) / MIN == pytest.approx(19.3, abs=0.05)
    assert planner.daly_interval(1 * MIN, 185.6 * MIN) / MIN == pytest.approx(18.6, abs=0.05)


def test_daly_degenerates_to_mtbf_when_checkpoints_cost_more_than_2m():
    assert planner.daly_interval(30.0, 10.0) == 10.0


def test_goodput_peaks_near_daly():
    c, m, r = 60.0, 4 * HOUR, 300.0
    d = planner.daly_interval(c, m)
    grid = [d * f for f in (0.25, 0.5, 0.8, 1.25, 2.0, 4.0)]
    g_d = planner.expected_goodput(d, c, m, r)
    assert all(planner.expected_goodput(t, c, m, r) < g_d for t in grid)
    best = max(
        (planner.expected_goodput(t, c, m, r), t)
        for t in (d * (0.9 + 0.002 * i) for i in range(100))
    )[1]
    assert best == pytest.approx(d, rel=0.02)  # Daly's closed form is near the true optimum
    # first-order model: waste ~ C/T + T/(2M) + R/M for C, R << M
    waste = 1 - planner.expected_goodput(d, c, m, r)
    assert waste == pytest.approx(c / d + d / (2 * m) + r / m, rel=0.1)


def test_goodput_falls_with_restart_cost():
    g = [planner.expected_goodput(600, 30, HOUR, r) for r in (0, 60, 600)]
    assert g[0] > g[1] > g[2] > 0


def test_plan_and_format():
    p = planner.plan(5 * MIN, 6 * HOUR, restart_cost=2 * MIN, current=10 * MIN)
    assert p.young == pytest.approx(60 * MIN) and p.daly / MIN == pytest.approx(56.7, abs=0.05)
    assert p.goodput_current is not None and p.goodput_current < p.goodput_daly
    text = planner.format_plan(p)
    assert "Daly interval" in text and "56.7 min" in text and "current interval" in text


def test_estimate_from_events():
    ev = [
        {"t": 0.0, "event": "start"},
        {"t": 1.0, "event": "workers_up", "attempt": 0},
        *(
            {"t": 10.0 * k, "event": "saved", "rank": 0, "step": k, "seconds": 0.5}
            for k in range(1, 6)
        ),
        {"t": 55.0, "event": "failure", "attempt": 0, "t_fail": 54.0, "t_detect": 55.0, "step": 50},
        {"t": 58.0, "event": "workers_up", "attempt": 1},
        {"t": 60.0, "event": "loaded", "attempt": 1, "rank": 0, "step": 50},
        {"t": 100.0, "event": "finish"},
    ]
    est = planner.estimate_from_events(ev)
    assert est == {
        "ckpt_cost": 0.5,
        "mtbf": 100.0,
        "restart_cost": 1.0 + 3.0 + 2.0,
        "current": 10.0,
        "failures": 1,
        "window": 100.0,
        "saves": 5,
    }
    assert planner.estimate_from_events([{"t": 0.0, "event": "start"}])["mtbf"] is None


@pytest.mark.parametrize(("c", "m"), [(0, 10), (5, 0), (-1, 10)])
def test_validation(c, m):
    with pytest.raises(ValueError):
        planner.daly_interval(c, m)
    with pytest.raises(ValueError):
        planner.expected_goodput(0, 1, 10)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.007, "7 ms"),
        (0.0123, "12.3 ms"),
        (4e-5, "40 us"),
        (0.5, "500 ms"),
        (2.5, "2.50 s"),
        (33.04, "33.0 s"),
        (90, "1.5 min"),
        (7200, "2.00 h"),
        (0, "0.0 s"),
    ],
)
def test_durations_keep_small_values_readable(seconds, text):
    assert planner._dur(seconds) == text


def test_mtbf_interval_matches_chi_square_tables():
    # chi2(0.95; 4) = 9.488, chi2(0.05; 2) = 0.1026: one failure in T -> [0.211 T, 19.5 T]
    lo, hi = planner.mtbf_interval(1, 100.0)
    assert lo == pytest.approx(200 / 9.4877, rel=1e-3) and hi == pytest.approx(
        200 / 0.10259, rel=1e-3
    )
    # chi2(0.95; 22) = 33.924, chi2(0.05; 20) = 10.851
    lo, hi = planner.mtbf_interval(10, 1000.0)
    assert lo == pytest.approx(2000 / 33.924, rel=1e-3) and hi == pytest.approx(
        2000 / 10.851, rel=1e-3
    )


def _run_dir(tmp_path, events):
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(tmp_path)


def test_plan_from_a_short_run_warns_that_m_rests_on_one_failure(tmp_path, capsys):
    # what `unbroken drill` leaves: one injected failure, 7 ms saves, 33 s of running
    ev = [
        {"t": 0.0, "event": "start"},
        {"t": 0.5, "event": "workers_up", "attempt": 0},
        *(
            {"t": 1.0 + k, "event": "saved", "rank": 0, "step": 5 * k, "seconds": 0.007}
            for k in range(1, 5)
        ),
        {"t": 20.0, "event": "failure", "attempt": 0, "t_fail": 19.8, "t_detect": 20.0, "step": 21},
        {"t": 24.0, "event": "workers_up", "attempt": 1},
        {"t": 25.0, "event": "loaded", "attempt": 1, "rank": 0, "step": 20},
        {"t": 33.0, "event": "finish"},
    ]
    assert cli.main(["plan", "--run-dir", _run_dir(tmp_path, ev)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint cost C = 7 ms, MTBF M = 33.0 s" in out
    assert "warning: M = 33.0 s rests on 1 failure in 33.0 s" in out
    assert "fewer than 10 failures and less than a day of running" in out
    assert "90% confidence interval is 6.96 s to 10.7 min" in out and "--mtbf" in out
    # a given M carries no evidence to doubt
    assert cli.main(["plan", "--run-dir", str(tmp_path), "--mtbf", "86400"]) == 0
    assert "warning" not in capsys.readouterr().out
    many = planner.plan(60.0, 3600.0, failures=40, window=40 * 3600.0)
    assert "warning" not in planner.format_plan(many)


def test_plan_says_why_it_cannot_measure(tmp_path, capsys):
    assert cli.main(["plan", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has no events.jsonl: nothing to measure there" in err and "--ckpt-cost" in err
    _run_dir(tmp_path, [{"t": 0.0, "event": "start"}, {"t": 5.0, "event": "finish"}])
    assert cli.main(["plan", "--run-dir", str(tmp_path), "--ckpt-cost", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot plan without --mtbf" in err and "holds no failure" in err
    assert "no checkpoint save" not in err  # C was given


def test_two_tiers_optimum_and_what_it_buys():
    """issue 25 item 4: with a cheap memory tier covering a fraction f of the failures, the
    planner suggests K (memory) and N (disk) in steps from the first-order two-level optimum
    T_m = sqrt(2 c_m M / f), T_d = sqrt(2 C M / (1 - f)), and the goodput beats disk alone."""
    p = planner.memory_plan(
        memory_cost=0.002, disk_cost=2.0, mtbf=6 * HOUR, step_time=1.0, memory_fraction=0.9
    )
    t_m = (2 * 0.002 * 6 * HOUR / 0.9) ** 0.5  # 9.8 s
    t_d = (2 * 2.0 * 6 * HOUR / 0.1) ** 0.5  # 929 s
    assert p.every_k == round(t_m) and p.every_n % p.every_k == 0
    assert abs(p.every_n - t_d) <= p.every_k
    assert p.goodput > p.goodput_disk_only
    text = planner.format_memory_plan(p)
    assert f"memory every K = {p.every_k} steps" in text and f"disk every N = {p.every_n}" in text
    # a memory publish costing more than a step's worth of waste: K grows, never below 1
    slow = planner.memory_plan(
        memory_cost=5.0, disk_cost=10.0, mtbf=HOUR, step_time=0.01, memory_fraction=0.5
    )
    assert slow.every_k >= 1 and slow.every_n >= slow.every_k
    with pytest.raises(ValueError, match="memory_fraction"):
        planner.memory_plan(
            memory_cost=0.01, disk_cost=1.0, mtbf=HOUR, step_time=1.0, memory_fraction=1.0
        )


def test_memory_statement_counts_the_peer_replica():
    """issue 25 peer replica item 4: the plan states the memory the tier takes per rank:
    its two slots, and with the peer replica (several nodes) one peer's slot more: 3x the
    per-rank state."""
    from dataclasses import replace

    p = planner.memory_plan(
        memory_cost=0.002, disk_cost=2.0, mtbf=6 * HOUR, step_time=1.0, memory_fraction=0.9
    )
    text = planner.format_memory_plan(replace(p, memory_bytes=2 << 30))
    assert "it holds 2.00 GiB per rank (2 slots)" in text, text
    assert "3.00 GiB per rank with the peer replica (3x the per-rank state)" in text, text


def test_plan_measures_the_memory_tier_from_the_run(tmp_path, capsys):
    """issue 25 item 4: `unbroken plan --run-dir` takes the memory tier's measured cost
    (the Checkpointer's `saved` events carry the mean publish stall), the step time (saved
    events' steps and times) and the share of failures restored from memory (the restore's
    tier), and prints K and N."""
    ev = [
        {"t": 0.0, "event": "start"},
        {"t": 1.0, "event": "workers_up", "attempt": 0},
        *(
            {
                "t": 10.0 * k,
                "event": "saved",
                "rank": 0,
                "step": 100 * k,
                "seconds": 0.5,
                "memory_seconds": 0.001,
                "memory_every": 1,
                "memory_bytes": 3 << 20,
            }
            for k in range(1, 6)
        ),  # fmt: skip
        {
            "t": 55.0,
            "event": "failure",
            "attempt": 0,
            "t_fail": 54.0,
            "t_detect": 55.0,
            "step": 530,
        },
        {"t": 58.0, "event": "workers_up", "attempt": 1},
        {"t": 60.0, "event": "loaded", "attempt": 1, "rank": 0, "step": 530, "tier": "memory"},
        {"t": 100.0, "event": "finish"},
    ]
    est = planner.estimate_memory(ev)
    assert est["memory_cost"] == 0.001 and est["step_time"] == pytest.approx(0.1)
    assert est["memory_fraction"] == 1.0 and est["memory_bytes"] == 3 << 20
    assert cli.main(["plan", "--run-dir", _run_dir(tmp_path, ev), "--memory-fraction", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "memory tier: cost c_m = 1 ms per publish" in out and "memory every K =" in out
    assert "3.0 MiB" in out  # what the tier holds per rank
    # without a memory tier in the run, nothing about it unless the cost is given
    plain = [e for e in ev if e["event"] != "saved"] + [
        {"t": 10.0 * k, "event": "saved", "rank": 0, "step": 100 * k, "seconds": 0.5}
        for k in range(1, 6)
    ]
    assert cli.main(["plan", "--run-dir", _run_dir(tmp_path, plain)]) == 0
    assert "memory tier" not in capsys.readouterr().out
